"""Executors: turn prompts into scored `rl_data.Trajectory` records through any `Engine`.

`SingleTurnExecutor` asks the engine for `sampling.n` responses per prompt, decodes them, calls a
`RewardFunction` once on the whole batch and returns one record per response. A prompt's images
(`PromptSample.images`, VL models) go to the engine with it and onto its records:

    records = SingleTurnExecutor(engine, reward_fn, tokenizer, SamplingParams(n=4)).run(prompts)

`MultiTurnExecutor` runs agent episodes: an environment answers each action with feedback text,
a reward and a done flag. Per prompt and sample, with history h₀ = the prompt ids:

    observation = env.reset({"observation": prompt, "label": label})
    repeat up to max_turns:  aₖ = engine.agenerate(hₖ)                    (action tokens, log-probs)
                             out = env.step({"observation_text", "action_text", "label", ...})
                             fₖ = tokens of out["environment_feedback"]   (tokenised once)
                             hₖ₊₁ = hₖ + aₖ + fₖ;  stop when out["done"]
    response_ids = a₀ f₀ a₁ f₁ …   action_mask = 1 on every aₖ, 0 on every fₖ
    rollout_logprobs = the engine's log-probs on aₖ, 0.0 on fₖ;  reward = Σₖ out["rewards"]

A step may return "environment_messages" (a list of chat messages, e.g. tool results) instead of
"environment_feedback"; they are rendered by the chat template after the action (`render_after_assistant`).

Images (vision-language models, `MultiTurnExecutor(vision=VisionProcessor)`): a step may also
return "environment_images", a list of images (PIL images, encoded bytes, paths, Hub `Image`
dicts: whatever `rl_data.vision.load_image` reads). The feedback text (or a message's content)
marks where each goes with an `rl_data.vision.IMAGE_PLACEHOLDER` ("<image>") or, as OpenRLHF's
VLM agents write it, the model's own one-image placeholder text (`VisionProcessor.image_text`,
e.g. "<|vision_start|><|image_pad|><|vision_end|>"), one per image, in order; an image's ids are `VisionProcessor.image_turn`'s (`<|vision_start|>` n image tokens
`<|vision_end|>`), environment tokens like the rest of the feedback (action mask 0, rollout
log-prob 0). Its `ImageInputs` join the episode's images (the prompt's first,
`PromptSample.images`), every later turn is generated with all of them, and the record's
`Trajectory.images` holds them in the order of their runs. Feedback cut at `max_length` never
cuts an image's run: the cut moves before it and the image is dropped.
Earlier turns are never re-tokenised: the engine always continues from the exact ids it produced.
Episodes run concurrently (asyncio, `engine.agenerate`), each with its own environment instance
and a hard timeout. An environment's code (its factory, `reset`, `step`, sync or async) runs on an
event loop and daemon thread of the episode's own (`rl_rollout.bounded.UserLoop`), never on the
executor's loop: a step that blocks (`time.sleep`, `requests.post`) holds only its episode, the
timeout fires on time, and the episode is abandoned, its error naming where the step was stuck. finish_reason: the last action's reason when the environment says done,
"length" when max_turns or max_length ends the episode, "abort" for a failed episode kept with the
fallback reward (`on_error="fallback"`).

OpenRLHF agent files work unchanged (`load_agent_class`): they define
`class AgentInstance(AgentInstanceBase)` with `async reset(states)` and `async step(states)`
(returning "rewards", "scores", "environment_feedback", "done", optionally "sampling_params",
"extra_logs") and usually `class AgentExecutor(MultiTurnAgentExecutor)`. They import
`openrlhf.utils.agent`; when openrlhf is not installed, the loader provides a small stand-in for
that module during the import only (see `load_agent_class`). A file whose `AgentExecutor` brings
its own `execute` (OpenRLHF's OpenAI-server executor file) is honoured: its `execute` runs each
episode against an adapter of the engine, and its result becomes the record
(`rl_rollout.agent_execute`).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import inspect
import logging
import math
import numbers
import sys
import time
import types
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec
import torch

from rl_data import ImageInputs, PromptSample, Trajectory
from rl_data.errors import check_integer
from rl_data.vision import IMAGE_PLACEHOLDER

from .bounded import LoopWatchdog, UserLoop, user_code_at
from .protocol import Engine, Generation, SamplingParams
from .rewards import ON_ERROR, RewardFunction, load_python_file

__all__ = [
    "FEEDBACK_MODES",
    "AgentFile",
    "EpisodeError",
    "MultiTurnExecutor",
    "SingleTurnExecutor",
    "load_agent",
    "load_agent_class",
    "openrlhf_agent_shim",
    "render_after_assistant",
]

logger = logging.getLogger(__name__)

FEEDBACK_MODES = ("text", "chat")
LOOP_BLOCK_WARNING_S = 10.0
"""Seconds an executor's event loop may go without a tick before the blocking code is named."""


class EpisodeError(RuntimeError):
    """A multi-turn episode failed: the environment raised, answered badly or timed out."""


