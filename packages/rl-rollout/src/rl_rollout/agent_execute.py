"""OpenRLHF agent files that bring their own episode loop (`AgentExecutor.execute`).

Such a file (OpenRLHF's `agent_func_openai_server_executor.py` is one) defines
`class AgentExecutor(AgentExecutorBase)` whose

    async execute(prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine) -> dict

runs one episode and returns {"observation_tokens": prompt and response ids, "action_ranges":
[(start, end), ...] of the generated spans in those ids, "rollout_log_probs": one per
observation token or None, "reward", "scores", "extra_logs", optionally "truncated"}.
`MultiTurnExecutor` honours it: it calls `execute` once per episode with

- `sampling_params`: a `vllm.SamplingParams` when vLLM is imported in this process (the file
  imports it, or the engine is vLLM), else `VLLMStyleSamplingParams`, a mutable object with the
  same field names; `logprobs=1`, so the file records rollout log-probs;
- `llm_engine`: `EngineAdapter`, whose `async generate(prompt_token_ids, sampling_params)` runs
  the run's `Engine` and answers in vLLM's `RequestOutput` shape (`outputs[0].text`,
  `.token_ids`, `.logprobs` as `[{token_id: Logprob(logprob=...)}]`, `.finish_reason`);

and turns the returned dict into a `Trajectory` (`episode_fields`): prompt = the observation ids
before the first action, response = the rest, action mask 1 inside the action ranges. The file's
`AgentExecutor()` is built once per file and process and its episodes run on one event loop that
lives as long (OpenRLHF keeps one per engine actor): files that open a server or a client on
first use keep them across steps.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import numbers
import sys
import threading
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .protocol import Engine, EngineError, SamplingParams

__all__ = [
    "EngineAdapter",
    "ExecuteAgent",
    "VLLMStyleSamplingParams",
    "episode_fields",
    "execute_agent",
    "to_sampling_params",
    "vllm_sampling_params",
]


@dataclasses.dataclass
class VLLMStyleSamplingParams:
    """vLLM's `SamplingParams` field names, for agent files when vLLM is not imported (mutable:
    OpenRLHF's loops set `max_tokens` between turns)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0


# Fields an engine here cannot honour, with the value that means "off".
_UNSUPPORTED = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "min_p": 0.0}


def vllm_sampling_params(sampling: SamplingParams, seed: int | None) -> Any:
    """`sampling` for an agent file: `vllm.SamplingParams` when vLLM is imported, else
    `VLLMStyleSamplingParams`; n = 1 (one episode per call), logprobs = 1."""
    fields = {
        "n": 1,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "seed": seed,
        "stop": list(sampling.stop) or None,
        "stop_token_ids": list(sampling.stop_token_ids) or None,
        "ignore_eos": sampling.ignore_eos,
        "max_tokens": sampling.max_new_tokens,
        "min_tokens": sampling.min_new_tokens,
        "logprobs": 1,
    }
    vllm = sys.modules.get("vllm")
    if vllm is not None and hasattr(vllm, "SamplingParams"):
        return vllm.SamplingParams(**fields)
    return VLLMStyleSamplingParams(**fields)


def to_sampling_params(params: Any, room: int) -> SamplingParams:
    """Our `SamplingParams` from a vLLM-style one (or ours, returned with max_new_tokens capped
    at `room`). Raises EngineError naming a field no engine here honours."""
    if isinstance(params, SamplingParams):
        return _capped(params, room)
    for field, off in _UNSUPPORTED.items():
        value = getattr(params, field, off)
        if value is not None and value != off:
            raise EngineError(
                f"llm_engine.generate: sampling_params.{field} = {value!r} is not supported by rl_rollout "
                f"engines; leave it at {off}"
            )
    n = getattr(params, "n", 1)
    if n != 1:
        raise EngineError(f"llm_engine.generate: sampling_params.n = {n!r}; one sample per call here")
    stop = getattr(params, "stop", None) or ()
    top_k = getattr(params, "top_k", 0) or 0
    max_tokens = getattr(params, "max_tokens", None)
    ours = SamplingParams(
        temperature=float(getattr(params, "temperature", 1.0)),
        top_p=float(getattr(params, "top_p", 1.0)),
        top_k=max(int(top_k), 0),  # vLLM: -1 (older) or 0 means off
        max_new_tokens=max(1, min(room, room if max_tokens is None else int(max_tokens))),
        min_new_tokens=0,
        stop=(stop,) if isinstance(stop, str) else tuple(stop),
        stop_token_ids=tuple(getattr(params, "stop_token_ids", None) or ()),
        seed=getattr(params, "seed", None),
        ignore_eos=bool(getattr(params, "ignore_eos", False)),
        logprobs=True,
    )
    min_tokens = int(getattr(params, "min_tokens", 0) or 0)
    return _capped(ours, room, min_tokens)


def _capped(params: SamplingParams, room: int, min_tokens: int | None = None) -> SamplingParams:
    import msgspec

    top = max(1, min(params.max_new_tokens, room))
    low = params.min_new_tokens if min_tokens is None else min_tokens
    return msgspec.structs.replace(
        params, n=1, max_new_tokens=top, min_new_tokens=min(low, top), logprobs=True
    )


@dataclasses.dataclass
class Logprob:
    """vLLM's per-token log-prob entry."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclasses.dataclass
class CompletionOutput:
    """vLLM's `CompletionOutput` fields that agent files read."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str
    stop_reason: Any = None


