"""verifiers environments as `MultiTurnExecutor` environments: the env's own `run()` drives each
episode and our engine plays its seat (`pip install 'rl-rollout[verifiers]'`).

A verifiers 0.4 env (`vf.Env`; `SingleAgentEnv` for a taskset module that exports none) plays
an episode in `run(task, agents)`: it opens `agents.<seat>.interaction(task)` and calls
`segment = await interaction.turn(message)` for each model turn (a bare `turn()` first when the
task has a prompt; `segment.last_reply` is the model's answer, `segment.terminated` says the run
ended instead), then scores the trace (`Task.score`) when the interaction closes; `SingleAgentEnv`
runs `agents.agent.run(task)`, one turn on the prompt. `VerifiersEpisode` runs that coroutine on
the episode's own event loop (`rl_rollout.bounded.UserLoop`) and hands the model turns to the
executor; the labels name the task (`rl_rollout.verifiers_env.verifiers_rows`):

    reset:   env.setup(agents), env.run(task, agents) start; at the seat's first model turn the
             messages so far (system prompt, prompt, or the env's opening messages) are rendered
             with the chat template and its generation prompt: the first observation
    step:    the decoded action is the seat's reply (a sampled assistant message on the trace);
             run() goes on to the next model turn, whose new messages are the step's
             "environment_messages" (environment tokens), or to its end: the interaction's
             scoring, then env.finalize(task, episode); done, reward = trace.reward
             (Σ weight·score), the rubric's scores and metrics as extra logs

Before each model turn the seat's limits apply as in verifiers: `max_turns` (the smaller of the
seat's `vf.AgentConfig.max_turns` and the executor's) and the task's `@vf.stop`s on the Trace;
the turn is then refused (`terminated`), so run() ends and the episode is scored within the
executor's turns. An episode the executor cuts at its length limit is not scored (reward 0).

Deadlines: the whole episode is under the executor's `episode_timeout_s` (a stuck call is
abandoned with its thread); inside it the env's own `timeout.episode` (setup and run) and
`timeout.finalize`, and scoring's (the seat's or task's `timeout.scoring`, else
`scoring_timeout_s`). What run() or a rubric function raises fails the episode, which follows the
executor's `on_error`. One seat, one interaction and one conversation per episode: an env that
opens a second interaction, steers it, or asks for a runtime or tools is refused by name.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from rl_data.errors import check_integer

from .rewards import _check_timeout
from .verifiers_env import (
    DEFAULT_SCORING_TIMEOUT_S,
    VerifiersDeadline,
    add_message,
    chat_messages,
    import_verifiers,
    new_trace,
    opening_messages,
    score_trace,
    scoring_timeout,
    task_of_label,
)

__all__ = ["VerifiersEpisode", "verifiers_env_factory"]


async def _within(awaitable: Any, seconds: float | None, what: str) -> Any:
    if seconds is None:
        return await awaitable
    try:
        return await asyncio.wait_for(awaitable, seconds)
    except asyncio.TimeoutError:
        raise VerifiersDeadline(f"{what} ran past its {seconds:g} s deadline") from None


class _Interaction:
    """verifiers' `Interaction` as env code uses it, for the seat our engine plays: `turn`,
    `trace`, `close`. Each model turn is asked of the episode (`VerifiersEpisode._ask`)."""

    def __init__(self, seat: _Seat, task: Any) -> None:
        self._seat, self._task = seat, task
        self.trace = new_trace(task, seat.name)
        self._started = self._over = self._closed = False
        self._lock = asyncio.Lock()

    def _messages(self, message: Any) -> list[Any]:
        """The messages a turn adds: the opening ones on the first turn, then the turn's own."""
        from verifiers.v1.dialects import parse_message

        prompted = not self._started and self._task.data.prompt is not None
        if message is None and not prompted:
            raise ValueError(
                "nothing to run a turn on: a bare turn() takes a prompted task's opening reply; this "
                "exchange takes its next user message"
            )
        if message is not None and prompted:
            raise ValueError("the task's prompt opens this exchange: take its first reply with a bare turn()")
        vf = import_verifiers()
        new = [] if self._started else opening_messages(self._task.data)
        if isinstance(message, str):
            new.append(vf.UserMessage(content=message))
        elif message is not None:
            new.extend(parse_message(item) if isinstance(item, Mapping) else item for item in message)
        return new

    async def _refusal(self) -> str | None:
        """The limit or `@vf.stop` that refuses the next model turn, checked as verifiers does."""
        from verifiers.v1.session import call_hook

        vf = import_verifiers()
        if self._seat.max_turns is not None and self.trace.num_turns >= self._seat.max_turns:
            return "max_turns"
        for stop in self._task.hooks("stop"):
            fired = await call_hook(stop, {vf.Trace: self.trace})
            if not isinstance(fired, bool):
                raise TypeError(f"@vf.stop {stop.__name__} must return bool, got {type(fired).__name__}")
            if fired:
                return stop.__name__
        return None

    async def turn(self, message: Any = None) -> Any:
        """One model turn on `message` (str, or messages): its `vf.Segment`."""
        vf = import_verifiers()
        async with self._lock:
            if self._closed:
                raise RuntimeError("this interaction is closed")
            if self._over:
                raise RuntimeError("the exchange is over (the run ended); read interaction.trace")
            new = self._messages(message)
            self._started = True
            if (reason := await self._refusal()) is not None:
                self.trace.stop(reason)
                self._over = True
                return vf.Segment(messages=[], terminated=True)
            for item in new:
                add_message(self.trace, item)
            reply = vf.AssistantMessage(content=await self._seat.ask(new))
            add_message(self.trace, reply, sampled=True)
            return vf.Segment(messages=[reply])

    async def send(self, *args: Any, **kwargs: Any) -> dict:
        raise NotImplementedError("interaction.send/steer: rl-rollout plays turns only (interaction.turn)")

    steer = send

    async def close(self) -> Any:
        """End the exchange (`user_closed`) and score the trace (idempotent)."""
        async with self._lock:
            if not self._closed:
                self._closed = True
                self.trace.stop("user_closed")
                timeout_s = scoring_timeout(self._task, self._seat.scoring_timeout_s, self._seat.config)
                await score_trace(self._task, self.trace, timeout_s=timeout_s, where=self._seat.where)
                self.trace.is_completed = self.trace.ok = True
        return self.trace