def _check_samples(samples: Sequence[PromptSample], owner: str) -> list[PromptSample]:
    if isinstance(samples, PromptSample) or not isinstance(samples, Sequence):
        raise TypeError(f"{owner}.run: samples must be a list of PromptSample, got {type(samples).__name__}")
    for position, sample in enumerate(samples):
        if not isinstance(sample, PromptSample):
            raise TypeError(
                f"{owner}.run: samples[{position}] is a {type(sample).__name__}, not a PromptSample"
            )
        if sample.prompt_ids.numel() == 0:
            raise ValueError(f"{owner}.run: samples[{position}] ({_describe(sample)}) has no prompt ids")
    return list(samples)


def _describe(sample: PromptSample) -> str:
    parts = [f"index {sample.index}"]
    if sample.source:
        parts.append(f"{sample.source} row {sample.row}")
    return ", ".join(parts)


def _sample_extra(sample: PromptSample) -> dict[str, Any]:
    return {"sample_index": sample.index, "source": sample.source, "row": sample.row}


def _prompt_text(sample: PromptSample, tokenizer: Any) -> str:
    """The prompt's text: `sample.prompt`, or its ids decoded when the dataset gave none."""
    if sample.prompt:
        return sample.prompt
    return tokenizer.decode(sample.prompt_ids.tolist(), skip_special_tokens=False)


