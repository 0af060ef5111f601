"""`AgentServerExecutor`: agents written against the OpenAI API, trained from what they asked.

The whole agent is one user function:

    async def run_agent(client, prompt, label):
        reply = await client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": prompt}], max_tokens=32)
        ...                                   # more turns, tool calls, anything
        return 1.0                            # or {"reward": 1.0, "scores": ..., "extra_logs": {...}}

`client` is an `openai.AsyncOpenAI` whose base URL is an `AgentServer` over the run's engine and
whose every request names the episode's session (header `X-Session-ID`; plain HTTP code reads
`client.base_url` and `client.default_headers`). With `api_key_env` the server wants a key and
the client carries it (`client.api_key`, and `Authorization` in `client.default_headers`), so the
agent is the same with or without one. Per prompt, `sampling.n` episodes run
concurrently, each in its own session; when `run_agent` returns, its session's captured tokens
become one `rl_data.Trajectory`:

    prompt_ids    = the first request's rendered messages
    response_ids  = a₀ d₁ a₁ d₂ a₂ …   (aₖ the engine's replies, dₖ the new messages of request k)
    action_mask   = 1 on every aₖ, 0 on every dₖ;  rollout_logprobs = the engine's on aₖ, 0.0 on dₖ
    reward        = what run_agent returned;  finish_reason = the last reply's ("length" if truncated)

Rewritten histories (thinking templates that drop earlier reasoning, agents that send replies
back edited): with `history="segments"` a session may hold several segments
(`rl_rollout.agent_server`), and its episode becomes one record per segment, in order, each exact
token-in/token-out with its own prompt, response and masks, all with the episode's reward, score
and group id, and `extra["segment"] = {"episode": j, "index": k, "count": n}`
(`rl_rollout.episodes`): the trainer takes an episode's segments as one episode (its advantage),
never as more members of the group.

The server runs for one `run` call (started on demand, stopped when the episodes are done, its
port freed). An episode that raises, returns something that is not a reward, makes no request,
or outlives `episode_timeout_s` fails: `on_error="raise"` raises `EpisodeError` naming the sample,
`"fallback"` keeps what the session captured with finish "abort" and reward = `fallback`.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import numbers
import ssl
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from rl_data import PromptSample, Trajectory
from rl_data.errors import check_integer

from .agent_server import AgentServer, SessionRecord, require_agent_extra
from .bounded import UserLoop
from .episodes import segment_extra
from .executors import (
    EpisodeError,
    _check_samples,
    _describe,
    _episode_metrics,
    _GroupCounter,
    _loggable,
    _prompt_text,
    _run_sync,
    _sample_extra,
    _shim_installed,
    _token_versions,
)
from .protocol import Engine, SamplingParams
from .rewards import ON_ERROR, load_python_file

__all__ = ["AgentServerExecutor", "load_run_agent"]

logger = logging.getLogger(__name__)

SESSION_SEED_STRIDE = 1 << 16
"""With `sampling.seed` s, request k of episode j samples with seed s + j·stride + k (the
episodes of one prompt draw different tokens; a prompt's requests up to `stride` apart)."""


def load_run_agent(spec: str | Path | Callable[..., Any]) -> Callable[..., Any]:
    """The agent function: a callable, "path/to/file.py" (its `run_agent`) or "file.py:NAME".

    The function must be `async def NAME(client, prompt, label)`; errors name the file and what
    is wrong."""
    if callable(spec):
        function, where = spec, getattr(spec, "__qualname__", repr(spec))
    else:
        path, name = str(spec), "run_agent"
        head, colon, tail = path.rpartition(":")
        if colon and head.endswith(".py") and tail.isidentifier():
            path, name = head, tail
        with _shim_installed():  # an OpenRLHF agent file imports, to be named as one below
            module = load_python_file(path, "agent")
        function = getattr(module, name, None)
        where = f"agent file {path!r}"
        if function is None:
            hint = ""
            if hasattr(module, "AgentInstance") or hasattr(module, "AgentExecutor"):
                hint = " (it is an OpenRLHF agent file: rollout.executor multi_turn runs those)"
            raise AttributeError(
                f"{where} defines no {name}; expected `async def {name}(client, prompt, label)`{hint}"
            )
    if not inspect.iscoroutinefunction(function):
        raise TypeError(f"{where}: the agent function must be `async def run_agent(client, prompt, label)`")
    try:
        inspect.signature(function).bind(None, None, None)
    except TypeError:
        raise TypeError(
            f"{where}: the agent function must take (client, prompt, label), "
            f"it has {inspect.signature(function)}"
        ) from None
    return function


def _reward(value: Any, field: str) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise EpisodeError(f"run_agent returned {field!r} with {value.numel()} values, expected one")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        raise EpisodeError(f"run_agent returned {field} = {value!r}, expected a finite number")
    return float(value)


def _agent_result(result: Any) -> tuple[float, float, dict[str, Any]]:
    """(reward, score, extra_logs) from what run_agent returned: a number or a dict."""
    if isinstance(result, Mapping):
        if "reward" not in result:
            raise EpisodeError(
                f"run_agent returned a dict without 'reward' (keys: {sorted(map(str, result))})"
            )
        reward = _reward(result["reward"], "reward")
        score = _reward(result["scores"], "scores") if result.get("scores") is not None else reward
        logs = result.get("extra_logs") or {}
        if not isinstance(logs, Mapping):
            raise EpisodeError(
                f"run_agent returned extra_logs of type {type(logs).__name__}, expected a dict"
            )
        return reward, score, _loggable(logs)
    reward = _reward(result, "the reward")
    return reward, reward, {}


class AgentServerExecutor:
    """Episodes of an OpenAI-API agent function over an `AgentServer`; one `Trajectory` each.

    Args:
      engine: any `Engine`.
      tokenizer: the policy's tokenizer, with a chat template.
      sampling: request defaults (temperature, top_p, max_new_tokens, stop); `sampling.n`
        episodes per prompt. With a seed s, request k of episode j uses s + j·2¹⁶ + k (a request's
        own seed wins).
      agent: the agent function or where it is (`load_run_agent`).
      max_length: prompt + response tokens of one episode; default `engine.max_model_len`.
      episode_timeout_s: hard limit on one `run_agent` call.
      max_concurrency: episodes in flight at once.
      on_error: "raise" or "fallback" (see the module docstring).
      fallback: the reward of a failed episode under on_error="fallback".
      model_name: the model name requests must give.
      tool_parser: how replies to requests with `tools` are parsed (`rl_rollout.tools.TOOL_PARSERS`).
      first_group_id: group id of the first prompt; later prompts count up from there.
      history: "append" (a request must extend its session's conversation) or "segments" (a
        rewritten history opens a new segment: one record per segment), `rl_rollout.HISTORY_MODES`.
      api_key_env: NAME of an environment variable holding the key the server requires
        (`AgentServer`); each episode's client is given it. Unset or empty: refused here, naming it.
      max_queue: the server's bound on requests in flight or waiting (one more gets 503 with
        Retry-After); None: 4 · max_concurrency, which one request per episode never reaches.
        Refusals of a run are in `last_metrics` as `rollout/server_busy` (503) and
        `rollout/server_unauthorized` (401), and a warning line names them.
    """

    def __init__(
        self,
        engine: Engine,
        tokenizer: Any,
        sampling: SamplingParams,
        *,
        agent: str | Path | Callable[..., Any],
        max_length: int | None = None,
        episode_timeout_s: float = 600.0,
        max_concurrency: int = 64,
        on_error: str = "raise",
        fallback: float = 0.0,
        model_name: str = "policy",
        tool_parser: str = "hermes",
        first_group_id: int = 0,
        history: str = "append",
        api_key_env: str | None = None,
        max_queue: int | None = None,
    ) -> None:
        if not isinstance(engine, Engine):
            raise TypeError(f"engine: expected an rl_rollout Engine, got {type(engine).__name__}")
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling: expected SamplingParams, got {type(sampling).__name__}")
        check_integer("max_concurrency", max_concurrency, 1)
        limit = check_integer("max_length", engine.max_model_len if max_length is None else max_length, 2)
        if not (isinstance(episode_timeout_s, (int, float)) and 0 < episode_timeout_s < math.inf):
            raise ValueError(
                f"episode_timeout_s: {episode_timeout_s!r} is not allowed; expected a number > 0"
            )
        if on_error not in ON_ERROR:
            raise ValueError(f"on_error: {on_error!r} is not allowed; expected one of {ON_ERROR}")
        require_agent_extra()
        self.agent = load_run_agent(agent)
        self.engine, self.tokenizer, self.sampling = engine, tokenizer, sampling
        self.max_length, self.episode_timeout_s = limit, float(episode_timeout_s)
        self.max_concurrency, self.on_error, self.fallback = max_concurrency, on_error, float(fallback)
        self.model_name, self.tool_parser = model_name, tool_parser
        self._groups = _GroupCounter(first_group_id)
        self.server = AgentServer(
            engine,
            tokenizer,
            sampling,
            max_length=limit,
            model_name=model_name,
            tool_parser=tool_parser,
            request_timeout_s=self.episode_timeout_s,  # no request outlives its episode
            history=history,
            api_key_env=api_key_env,
            max_queue=4 * max_concurrency if max_queue is None else max_queue,
        )
        self.history = history
        self.last_metrics: dict[str, float] = {}
        self._tls = ssl.create_default_context()  # one for every episode's client (`_run_agent`)

    async def _run_agent(self, session: str, prompt: str, label: Any) -> Any:
        """One `run_agent` call with a client of its own (on the episode's own loop).

        The clients share one TLS context: an HTTP client builds its own by default, loading the
        CA certificates (37 CPU-ms a client on 2 cores, ~5 CPU-s a step of 128 episodes), which
        a client of the local plain-HTTP server never uses."""
        import openai

        key = self.server.api_key
        headers = {"X-Session-ID": session}
        if key is not None:  # also in default_headers, for agents that speak plain HTTP
            headers["Authorization"] = f"Bearer {key}"
        client = openai.AsyncOpenAI(
            base_url=self.server.url + "/v1",
            api_key="EMPTY" if key is None else key,
            max_retries=0,
            timeout=self.episode_timeout_s,
            default_headers=headers,
            http_client=openai.DefaultAsyncHttpxClient(verify=self._tls),
        )
        try:
            return await self.agent(client, prompt, label)
        finally:
            await client.close()

    async def _episode(
        self, sample: PromptSample, sample_number: int, semaphore: asyncio.Semaphore
    ) -> tuple[SessionRecord, float, float, dict[str, Any], str | None]:
        server = self.server
        seed = (
            None if self.sampling.seed is None else self.sampling.seed + sample_number * SESSION_SEED_STRIDE
        )
        session = server.open_session(seed=seed)
        reward, score, logs, error = self.fallback, self.fallback, {}, None
        async with semaphore:
            # run_agent on a loop and thread of its own: an agent that blocks (time.sleep,
            # requests.post) holds only its episode, and the deadline fires on time
            user = UserLoop(f"rl-agent-episode-{sample_number}")
            try:
                result = await asyncio.wait_for(
                    user.call(self._run_agent, session, _prompt_text(sample, self.tokenizer), sample.label),
                    self.episode_timeout_s,
                )
                reward, score, logs = _agent_result(result)
                if server.peek(session).requests == 0:
                    raise EpisodeError("run_agent made no chat completion request in its session")
            except Exception as failure:
                if isinstance(failure, (asyncio.TimeoutError, TimeoutError)):
                    stuck = f"; abandoned, run_agent was at {user.stuck()}" if user.busy_since else ""
                    reason = f"timed out after {self.episode_timeout_s} s{stuck}"
                else:
                    reason = f"failed: {failure!r}"
                where = (
                    f"AgentServerExecutor: episode {sample_number} of sample ({_describe(sample)}) {reason}"
                )
                if self.on_error == "raise":
                    server.close_session(session)
                    raise EpisodeError(where) from failure
                logger.warning("%s; reward = fallback %s", where, self.fallback)
                reward, score, logs, error = self.fallback, self.fallback, {}, where
            finally:
                user.close()
        return server.close_session(session), reward, score, logs, error

    async def arun(
        self, samples: Sequence[PromptSample], *, group_ids: Sequence[int] | None = None
    ) -> list[Trajectory]:
        """`len(samples) · sampling.n` records, prompt-major, from concurrent episodes; the
        server runs for the duration of this call."""
        samples = _check_samples(samples, "AgentServerExecutor")
        if not samples:
            return []
        groups = self._groups.take(len(samples), group_ids, "AgentServerExecutor")
        started = time.monotonic()
        server = self.server
        await asyncio.to_thread(server.start)
        semaphore = asyncio.Semaphore(self.max_concurrency)
        tasks = [
            asyncio.ensure_future(self._episode(sample, number, semaphore))
            for sample in samples
            for number in range(self.sampling.n)
        ]
        try:
            results = await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.to_thread(server.stop)
        records = []
        for position, result in enumerate(results):
            sample = samples[position // self.sampling.n]
            group = groups[position // self.sampling.n]
            records += self._records(sample, group, position % self.sampling.n, *result)
        self.last_metrics = _episode_metrics(records, started)
        self.last_metrics["rollout/server_busy"] = float(server.refusals["busy"])
        self.last_metrics["rollout/server_unauthorized"] = float(server.refusals["unauthorized"])
        if any(server.refusals.values()):
            logger.warning(
                "AgentServerExecutor: the agent server refused %d requests as busy (503, max_queue %d) "
                "and %d without the API key (401) during this run",
                server.refusals["busy"],
                server.max_queue,
                server.refusals["unauthorized"],
            )
        if len(records) > len(results):  # rewritten histories: more records than episodes
            self.last_metrics["rollout/episodes"] = float(len(results))
            self.last_metrics["rollout/segments_per_episode"] = len(records) / len(results)
        return records

    def _records(
        self,
        sample: PromptSample,
        group: int,
        episode: int,
        session: SessionRecord,
        reward: float,
        score: float,
        logs: dict[str, Any],
        error: str | None,
    ) -> list[Trajectory]:
        """One record per segment of an episode's session (one, unless its history was rewritten)."""
        segments = session.all_segments()
        records = []
        for index, segment in enumerate(segments):
            last = index == len(segments) - 1
            extra = {
                **_sample_extra(sample),
                "turns": len(segment.finish_reasons),
                "action_ranges": [list(r) for r in segment.action_ranges],
                "extra_logs": logs,
            }
            if len(segments) > 1:
                extra["segment"] = segment_extra(episode, index, len(segments))
            if session.used_tools and last:  # once per episode, as the tool executor's (rollout/tools/...)
                extra["tools"] = {"calls": session.tool_calls, "malformed": session.tool_call_errors}
            finish = session.finish_reason if last else segment.finish_reason
            if error is not None:
                extra["episode_error"] = error
                finish = "abort"
            records.append(
                Trajectory(
                    prompt_ids=segment.prompt_ids or sample.prompt_ids.tolist(),
                    response_ids=segment.response_ids,
                    rollout_logprobs=segment.logprobs,
                    action_mask=segment.action_mask,
                    reward=reward,
                    score=score,
                    group_id=group,
                    policy_version=segment.policy_version,
                    token_versions=_token_versions(segment),
                    finish_reason=finish,
                    label=sample.label,
                    extra=extra,
                )
            )
        return records

    def run(
        self, samples: Sequence[PromptSample], *, group_ids: Sequence[int] | None = None
    ) -> list[Trajectory]:
        """`arun` from synchronous code (no event loop may be running in this thread)."""
        return _run_sync(self.arun(samples, group_ids=group_ids), "AgentServerExecutor")

    def close(self) -> None:
        """Stop the server if a `run` left it up (it does not, unless interrupted)."""
        self.server.stop()