class _Seat:
    """verifiers' `Agent` as env code uses it (`interaction`, `run`, `trainable`), played by our
    engine: each model turn is `ask`ed of the episode."""

    def __init__(
        self, name: str, config: Any, *, ask: Callable, max_turns: int, scoring_timeout_s: Any, where: str
    ):
        self.name, self.config, self.ask, self.where = name, config, ask, where
        own = config.max_turns
        self.max_turns = max_turns if own is None else min(own, max_turns)
        self.scoring_timeout_s = scoring_timeout_s
        self.trainable = True  # an env's setup() may set it; our one seat is the policy either way
        self.interaction_opened: _Interaction | None = None

    @contextlib.asynccontextmanager
    async def interaction(
        self, task: Any, *, runtime: Any = None, tools: Any = None, on_trace: Any = None
    ) -> AsyncIterator[_Interaction]:
        if runtime is not None or tools:
            raise ValueError(
                f"{self.where}: interaction(runtime=, tools=) needs a runtime or tools, which rl-rollout does not run"
            )
        if self.interaction_opened is not None:
            raise RuntimeError(
                f"{self.where}: run() opened a second interaction of seat {self.name!r}; rl-rollout trains one "
                "conversation per episode"
            )
        interaction = self.interaction_opened = _Interaction(self, task)
        if on_trace is not None:
            on_trace(interaction.trace)
        try:
            yield interaction
        except Exception as error:
            interaction.trace.record_error(error)
            raise
        await interaction.close()

    async def run(self, task: Any, *, runtime: Any = None, tools: Any = None, on_trace: Any = None) -> Any:
        """One model turn on the task's prompt, then scoring: `SingleAgentEnv`'s episode."""
        if task.data.prompt is None:
            raise ValueError(
                f"{self.where}: task {task.data.idx} has no prompt for run() to answer; a task without one "
                "needs an env whose run() opens the conversation (interaction.turn(message))"
            )
        async with self.interaction(task, runtime=runtime, tools=tools, on_trace=on_trace) as interaction:
            await interaction.turn()
            interaction.trace.stop("agent_completed")
        return interaction.trace