def _run_sync(coroutine: Any, owner: str, run: Callable[[Any], Any] = asyncio.run) -> Any:
    """`run(coroutine)` from synchronous code (`asyncio.run` unless given another runner); an
    event loop running in this thread is refused, naming `owner`'s `arun` to await instead."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return run(coroutine)
    coroutine.close()  # never awaited
    raise RuntimeError(f"{owner}.run: an event loop is running here; await {owner}.arun instead")


def _episode_metrics(records: Sequence[Trajectory], started: float) -> dict[str, float]:
    """An episode executor's `last_metrics`: episodes, mean turns (`extra["turns"]`), failed episodes
    (`extra["episode_error"]`), the share that ended at a length limit, and seconds since `started`."""
    return {
        "rollout/episodes": float(len(records)),
        "rollout/turns_mean": sum(r.extra["turns"] for r in records) / len(records),
        "rollout/episode_failures": float(sum("episode_error" in r.extra for r in records)),
        "rollout/truncated_fraction": sum(r.finish_reason == "length" for r in records) / len(records),
        "rollout/seconds": time.monotonic() - started,
    }


class _GroupCounter:
    """Hands out group ids: one per prompt, increasing across calls, never reused."""

    def __init__(self, first: int) -> None:
        self.next = check_integer("first_group_id", first, 0)

    def take(self, count: int, group_ids: Sequence[int] | None, owner: str) -> list[int]:
        if group_ids is not None:
            ids = [int(g) for g in group_ids]
            if len(ids) != count or len(set(ids)) != count:
                raise ValueError(
                    f"{owner}.run: group_ids must be {count} distinct integers, got {group_ids!r}"
                )
            return ids
        ids = list(range(self.next, self.next + count))
        self.next += count
        return ids


class SingleTurnExecutor:
    """n responses per prompt from `engine`, scored by `reward_fn` on decoded text.

    Args:
      engine: any `Engine`.
      reward_fn: a `RewardFunction`; it gets queries = prompt text + decoded response,
        prompts = prompt text, labels = the samples' labels, in one call per `run`.
      tokenizer: decodes responses (a `transformers` tokenizer).
      sampling: `SamplingParams`; `sampling.n` responses per prompt.
      skip_special_tokens: whether decoded responses drop special tokens (OpenRLHF keeps them).
      first_group_id: group id of the first prompt; later prompts count up from there.
    """

    def __init__(
        self,
        engine: Engine,
        reward_fn: RewardFunction,
        tokenizer: Any,
        sampling: SamplingParams,
        *,
        skip_special_tokens: bool = False,
        first_group_id: int = 0,
    ) -> None:
        if not isinstance(engine, Engine):
            raise TypeError(f"engine: expected an rl_rollout Engine, got {type(engine).__name__}")
        if not callable(reward_fn):
            raise TypeError(f"reward_fn: expected a RewardFunction, got {type(reward_fn).__name__}")
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling: expected SamplingParams, got {type(sampling).__name__}")
        self.engine, self.reward_fn, self.tokenizer, self.sampling = engine, reward_fn, tokenizer, sampling
        self.skip_special_tokens = skip_special_tokens
        self._groups = _GroupCounter(first_group_id)
        self.last_metrics: dict[str, float] = {}

    def run(
        self, samples: Sequence[PromptSample], *, group_ids: Sequence[int] | None = None
    ) -> list[Trajectory]:
        """`len(samples) · sampling.n` records, prompt-major: records[i·n + j] is sample j of prompt i."""
        samples = _check_samples(samples, "SingleTurnExecutor")
        if not samples:
            return []
        groups = self._groups.take(len(samples), group_ids, "SingleTurnExecutor")
        prompt_ids = [s.prompt_ids.tolist() for s in samples]
        if any(s.images is not None for s in samples):  # text-only batches call generate as before
            generations = self.engine.generate(prompt_ids, self.sampling, [s.images for s in samples])
        else:
            generations = self.engine.generate(prompt_ids, self.sampling)
        if len(generations) != len(samples):
            raise RuntimeError(
                f"{self.engine.name}.generate returned {len(generations)} results for {len(samples)} prompts"
            )
        queries, prompts, labels, flat = [], [], [], []
        for sample, outputs in zip(samples, generations, strict=True):
            prompt = _prompt_text(sample, self.tokenizer)
            for generation in outputs:
                response = self.tokenizer.decode(
                    generation.token_ids, skip_special_tokens=self.skip_special_tokens
                )
                queries.append(prompt + response)
                prompts.append(prompt)
                labels.append(sample.label)
                flat.append((sample, generation))
        output = self.reward_fn(queries, prompts, labels)
        if len(output.rewards) != len(flat):
            raise RuntimeError(
                f"reward function returned {len(output.rewards)} rewards for {len(flat)} responses"
            )
        fallbacks = set(output.fallback_indices)
        records = []
        for position, (sample, generation) in enumerate(flat):
            group = groups[position // self.sampling.n]
            records.append(
                Trajectory(
                    prompt_ids=sample.prompt_ids,
                    response_ids=generation.token_ids,
                    rollout_logprobs=generation.logprobs,
                    reward=output.rewards[position],
                    score=output.scores[position],
                    group_id=group,
                    policy_version=generation.policy_version,
                    token_versions=generation.token_versions,
                    routed_experts=generation.routed_experts,
                    finish_reason=generation.finish_reason,
                    label=sample.label,
                    images=sample.images,
                    extra={**_sample_extra(sample), "reward_fallback": position in fallbacks},
                )
            )
        lengths = [len(g.token_ids) for _, g in flat]
        self.last_metrics = {
            "rollout/responses": float(len(flat)),
            "rollout/response_length_mean": sum(lengths) / len(lengths),
            "rollout/truncated_fraction": sum(g.finish_reason == "length" for _, g in flat) / len(flat),
            "rollout/reward_mean": sum(output.rewards) / len(flat),
            "rollout/reward_fallbacks": float(output.num_fallbacks),
        }
        return records


# ----------------------------------------------------------------------------------------------
# OpenRLHF agent files.


def openrlhf_agent_shim() -> dict[str, types.ModuleType]:
    """Stand-ins for `openrlhf`, `openrlhf.utils` and `openrlhf.utils.agent` (name -> module).

    `openrlhf.utils.agent` provides what agent files import: `AgentInstanceBase` (default
    `reset` returns the states unchanged, as OpenRLHF's does), `AgentExecutorBase` and
    `MultiTurnAgentExecutor(agent_instance_cls)`, which only records the class.
    """

    class AgentInstanceBase:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

        async def reset(self, states: dict, **kwargs: Any) -> dict:
            return states

        async def step(self, states: dict, **kwargs: Any) -> dict:
            raise NotImplementedError("AgentInstance.step is not implemented")

    class AgentExecutorBase:
        async def execute(self, *args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError("AgentExecutorBase.execute is abstract: a subclass defines it")

    class MultiTurnAgentExecutor(AgentExecutorBase):
        def __init__(self, agent_instance_cls: type, *args: Any, **kwargs: Any) -> None:
            if not (
                isinstance(agent_instance_cls, type) and issubclass(agent_instance_cls, AgentInstanceBase)
            ):
                raise TypeError("AgentInstance must inherit from AgentInstanceBase")
            self.agent_instance_cls = agent_instance_cls

    agent = types.ModuleType("openrlhf.utils.agent", "rl_rollout stand-in for OpenRLHF's agent base classes")
    for cls in (AgentInstanceBase, AgentExecutorBase, MultiTurnAgentExecutor):
        cls.__module__ = agent.__name__
        setattr(agent, cls.__name__, cls)
    agent.SingleTurnAgentExecutor = AgentExecutorBase
    utils = types.ModuleType("openrlhf.utils")
    utils.agent = agent
    package = types.ModuleType("openrlhf")
    package.utils = utils
    for module in (package, utils):
        module.__path__ = []  # importable as packages
    return {"openrlhf": package, "openrlhf.utils": utils, "openrlhf.utils.agent": agent}


@contextlib.contextmanager
def _shim_installed():
    """Install the stand-in modules for the duration of an import, when openrlhf is absent."""
    try:
        present = importlib.util.find_spec("openrlhf") is not None
    except (ImportError, ValueError):
        present = "openrlhf" in sys.modules
    if present:
        yield
        return
    shim = openrlhf_agent_shim()
    added = [name for name in shim if name not in sys.modules]
    for name in added:
        sys.modules[name] = shim[name]
    try:
        yield
    finally:
        for name in added:
            sys.modules.pop(name, None)


class AgentFile(msgspec.Struct, frozen=True):
    """What an OpenRLHF agent file defines: `instance_cls` (its `AgentInstance`, or the class its
    `AgentExecutor()` was built with; None when it has none) and `execute_cls` (its
    `AgentExecutor` when that class brings its own `execute`, which then runs the episodes)."""

    path: str
    instance_cls: type | None
    execute_cls: type | None


def _own_execute(executor_cls: Any) -> bool:
    """Whether `executor_cls.execute` is the file's (or a library's other than openrlhf's agent
    module, whose executors `MultiTurnExecutor` replaces)."""
    if not isinstance(executor_cls, type):
        return False
    for cls in executor_cls.__mro__:
        if "execute" in vars(cls):
            return cls.__module__ != "openrlhf.utils.agent"
    return False


def load_agent(path: str | Path) -> AgentFile:
    """Import an OpenRLHF agent file (see `load_agent_class` for the import) and say what it runs:
    an `AgentInstance` for `MultiTurnExecutor`'s loop, or an `AgentExecutor` with its own
    `execute` (honoured, `rl_rollout.agent_execute`). Errors name the file and what is missing."""
    with _shim_installed():
        module = load_python_file(path, "agent")
        cls = getattr(module, "AgentInstance", None)
        executor_cls = getattr(module, "AgentExecutor", None)
        if _own_execute(executor_cls):
            return AgentFile(str(Path(path).resolve()), cls if isinstance(cls, type) else None, executor_cls)
        if cls is None and executor_cls is not None:
            try:
                cls = getattr(executor_cls(), "agent_instance_cls", None)
            except Exception as error:
                raise TypeError(f"agent file {str(path)!r}: AgentExecutor() failed: {error!r}") from error
    if cls is None:
        raise AttributeError(
            f"agent file {str(path)!r} defines neither an AgentInstance class nor an AgentExecutor "
            "(built on an AgentInstance, or with its own execute)"
        )
    if not isinstance(cls, type):
        raise TypeError(f"agent file {str(path)!r}: AgentInstance is a {type(cls).__name__}, not a class")
    for method in ("reset", "step"):
        if not callable(getattr(cls, method, None)):
            raise TypeError(f"agent file {str(path)!r}: {cls.__name__} has no {method}(states) method")
    return AgentFile(str(Path(path).resolve()), cls, None)


def load_agent_class(path: str | Path) -> type:
    """The environment class of an OpenRLHF agent file (its `AgentInstance`).

    The file is imported as is. When `openrlhf` is installed its own `openrlhf.utils.agent` is
    used; otherwise `openrlhf_agent_shim()` is put in `sys.modules` for the import only and
    removed afterwards, so nothing else sees a fake `openrlhf`. The class is `AgentInstance`,
    else the class that `AgentExecutor()` was built with (`agent_instance_cls`). Errors name the
    file and what is missing; a file whose `AgentExecutor` brings its own `execute` and no
    `AgentInstance` has no such class (`load_agent` reads both kinds).
    """
    agent = load_agent(path)
    if agent.instance_cls is None:
        raise AttributeError(
            f"agent file {str(path)!r}: its AgentExecutor runs its own execute() and it defines no "
            "AgentInstance; load it with load_agent (MultiTurnExecutor runs its execute)"
        )
    return agent.instance_cls


def render_after_assistant(tokenizer: Any, messages: list[Mapping[str, Any]]) -> str:
    """What the chat template writes after an assistant message's content when `messages` follow
    it, up to and including the next generation prompt (the assistant turn's end marker first).

    Rendered once as [user, assistant(marker), *messages] and split at the marker, so the text is
    exactly what the template puts there (a placeholder user turn comes first because some
    templates refuse a conversation without one).
    """
    marker = "\ue000"
    conversation = [
        {"role": "user", "content": "\ue001"},
        {"role": "assistant", "content": marker},
        *[dict(message) for message in messages],
    ]
    rendered = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    if rendered.count(marker) != 1:
        raise ValueError("the chat template does not render the assistant content in place")
    return rendered.split(marker, 1)[1]


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


async def _make_env(factory: Callable[[], Any]) -> Any:
    """An environment from `factory`; classes with `async def __init__` (old OpenRLHF files) work too."""
    if isinstance(factory, type) and inspect.iscoroutinefunction(factory.__init__):
        env = factory.__new__(factory)
        await factory.__init__(env)
        return env
    return await _maybe_await(factory())


def _scalar(value: Any, field: str) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise EpisodeError(f"step() returned {field!r} with {value.numel()} values, expected one")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        raise EpisodeError(f"step() returned {field!r} = {value!r}, expected a finite number")
    return float(value)


def _loggable(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.reshape(-1).tolist()
    if isinstance(value, Mapping):
        return {str(k): _loggable(v) for k, v in value.items()}
    return value


def _token_versions(episode: Any) -> list[int] | None:
    """An episode's per-token versions, None when every token is `policy_version`'s (or they do
    not line up with its tokens: an episode that failed before its first action). `episode` is
    anything with `versions`, `response_ids` and `policy_version`: an `_Episode`, or the agent
    server's `SessionRecord`."""
    versions = episode.versions
    if len(versions) != len(episode.response_ids) or all(v == episode.policy_version for v in versions):
        return None
    return versions


class _Episode(msgspec.Struct, kw_only=True):
    prompt_ids: list[int]
    response_ids: list[int] = msgspec.field(default_factory=list)
    logprobs: list[float] | None = msgspec.field(default_factory=list)
    mask: list[bool] = msgspec.field(default_factory=list)
    action_ranges: list[tuple[int, int]] = msgspec.field(default_factory=list)
    reward: float = 0.0
    score: float | None = None
    turns: int = 0
    finish_reason: str = "length"
    policy_version: int = 0
    versions: list[int] = msgspec.field(default_factory=list)  # per response token
    extra_logs: dict[str, Any] = msgspec.field(default_factory=dict)
    images: ImageInputs | None = None  # the prompt's, then every image an environment returned
    timed_out: bool = False  # ended by episode_timeout_s (abandoned)
    env: Any = None  # the episode's environment, once made (its optional close() ends it)


class MultiTurnExecutor:
    """Agent episodes through `engine.agenerate`, many at a time; one `Trajectory` per episode.

    Args:
      engine: any `Engine`.
      tokenizer: tokenises feedback and reset observations, decodes actions.
      sampling: `SamplingParams` for every turn; `sampling.n` episodes per prompt (each its own
        environment); `max_new_tokens` caps one turn. With a seed, episode j, turn k uses
        seed + j·max_turns + k.
      env: an agent file path (OpenRLHF format) or a zero-argument factory (a class works)
        returning an object with `reset(states)` and `step(states)`, sync or async, and
        optionally `close()`, called once when its episode ends (not after a timeout).
      max_turns: actions per episode; an environment that never says done ends here ("length").
      max_length: prompt + response tokens; default `engine.max_model_len`. A turn's budget is
        what is left; feedback past the limit is cut and the episode ends ("length").
      feedback: "text" tokenises the feedback as plain text (OpenRLHF); "chat" wraps it as a
        `feedback_role` turn with the tokenizer's chat template, followed by the generation prompt.
        A step's "environment_messages" are rendered by the chat template in either mode.
      action_skip_special_tokens: how `action_text` is decoded for `step` (vLLM's default: True).
      episode_timeout_s: hard limit per episode (reset, generation and steps); it fires however
        the environment blocks (`rollout/episode_timeouts` counts the episodes it ended).
      max_concurrency: episodes in flight at once.
      on_error: "raise" (an `EpisodeError` naming the sample) or "fallback" (the episode ends,
        finish "abort", reward = fallback; counted in `last_metrics`).
      first_group_id: group id of the first prompt.
      vision: the model's `rl_data.vision.VisionProcessor` (or its folder, to build it from),
        needed when steps return "environment_images" (see the module docstring); None for text models.
    """

    def __init__(
        self,
        engine: Engine,
        tokenizer: Any,
        sampling: SamplingParams,
        *,
        env: str | Path | Callable[[], Any],
        max_turns: int = 8,
        max_length: int | None = None,
        feedback: str = "text",
        feedback_role: str = "user",
        action_skip_special_tokens: bool = True,
        episode_timeout_s: float = 600.0,
        max_concurrency: int = 64,
        on_error: str = "raise",
        fallback: float = 0.0,
        first_group_id: int = 0,
        vision: Any = None,
    ) -> None:
        if not isinstance(engine, Engine):
            raise TypeError(f"engine: expected an rl_rollout Engine, got {type(engine).__name__}")
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling: expected SamplingParams, got {type(sampling).__name__}")
        if isinstance(vision, (str, Path)):  # a model folder (a config value): its processor
            from rl_data.vision import VisionProcessor

            vision = VisionProcessor.from_pretrained(vision, tokenizer)
        if vision is not None and not callable(getattr(vision, "image_turn", None)):
            raise TypeError(
                f"vision: expected an rl_data.vision.VisionProcessor or a VL model folder, got {type(vision).__name__}"
            )
        self.vision = vision
        check_integer("max_turns", max_turns, 1)
        check_integer("max_concurrency", max_concurrency, 1)
        limit = check_integer("max_length", engine.max_model_len if max_length is None else max_length, 2)
        if feedback not in FEEDBACK_MODES:
            raise ValueError(f"feedback: {feedback!r} is not allowed; expected one of {FEEDBACK_MODES}")
        if not (isinstance(episode_timeout_s, (int, float)) and 0 < episode_timeout_s < math.inf):
            raise ValueError(
                f"episode_timeout_s: {episode_timeout_s!r} is not allowed; expected a number > 0"
            )
        if on_error not in ON_ERROR:
            raise ValueError(f"on_error: {on_error!r} is not allowed; expected one of {ON_ERROR}")
        self._execute: AgentFile | None = None  # a file whose AgentExecutor brings its own execute
        if isinstance(env, (str, Path)):
            agent = load_agent(env)
            if agent.execute_cls is not None:
                self._execute = agent
            self.env_factory: Callable[[], Any] = agent.instance_cls
        elif callable(env):
            self.env_factory = env
        else:
            raise TypeError(f"env: expected an agent file path or a factory, got {type(env).__name__}")
        self.engine, self.tokenizer, self.sampling = engine, tokenizer, sampling
        self.max_turns, self.max_length = max_turns, limit
        self.feedback, self.feedback_role = feedback, feedback_role
        self.action_skip_special_tokens = action_skip_special_tokens
        self.episode_timeout_s = float(episode_timeout_s)
        self.max_concurrency = max_concurrency
        self.on_error, self.fallback = on_error, float(fallback)
        self._groups = _GroupCounter(first_group_id)
        self.last_metrics: dict[str, float] = {}

    @property
    def execute_agent(self) -> Any:
        """The agent file's one `AgentExecutor()` and its event loop (`rl_rollout.agent_execute`),
        built on first use (checking options builds this executor and runs nothing); None for
        files without their own execute."""
        if self._execute is None:
            return None
        from .agent_execute import execute_agent

        return execute_agent(self._execute.path, self._execute.execute_cls)

    # -- tokenising feedback once ------------------------------------------------------------

    def _feedback_ids(
        self, feedback: str | list[dict[str, Any]], action_ended: bool
    ) -> tuple[str, list[int]]:
        """(text, token ids) of one step's feedback, tokenised once.

        A string in "text" mode is tokenised as it is. A string in "chat" mode is one
        `feedback_role` message; a list of messages (a step's "environment_messages", e.g. tool
        results) is rendered as those messages in either mode. Messages are rendered by the chat
        template: the text between an assistant message's content and the next generation
        prompt. When the action ended with the end-of-turn token the engine already produced it,
        so it is not repeated.
        """
        if isinstance(feedback, str):
            if not feedback:
                return "", []
            if self.feedback == "text":
                return feedback, list(self.tokenizer(feedback, add_special_tokens=False)["input_ids"])
            feedback = [{"role": self.feedback_role, "content": feedback}]
        elif not feedback:
            return "", []
        delta = render_after_assistant(self.tokenizer, feedback)
        eos = self.tokenizer.eos_token
        if action_ended and eos and delta.startswith(eos):
            delta = delta[len(eos) :]
        return delta, list(self.tokenizer(delta, add_special_tokens=False)["input_ids"])

    # -- one episode -------------------------------------------------------------------------

    async def _episode(
        self, sample: PromptSample, sample_number: int, episode: _Episode, user: UserLoop
    ) -> None:
        env = episode.env = await user.call(_make_env, self.env_factory)  # its code runs on `user`
        prompt_text = _prompt_text(sample, self.tokenizer)
        reset = await user.call(
            env.reset, {"observation": prompt_text, "prompt": prompt_text, "label": sample.label}
        )
        if not isinstance(reset, Mapping) or not isinstance(reset.get("observation"), str):
            raise EpisodeError(f"reset() must return {{'observation': str}}, got {reset!r}")
        observation_text = reset["observation"]
        if observation_text != prompt_text:
            if sample.images is not None:  # re-tokenised text would lose the images' expanded runs
                raise EpisodeError(
                    "reset() returned another observation for a prompt with images; an environment of a "
                    "VL prompt must return the prompt unchanged (images go in step()'s environment_images)"
                )
            episode.prompt_ids = list(self.tokenizer(observation_text, add_special_tokens=False)["input_ids"])
        if len(episode.prompt_ids) >= self.max_length:
            raise EpisodeError(
                f"the first observation has {len(episode.prompt_ids)} tokens; max_length is {self.max_length}"
            )
        sampling = self.sampling
        for turn in range(self.max_turns):
            budget = self.max_length - len(episode.prompt_ids) - len(episode.response_ids)
            if budget <= 0:
                episode.finish_reason = "length"
                return
            changes: dict[str, Any] = {"n": 1, "max_new_tokens": min(sampling.max_new_tokens, budget)}
            changes["min_new_tokens"] = min(sampling.min_new_tokens, changes["max_new_tokens"])
            if sampling.seed is not None:
                changes["seed"] = sampling.seed + sample_number * self.max_turns + turn
            params = msgspec.structs.replace(sampling, **changes)
            history = episode.prompt_ids + episode.response_ids
            if episode.images is not None:  # text episodes call agenerate as before images existed
                generations = await self.engine.agenerate(history, params, episode.images)
            else:
                generations = await self.engine.agenerate(history, params)
            action: Generation = generations[0]
            start = len(episode.response_ids)
            episode.response_ids.extend(action.token_ids)
            episode.mask.extend([True] * len(action.token_ids))
            if episode.logprobs is not None and action.logprobs is not None:
                episode.logprobs.extend(action.logprobs)
            else:
                episode.logprobs = None
            episode.action_ranges.append((start, len(episode.response_ids)))
            if turn == 0:
                episode.policy_version = action.policy_version
            episode.versions.extend(action.versions())
            episode.turns = turn + 1
            action_text = self.tokenizer.decode(
                action.token_ids, skip_special_tokens=self.action_skip_special_tokens
            )
            states = {
                "observation_text": observation_text,
                "action_text": action_text,
                "label": sample.label,
                "sampling_params": sampling,
            }
            result = await user.call(env.step, states)
            if not isinstance(result, Mapping):
                raise EpisodeError(f"step() returned a {type(result).__name__}, expected a dict")
            missing = [key for key in ("rewards", "done") if key not in result]
            if ("environment_feedback" in result) == ("environment_messages" in result):
                missing.append("environment_feedback (or environment_messages, not both)")
            if missing:
                raise EpisodeError(f"step() result lacks {missing} (keys: {sorted(map(str, result))})")
            if "environment_messages" in result:
                feedback = result["environment_messages"]
                if not (isinstance(feedback, list) and all(isinstance(m, Mapping) for m in feedback)):
                    raise EpisodeError(
                        f"step() returned environment_messages of type {type(feedback).__name__}; "
                        "expected a list of chat messages (dicts with role and content)"
                    )
            else:
                feedback = result["environment_feedback"]
                if not isinstance(feedback, str):
                    raise EpisodeError(
                        f"step() returned environment_feedback of type {type(feedback).__name__}"
                    )
            episode.reward += _scalar(result["rewards"], "rewards")
            score = result.get("scores")
            episode.score = _scalar(score, "scores") if score is not None else episode.reward
            episode.extra_logs = _loggable(result.get("extra_logs") or {})
            done = bool(result["done"].item() if isinstance(result["done"], torch.Tensor) else result["done"])
            next_params = result.get("sampling_params")
            if isinstance(next_params, SamplingParams):
                sampling = next_params
            elif isinstance(next_params, Mapping):
                sampling = msgspec.structs.replace(sampling, **next_params)
            elif next_params is not None:
                raise EpisodeError(f"step() returned sampling_params of type {type(next_params).__name__}")
            ended = action.finish_reason == "stop"
            feedback_text, feedback_ids = self._feedback_ids(feedback, ended)
            runs: list[tuple[int, int, ImageInputs]] = []
            if result.get("environment_images") is not None:
                feedback_ids, runs = self._with_images(
                    feedback_text, feedback_ids, result["environment_images"]
                )
            room = self.max_length - len(episode.prompt_ids) - len(episode.response_ids)
            observation_text = observation_text + action_text + feedback_text
            if len(feedback_ids) > room:
                cut = max(room, 0)
                for start, end, _ in runs:  # never cut through an image's run: cut before it
                    if start < cut < end:
                        cut = start
                feedback_ids = feedback_ids[:cut]
                self._append_feedback(
                    episode, feedback_ids, [inputs for _, end, inputs in runs if end <= cut]
                )
                episode.finish_reason = "length"
                return
            self._append_feedback(episode, feedback_ids, [inputs for _, _, inputs in runs])
            if done:
                episode.finish_reason = action.finish_reason
                return
        episode.finish_reason = "length"

    async def _episode_then_close(
        self, sample: PromptSample, sample_number: int, episode: _Episode, user: UserLoop
    ) -> None:
        """`_episode`, then the environment's optional `close()` on its thread, however the episode
        ended (done, max_turns, length, an error); not when cancelled (the deadline: its thread is
        abandoned, and a close() would wait behind the stuck call)."""
        try:
            await self._episode(sample, sample_number, episode, user)
        except asyncio.CancelledError:
            raise
        except Exception:
            await self._close_env(episode, user)
            raise
        await self._close_env(episode, user)

    @staticmethod
    async def _close_env(episode: _Episode, user: UserLoop) -> None:
        close = getattr(episode.env, "close", None)
        if not callable(close):
            return
        try:  # still under episode_timeout_s: a close() that blocks ends in the episode's timeout
            await user.call(close)
        except Exception as error:
            logger.warning("MultiTurnExecutor: the environment's close() failed: %r", error)

    async def _execute_episode(
        self, sample: PromptSample, sample_number: int, episode: _Episode, user: UserLoop | None
    ) -> None:
        """One episode by the agent file's own `AgentExecutor.execute` (`rl_rollout.agent_execute`)."""
        from .agent_execute import EngineAdapter, episode_fields, vllm_sampling_params

        seed = None if self.sampling.seed is None else self.sampling.seed + sample_number * self.max_turns
        agent = self.execute_agent

        async def on_the_agents_loop() -> Any:
            return await _maybe_await(
                agent.agent.execute(
                    _prompt_text(sample, self.tokenizer),
                    sample.label,
                    vllm_sampling_params(self.sampling, seed),
                    self.max_length,
                    self.tokenizer,
                    EngineAdapter(self.engine, self.tokenizer),
                )
            )

        # the episode runs on the file's own loop; this loop only waits, so the episode timeout
        # fires even when the file's code blocks that loop (which the timeout's error then names)
        result = await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(on_the_agents_loop(), agent.loop))
        try:
            fields = episode_fields(result)
        except ValueError as error:
            raise EpisodeError(str(error)) from None
        episode.prompt_ids = fields["prompt_ids"]
        episode.response_ids = fields["response_ids"]
        episode.mask = fields["mask"]
        episode.logprobs = fields["logprobs"]
        episode.action_ranges = fields["action_ranges"]
        episode.reward, episode.score = fields["reward"], fields["score"]
        episode.extra_logs = _loggable(fields["extra_logs"])
        episode.turns = len(fields["action_ranges"])
        episode.policy_version = self.engine.policy_version
        episode.finish_reason = "length" if fields["truncated"] else "stop"

    def _with_images(
        self, feedback_text: str, feedback_ids: list[int], images: Any
    ) -> tuple[list[int], list[tuple[int, int, ImageInputs]]]:
        """(feedback ids with each "<image>" replaced by its image's ids, [(start, end, inputs)] of
        every image run in them). The text around the placeholders is tokenised piece by piece."""
        if self.vision is None:
            raise EpisodeError(
                "step() returned environment_images but the executor has no VisionProcessor; "
                "build MultiTurnExecutor(..., vision=VisionProcessor.from_pretrained(model_folder))"
            )
        if not isinstance(images, (list, tuple)):
            raise EpisodeError(
                f"step() returned environment_images of type {type(images).__name__}; expected a list"
            )
        if not images:
            return feedback_ids, []
        # OpenRLHF's agents write the model's own placeholder (<|vision_start|><|image_pad|><|vision_end|>)
        feedback_text = feedback_text.replace(self.vision.image_text, IMAGE_PLACEHOLDER)
        pieces = feedback_text.split(IMAGE_PLACEHOLDER)
        if len(pieces) - 1 != len(images):
            raise EpisodeError(
                f"step() returned {len(images)} environment_images but its feedback holds {len(pieces) - 1} "
                f"{IMAGE_PLACEHOLDER!r} placeholders; put one where each image goes"
            )
        ids: list[int] = []
        runs: list[tuple[int, int, ImageInputs]] = []
        for position, piece in enumerate(pieces):
            if piece:
                ids.extend(self.tokenizer(piece, add_special_tokens=False)["input_ids"])
            if position < len(images):
                try:
                    turn_ids, inputs = self.vision.image_turn([images[position]])
                except (ValueError, TypeError, FileNotFoundError) as error:
                    raise EpisodeError(f"step() environment_images[{position}]: {error}") from None
                runs.append((len(ids), len(ids) + turn_ids.numel(), inputs))
                ids.extend(turn_ids.tolist())
        return ids, runs

    @staticmethod
    def _append_feedback(
        episode: _Episode, feedback_ids: list[int], images: Sequence[ImageInputs] = ()
    ) -> None:
        if images:
            episode.images = ImageInputs.concat([episode.images, *images])
        episode.response_ids.extend(feedback_ids)
        episode.mask.extend([False] * len(feedback_ids))
        # an environment token is no action: it takes the version of the action before it
        episode.versions.extend(episode.versions[-1:] * len(feedback_ids) if episode.versions else [])
        if episode.logprobs is not None:
            episode.logprobs.extend([0.0] * len(feedback_ids))

    async def _guarded(
        self, sample: PromptSample, sample_number: int, semaphore: asyncio.Semaphore
    ) -> tuple[_Episode, str | None]:
        episode = _Episode(prompt_ids=sample.prompt_ids.tolist(), images=sample.images)
        async with semaphore:
            # the environment's own loop and thread: a step that blocks holds only this episode,
            # and the deadline below fires on time (the thread is abandoned, never joined)
            user = None if self._execute is not None else UserLoop(f"rl-episode-{sample_number}")
            try:
                run = self._execute_episode if self._execute is not None else self._episode_then_close
                await asyncio.wait_for(run(sample, sample_number, episode, user), self.episode_timeout_s)
                return episode, None
            except Exception as error:
                if isinstance(error, (asyncio.TimeoutError, TimeoutError)):
                    episode.timed_out = True
                    stuck = (
                        f"; abandoned, the environment was at {user.stuck()}"
                        if user and user.busy_since
                        else ""
                    )
                    if self._execute is not None and (at := user_code_at(self.execute_agent.thread.ident)):
                        stuck = f"; abandoned, the agent file's event loop was at {at}"
                    reason = f"timed out after {self.episode_timeout_s} s{stuck}"
                else:
                    reason = f"failed: {error!r}"
                where = f"MultiTurnExecutor: episode {sample_number} of sample ({_describe(sample)}) {reason}"
                if self.on_error == "raise":
                    raise EpisodeError(where) from error
                logger.warning("%s; reward = fallback %s", where, self.fallback)
                return episode, where
            finally:
                if user is not None:
                    user.close()

    async def arun(
        self, samples: Sequence[PromptSample], *, group_ids: Sequence[int] | None = None
    ) -> list[Trajectory]:
        """`len(samples) · sampling.n` records, prompt-major, from concurrent episodes."""
        samples = _check_samples(samples, "MultiTurnExecutor")
        if not samples:
            return []
        groups = self._groups.take(len(samples), group_ids, "MultiTurnExecutor")
        semaphore = asyncio.Semaphore(self.max_concurrency)
        started = time.monotonic()
        jobs = [self._guarded(s, j, semaphore) for s in samples for j in range(self.sampling.n)]
        tasks = [asyncio.ensure_future(job) for job in jobs]
        async with LoopWatchdog(LOOP_BLOCK_WARNING_S, name="MultiTurnExecutor") as watchdog:
            try:
                results = await asyncio.gather(*tasks)
            except BaseException:
                for task in tasks:
                    task.cancel()
                raise
        records = []
        for position, (episode, error) in enumerate(results):
            sample = samples[position // self.sampling.n]
            extra = {
                **_sample_extra(sample),
                "turns": episode.turns,
                "action_ranges": [list(r) for r in episode.action_ranges],
                "extra_logs": episode.extra_logs,
            }
            reward, score, finish = episode.reward, episode.score, episode.finish_reason
            if error is not None:
                extra["episode_error"] = error
                reward, score, finish = self.fallback, self.fallback, "abort"
                if episode.timed_out:
                    extra["episode_timeout"] = True
            records.append(
                Trajectory(
                    prompt_ids=episode.prompt_ids,
                    response_ids=episode.response_ids,
                    rollout_logprobs=episode.logprobs,
                    action_mask=episode.mask,
                    reward=reward,
                    score=score,
                    group_id=groups[position // self.sampling.n],
                    policy_version=episode.policy_version,
                    token_versions=_token_versions(episode),
                    finish_reason=finish,
                    label=sample.label,
                    images=episode.images,
                    extra=extra,
                )
            )
        self.last_metrics = _episode_metrics(records, started)
        self.last_metrics["rollout/episode_timeouts"] = float(
            sum("episode_timeout" in r.extra for r in records)
        )
        self.last_metrics["rollout/loop_blocked"] = float(watchdog.blocked)
        return records

    def run(
        self, samples: Sequence[PromptSample], *, group_ids: Sequence[int] | None = None
    ) -> list[Trajectory]:
        """`arun` from synchronous code (no event loop may be running in this thread)."""
        # an agent file's own execute runs on its AgentExecutor's loop, kept across calls (_execute_episode)
        return _run_sync(self.arun(samples, group_ids=group_ids), "MultiTurnExecutor")
