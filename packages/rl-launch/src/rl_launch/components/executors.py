"""Rollout executors: what turns a batch of prompts into scored records inside the rollout actor;
`rollout.executor` and its options `rollout.executor_options`.

An entry's builder is called as `build(*, engine, reward_fn, tokenizer, sampling, first_group_id,
agent_func_path, **options)` and returns an object with `run(samples) -> list[rl_data.Trajectory]`
(records prompt-major, group ids counting up from `first_group_id`). The keyword arguments in
`EXECUTOR_INPUTS` are supplied by the run; the others are the executor's options, verbatim. An
entry may declare `options` (option -> default, e.g. read from the executor class it builds);
without it they are read from the builder's signature.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError
from .base import ComponentKind, ComponentRegistry, Selection, component_options, dry_run

if TYPE_CHECKING:
    from ..config import PPOConfig

__all__ = [
    "EXECUTOR",
    "EXECUTORS",
    "EXECUTOR_INPUTS",
    "ExecutorEntry",
    "executor_name",
    "executor_options",
    "validation_engine",
]

EXECUTOR_INPUTS: frozenset[str] = frozenset(
    {"engine", "reward_fn", "tokenizer", "sampling", "first_group_id", "agent_func_path", "vision"}
)
"""What the rollout actor hands every executor builder itself: not options (`vision`, a VL
policy's `rl_data.vision.VisionProcessor`, only to builders whose entry `takes_vision`)."""


@dataclasses.dataclass(frozen=True)
class ExecutorEntry:
    """A rollout executor as the launcher sees it."""

    build: Callable[..., Any]
    """`build(*, engine, reward_fn, tokenizer, sampling, first_group_id, agent_func_path, **options)`."""
    options: Callable[[], Mapping[str, Any]] | None = None
    """Option -> default (imported lazily); None: `build`'s keyword arguments with a default."""
    runs_agent: bool = False
    """It runs the episodes of `rollout.agent_func_path`, whose own rewards are the reward."""
    load_agent: Callable[[str], Any] | None = None
    """How `check_components` loads that agent file to check it (imported lazily; None: as an
    OpenRLHF agent file, `rl_rollout.load_agent`). Raises ImportError / AttributeError /
    TypeError / ValueError naming what is wrong."""
    agent_kind: str = "an OpenRLHF agent .py file"
    """What the agent file must be, for the message when it is missing."""
    takes_vision: bool = False
    """It takes `vision=` (the run's `VisionProcessor` when the policy is a VL model): its
    environments may return images (`environment_images`)."""
    carries_routes: bool = False
    """It puts the engine's MoE routes on its records (`algo.policy.router_replay` needs them)."""
    scores_episodes: bool = False
    """Its environments score the episodes: the run's reward sources would never be called."""

    def option_defaults(self) -> dict[str, Any]:
        if self.options is not None:
            return dict(self.options())
        return component_options(self.build, inputs=EXECUTOR_INPUTS)


EXECUTORS = ComponentRegistry("rollout executor", ExecutorEntry)
"""Rollout executors by name -> `ExecutorEntry` (register a builder, with `options=` or not)."""


def executor_name(config: PPOConfig) -> str:
    """The executor a run uses: `rollout.executor`, or (unset) multi_turn when
    `rollout.agent_func_path` names an agent file, else single_turn."""
    rollout = config.rollout
    if rollout.executor is not None:
        return rollout.executor
    return "multi_turn" if rollout.agent_func_path is not None else "single_turn"


def executor_options(name: str) -> dict[str, Any]:
    """Option -> default of the executor registered as `name` (`"**"` when it takes any)."""
    return EXECUTORS[name].option_defaults()


def validation_engine(max_model_len: int) -> Any:
    """An engine that generates nothing, with a context length: `check_components` builds an
    executor on it to check the executor's options (executors only store their engine)."""
    from rl_rollout import Engine

    class NoEngine(Engine):
        name = "validation"

        @property
        def max_model_len(self) -> int:
            return max_model_len

        def generate(self, prompts: Any, params: Any) -> list:
            raise RuntimeError("check_components builds executors only to check their options")

    return NoEngine()


def _check_agent_file(agent: str, entry: ExecutorEntry) -> str:
    """The agent file as an absolute path, once the executor's loader accepts it."""
    from rl_rollout import load_agent

    path = Path(agent).expanduser()
    if not path.is_file():
        raise ConfigError(f"rollout.agent_func_path: agent file {agent!r} does not exist")
    if path.suffix != ".py":
        raise ConfigError(f"rollout.agent_func_path: {agent!r} is not a Python file ending in .py")
    try:
        (entry.load_agent or load_agent)(str(path))
    except (ImportError, AttributeError, TypeError, ValueError) as error:
        raise ConfigError(f"rollout.agent_func_path: {error}") from None
    return str(path.resolve())


def _select(config: PPOConfig) -> list[Selection]:
    name = executor_name(config)
    entry = EXECUTORS.get(name)
    takes = entry.option_defaults() if entry is not None else None
    return [
        Selection(
            "rollout.executor", name, "rollout.executor_options", config.rollout.executor_options, takes
        )
    ]


def _check(config: PPOConfig) -> None:
    """The agent file and the executor's options, by building it once on an engine that
    generates nothing (so a wrong value fails with the executor's own message)."""
    from rl_rollout import BatchedReward, SamplingParams

    rollout = config.rollout
    name = executor_name(config)
    entry = EXECUTORS[name]
    agent = rollout.agent_func_path
    if agent is not None and not entry.runs_agent:
        raise ConfigError(
            f"rollout.agent_func_path: {agent!r} is an agent file, but rollout.executor is {name}, "
            "which runs no agent; leave rollout.executor unset or set it to one that does "
            f"({', '.join(sorted(n for n, e in EXECUTORS.items() if e.runs_agent))})"
        )
    if entry.runs_agent and agent is None:
        raise ConfigError(
            f"rollout.executor: {name!r} runs the episodes of an agent file; set "
            f"rollout.agent_func_path to {entry.agent_kind}"
        )
    if entry.runs_agent or entry.scores_episodes:
        sources = [f"reward.{field}" for field in ("function", "remote_url") if getattr(config.reward, field)]
        if sources:
            whose = "agent" if entry.runs_agent else "environment"
            raise ConfigError(
                f"{sources[0]}: with rollout.executor {name} the {whose}'s own rewards are the "
                "reward and this source would never be called; leave it unset (a reward model, "
                "model.reward_pretrain, still adds its score)"
            )
    if config.algo.policy.router_replay != "disabled" and not entry.carries_routes:
        able = sorted(n for n, e in EXECUTORS.items() if e.carries_routes)
        raise ConfigError(
            f"algo.policy.router_replay: rollout executor {name!r} does not put the engine's MoE routes on "
            f"its records yet; executors that do: {', '.join(able)}"
        )
    agent_path = None if agent is None else _check_agent_file(agent, entry)
    zero = BatchedReward(lambda queries, prompts, labels: [0.0] * len(queries), name="zero")
    dry_run(
        "rollout.executor_options",
        f"rollout executor {name!r}",
        lambda: entry.build(
            engine=validation_engine(config.data.prompt_max_len + rollout.generate_max_len),
            reward_fn=zero,
            tokenizer=None,
            sampling=SamplingParams(n=rollout.n_samples_per_prompt, max_new_tokens=rollout.generate_max_len),
            first_group_id=0,
            agent_func_path=agent_path,
            **rollout.executor_options,
        ),
    )


EXECUTOR = ComponentKind(
    title="rollout executors",
    singular="rollout executor",
    registry=EXECUTORS,
    where="rollout.executor, options: rollout.executor_options; multi_turn runs rollout.agent_func_path",
    select=_select,
    options_of=executor_options,
    check=_check,
)


# --------------------------------------------------------------------------------------------
# The built-in executors.


def _single_turn_options() -> dict[str, Any]:
    from rl_rollout import SingleTurnExecutor

    return component_options(SingleTurnExecutor, inputs=EXECUTOR_INPUTS)


@EXECUTORS.register("single_turn", options=_single_turn_options, carries_routes=True)
def single_turn_executor(
    *,
    engine: Any,
    reward_fn: Any,
    tokenizer: Any,
    sampling: Any,
    first_group_id: int,
    agent_func_path: str | None,
    **options: Any,
) -> Any:
    """`rl_rollout.SingleTurnExecutor`: n responses per prompt, scored by the reward sources in one call."""
    from rl_rollout import SingleTurnExecutor

    del agent_func_path  # None: check_components refuses an agent file with single_turn
    return SingleTurnExecutor(
        engine, reward_fn, tokenizer, sampling, first_group_id=first_group_id, **options
    )


def _multi_turn_options() -> dict[str, Any]:
    from rl_rollout import MultiTurnExecutor

    return component_options(MultiTurnExecutor, inputs=EXECUTOR_INPUTS)


@EXECUTORS.register("multi_turn", options=_multi_turn_options, runs_agent=True, takes_vision=True)
def multi_turn_executor(
    *,
    engine: Any,
    reward_fn: Any,
    tokenizer: Any,
    sampling: Any,
    first_group_id: int,
    agent_func_path: str | None,
    **options: Any,
) -> Any:
    """`rl_rollout.MultiTurnExecutor`: episodes of the agent file rollout.agent_func_path.

    The reward of an episode is the sum of its step() rewards; environment tokens carry action
    mask 0 (no loss on them) and log-prob 0. With a VL policy, steps may return
    "environment_images" (`vision`: the policy's processor, handed by the rollout actor)."""
    from rl_rollout import MultiTurnExecutor

    del reward_fn  # the environment scores the episode
    if agent_func_path is None:
        raise ValueError("multi_turn needs an agent file (rollout.agent_func_path)")
    return MultiTurnExecutor(
        engine, tokenizer, sampling, env=agent_func_path, first_group_id=first_group_id, **options
    )


def _tool_call_options() -> dict[str, Any]:
    from rl_rollout import ToolCallExecutor

    return component_options(ToolCallExecutor, inputs=EXECUTOR_INPUTS)


@EXECUTORS.register("tool_call", options=_tool_call_options)
def tool_call_executor(
    *,
    engine: Any,
    reward_fn: Any,
    tokenizer: Any,
    sampling: Any,
    first_group_id: int,
    agent_func_path: str | None,
    **options: Any,
) -> Any:
    """`rl_rollout.ToolCallExecutor`: the model calls the tools of executor_options.tools (a
    "tools.py" with a TOOLS list, or "file.py:NAME"), parsed by executor_options.parser
    (rl_rollout.TOOL_PARSERS: hermes); results come back as tool messages (environment tokens:
    action mask 0, log-prob 0) until an answer without calls, max_turns or max_tool_calls; the
    run's reward sources score the final answer."""
    from rl_rollout import ToolCallExecutor

    del agent_func_path  # None: check_components refuses an agent file here
    return ToolCallExecutor(engine, reward_fn, tokenizer, sampling, first_group_id=first_group_id, **options)


def _agent_server_options() -> dict[str, Any]:
    from rl_rollout import AgentServerExecutor

    return component_options(AgentServerExecutor, inputs=EXECUTOR_INPUTS | {"agent"})


def _load_run_agent(path: str) -> Any:
    from rl_rollout import load_run_agent

    return load_run_agent(path)


@EXECUTORS.register(
    "agent_server",
    options=_agent_server_options,
    runs_agent=True,
    load_agent=_load_run_agent,
    agent_kind="a .py file defining `async def run_agent(client, prompt, label)`",
)
def agent_server_executor(
    *,
    engine: Any,
    reward_fn: Any,
    tokenizer: Any,
    sampling: Any,
    first_group_id: int,
    agent_func_path: str | None,
    **options: Any,
) -> Any:
    """`rl_rollout.AgentServerExecutor`: episodes of the `run_agent(client, prompt, label)` in
    rollout.agent_func_path, driving the policy through an OpenAI-compatible server on 127.0.0.1
    that lives for the step.

    The reward of an episode is what run_agent returned; every session's tokens are captured
    exactly, the new messages of each request (user, tool results) with action mask 0."""
    from rl_rollout import AgentServerExecutor

    del reward_fn  # the agent scores the episode
    if agent_func_path is None:
        raise ValueError("agent_server needs an agent file (rollout.agent_func_path) defining run_agent")
    return AgentServerExecutor(
        engine, tokenizer, sampling, agent=agent_func_path, first_group_id=first_group_id, **options
    )


def _gym_text_options() -> dict[str, Any]:
    return {"env": None, "env_kwargs": {}, "render": "chat", **_multi_turn_options()}


@EXECUTORS.register("gym_text", options=_gym_text_options, scores_episodes=True)
def gym_text_executor(
    *,
    engine: Any,
    reward_fn: Any,
    tokenizer: Any,
    sampling: Any,
    first_group_id: int,
    agent_func_path: str | None,
    env: str | None = None,
    env_kwargs: dict[str, Any] | None = None,
    render: str = "chat",
    **options: Any,
) -> Any:
    """`rl_rollout.MultiTurnExecutor` over a Gymnasium-style text environment
    (`rl_rollout.gym_env`, duck-typed: reset(seed=, options=) -> (observation, info), step(action)
    -> (observation, reward, terminated, truncated, info)); executor_options.env names its class or
    function, "package.module:NAME" or "path/to/file.py:NAME", called with env_kwargs. Its first
    observation is the prompt (render chat: a user turn of the chat template; text: as it is), each
    later one the feedback; the reward is the sum of the step rewards, and the episode's seed is the
    prompt's label when it is an integer. Other options: multi_turn's (max_turns, episode_timeout_s,
    on_error, feedback, ...)."""
    from rl_rollout import MultiTurnExecutor
    from rl_rollout.gym_env import gym_env_factory

    del reward_fn, agent_func_path  # the environment scores the episode; it runs no agent file
    if env is None:
        raise ValueError("env is required: 'package.module:NAME' or 'path/to/file.py:NAME'")
    try:
        factory = gym_env_factory(env, env_kwargs=env_kwargs, render=render, tokenizer=tokenizer)
    except (ImportError, FileNotFoundError, AttributeError) as error:
        raise ValueError(str(error)) from None
    return MultiTurnExecutor(
        engine, tokenizer, sampling, env=factory, first_group_id=first_group_id, **options
    )


def _verifiers_options() -> dict[str, Any]:
    return {"scoring_timeout_s": 60.0, **_multi_turn_options()}


@EXECUTORS.register("verifiers", options=_verifiers_options, scores_episodes=True)
def verifiers_executor(
    *,
    engine: Any,
    reward_fn: Any,
    tokenizer: Any,
    sampling: Any,
    first_group_id: int,
    agent_func_path: str | None,
    max_turns: int = 8,
    scoring_timeout_s: float | None = 60.0,
    **options: Any,
) -> Any:
    """`rl_rollout.MultiTurnExecutor` over verifiers environments (`rl_rollout.verifiers_episode`):
    the prompts of --data.prompt_data verifiers:<taskset> name their tasks, the taskset module's
    own vf.Env (SingleAgentEnv when it exports none) plays each episode with the policy in its one
    seat, every model turn generated by the run's engine; the env's messages between turns are
    feedback (environment tokens) and the reward is the task's rubric on the finished trace
    (Σ weight·score, after the env's finalize). scoring_timeout_s bounds the rubric where the task
    sets no timeout.scoring; max_turns (the seat's own when smaller) refuses the turn after the
    last. Other options: multi_turn's (episode_timeout_s, on_error, fallback, ...)."""
    from rl_rollout import MultiTurnExecutor
    from rl_rollout.verifiers_episode import verifiers_env_factory

    del reward_fn, agent_func_path  # the environment scores the episode; it runs no agent file
    factory = verifiers_env_factory(tokenizer, max_turns=max_turns, scoring_timeout_s=scoring_timeout_s)
    return MultiTurnExecutor(
        engine,
        tokenizer,
        sampling,
        env=factory,
        max_turns=max_turns,
        first_group_id=first_group_id,
        **options,
    )