class VerifiersEpisode:
    """One episode of a verifiers env, as a `MultiTurnExecutor` environment (module docstring).

    Args:
      tokenizer: renders the first observation with its chat template.
      max_turns: the executor's `max_turns` (the seat's own, when smaller, wins).
      scoring_timeout_s: deadline of the trace's scoring where the seat and task set none.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        max_turns: int = 8,
        scoring_timeout_s: float | None = DEFAULT_SCORING_TIMEOUT_S,
    ) -> None:
        self.tokenizer = tokenizer
        self.max_turns = check_integer("max_turns", max_turns, 1)
        self.scoring_timeout_s = _check_timeout(scoring_timeout_s)
        self._requests: asyncio.Queue | None = None
        self._reply: asyncio.Future | None = None
        self._run: asyncio.Task | None = None

    async def _ask(self, messages: list[Any]) -> str:
        """The seat's model turn: hand `messages` to the executor, wait for the action text."""
        reply = asyncio.get_running_loop().create_future()
        await self._requests.put((messages, reply))
        return await reply

    async def _play(self, environment: Any, task: Any, seat: _Seat) -> Any:
        """setup, run and finalize of the env, as verifiers' `Env.run_episode` calls them."""
        vf = import_verifiers()
        env = environment.new_env()
        agents = vf.Agents(environment.env_config, lambda name, config: seat)
        name = environment.env_class.__name__

        async def setup_and_run() -> None:
            await env.setup(agents)
            await env.run(task, agents)

        timeouts = environment.env_config.timeout
        await _within(setup_and_run(), timeouts.episode, f"{environment.name}: {name}.run()")
        if seat.interaction_opened is None:
            raise ValueError(
                f"{environment.name}: {name}.run() ran no agent; every episode must carry one run"
            )
        trace = await seat.interaction_opened.close()  # an interaction left open is closed, as verifiers does
        episode = vf.Episode(
            env=vf.EnvInfo(id=environment.name),
            task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
            traces=[trace],
        )
        await _within(
            env.finalize(task, episode), timeouts.finalize, f"{environment.name}: {name}.finalize()"
        )
        episode.ok = trace.ok
        return trace

    async def _next(self) -> tuple[list[Any], asyncio.Future] | None:
        """The next model turn run() asks for, or None when run() ended (what it raised, raised)."""
        getter = asyncio.ensure_future(self._requests.get())
        done, _ = await asyncio.wait({getter, self._run}, return_when=asyncio.FIRST_COMPLETED)
        if getter in done:
            return getter.result()
        getter.cancel()
        self._run.result()
        return None

    async def reset(self, states: Mapping[str, Any]) -> dict[str, Any]:
        environment, task = task_of_label(states.get("label"))
        seat = _Seat(
            environment.seat,
            getattr(environment.env_config, environment.seat),
            ask=self._ask,
            max_turns=self.max_turns,
            scoring_timeout_s=self.scoring_timeout_s,
            where=environment.name,
        )
        self._requests = asyncio.Queue()
        self._run = asyncio.ensure_future(self._play(environment, task, seat))
        request = await self._next()
        if request is None:
            raise ValueError(f"{environment.name}: the episode ended before the model's first turn")
        messages, self._reply = request
        observation = self.tokenizer.apply_chat_template(
            chat_messages(messages), add_generation_prompt=True, tokenize=False
        )
        return {"observation": observation}

    async def step(self, states: Mapping[str, Any]) -> dict[str, Any]:
        if self._reply is None:
            raise RuntimeError("step() before reset()")
        self._reply.set_result(states["action_text"])
        request = await self._next()
        if request is not None:
            messages, self._reply = request
            return {"rewards": 0.0, "environment_messages": chat_messages(messages), "done": False}
        trace = self._run.result()
        logs = {name: value for name, value in trace.metrics.items() if value is not None}
        logs.update({name: reward.score for name, reward in trace.rewards.items() if reward is not None})
        reward = float(trace.reward)
        return {
            "rewards": reward,
            "scores": reward,
            "environment_feedback": "",
            "done": True,
            "extra_logs": logs,
        }

    async def close(self) -> None:
        """Cancel a run() the executor ended early (max_turns, length, an error)."""
        if self._run is not None and not self._run.done():
            self._run.cancel()
            with contextlib.suppress(BaseException):
                await self._run


def verifiers_env_factory(
    tokenizer: Any, *, max_turns: int = 8, scoring_timeout_s: float | None = DEFAULT_SCORING_TIMEOUT_S
) -> Callable[[], VerifiersEpisode]:
    """A zero-argument factory for `MultiTurnExecutor(env=..., max_turns=max_turns)`: one
    `VerifiersEpisode` per episode; the prompts' labels (of `verifiers_rows`) name the tasks."""
    check_integer("max_turns", max_turns, 1)
    _check_timeout(scoring_timeout_s)

    def factory() -> VerifiersEpisode:
        return VerifiersEpisode(tokenizer, max_turns=max_turns, scoring_timeout_s=scoring_timeout_s)

    return factory