@dataclasses.dataclass
class RequestOutput:
    """vLLM's `RequestOutput` fields that agent files read."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    policy_version: int = 0


class EngineAdapter:
    """An `Engine` as OpenRLHF agent files call it (`llm_engine.generate`), from any event loop.

    The log-prob entries hold the sampled token only (engines here report no alternatives).
    """

    def __init__(self, engine: Engine, tokenizer: Any) -> None:
        self.engine, self.tokenizer = engine, tokenizer

    async def generate(self, prompt_token_ids: Sequence[int], sampling_params: Any) -> RequestOutput:
        prompt = [int(token) for token in prompt_token_ids]
        room = self.engine.max_model_len - len(prompt)
        if room <= 0:
            raise EngineError(
                f"llm_engine.generate: the prompt has {len(prompt)} tokens; the engine's context is "
                f"{self.engine.max_model_len}"
            )
        params = to_sampling_params(sampling_params, room)
        [generation] = (await self.engine.agenerate(prompt, params))[:1]
        wants_logprobs = getattr(sampling_params, "logprobs", None) is not None or isinstance(
            sampling_params, SamplingParams
        )
        logprobs = None
        if wants_logprobs and generation.logprobs is not None:
            logprobs = [
                {t: Logprob(lp, rank=1)}
                for t, lp in zip(generation.token_ids, generation.logprobs, strict=True)
            ]
        skip = getattr(sampling_params, "skip_special_tokens", True)
        output = CompletionOutput(
            index=0,
            text=self.tokenizer.decode(generation.token_ids, skip_special_tokens=skip),
            token_ids=list(generation.token_ids),
            cumulative_logprob=sum(generation.logprobs) if generation.logprobs is not None else None,
            logprobs=logprobs,
            finish_reason=generation.finish_reason,
        )
        return RequestOutput(
            request_id=uuid.uuid4().hex,
            prompt_token_ids=prompt,
            outputs=[output],
            policy_version=generation.policy_version,
        )


class ExecuteAgent:
    """A file's `AgentExecutor()` and the event loop its episodes run on (a daemon thread)."""

    def __init__(self, executor_cls: type) -> None:
        self.agent = executor_cls()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(
            target=self.loop.run_forever, name="rl-agent-execute-loop", daemon=True
        )
        self.thread.start()

    def run(self, coroutine: Any) -> Any:
        """Run `coroutine` on the agent's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()


_EXECUTE_AGENTS: dict[str, ExecuteAgent] = {}
_EXECUTE_LOCK = threading.Lock()


def execute_agent(path: str, executor_cls: type) -> ExecuteAgent:
    """The one `ExecuteAgent` of the agent file at `path` in this process (built from
    `executor_cls` the first time; a later import of the file gives a new class, not a new agent)."""
    with _EXECUTE_LOCK:
        if path not in _EXECUTE_AGENTS:
            _EXECUTE_AGENTS[path] = ExecuteAgent(executor_cls)
        return _EXECUTE_AGENTS[path]


def _number(value: Any, field: str) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"execute() returned {field!r} with {value.numel()} values, expected one")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        raise ValueError(f"execute() returned {field!r} = {value!r}, expected a finite number")
    return float(value)


def episode_fields(result: Any) -> dict[str, Any]:
    """What `execute()` returned, checked, as {prompt_ids, response_ids, mask, logprobs,
    action_ranges (in response_ids), reward, score, extra_logs, truncated}. Raises ValueError
    naming the key at fault."""
    if not isinstance(result, Mapping):
        raise ValueError(f"execute() returned a {type(result).__name__}, expected a dict")
    missing = [key for key in ("observation_tokens", "action_ranges", "reward") if key not in result]
    if missing:
        raise ValueError(f"execute() result lacks {missing} (keys: {sorted(map(str, result))})")
    tokens = result["observation_tokens"]
    tokens = tokens.tolist() if isinstance(tokens, torch.Tensor) else [int(t) for t in tokens]
    ranges = [(int(start), int(end)) for start, end in result["action_ranges"]]
    if not ranges:
        raise ValueError("execute() returned no action_ranges: the episode generated nothing")
    previous = ranges[0][0]
    if previous < 1:
        raise ValueError(
            f"execute() returned action_ranges {ranges}: the first action starts at 0, before any prompt"
        )
    for start, end in ranges:
        if not previous <= start <= end <= len(tokens):
            raise ValueError(
                f"execute() returned action_ranges {ranges}: not increasing spans within the "
                f"{len(tokens)} observation_tokens"
            )
        previous = end
    prompt_length = ranges[0][0]
    mask = [False] * (len(tokens) - prompt_length)
    for start, end in ranges:
        mask[start - prompt_length : end - prompt_length] = [True] * (end - start)
    logprobs = result.get("rollout_log_probs")
    if logprobs is not None:
        logprobs = logprobs.tolist() if isinstance(logprobs, torch.Tensor) else [float(v) for v in logprobs]
        if len(logprobs) != len(tokens):
            raise ValueError(
                f"execute() returned {len(logprobs)} rollout_log_probs for {len(tokens)} observation_tokens"
            )
        logprobs = logprobs[prompt_length:]
    if result["reward"] is None:
        raise ValueError(
            "execute() returned reward None: the agent must score its episode (its run_agent's result "
            "gives the reward in OpenRLHF's server executor)"
        )
    reward = _number(result["reward"], "reward")
    score = result.get("scores")
    extra_logs = result.get("extra_logs") or {}
    if not isinstance(extra_logs, Mapping):
        raise ValueError(
            f"execute() returned extra_logs of type {type(extra_logs).__name__}, expected a dict"
        )
    return {
        "prompt_ids": tokens[:prompt_length],
        "response_ids": tokens[prompt_length:],
        "mask": mask,
        "logprobs": logprobs,
        "action_ranges": [(s - prompt_length, e - prompt_length) for s, e in ranges],
        "reward": reward,
        "score": reward if score is None else _number(score, "scores"),
        "extra_logs": dict(extra_logs),
        "truncated": bool(result.get("truncated", False)),
    }
