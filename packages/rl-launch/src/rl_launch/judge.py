"""The judge of a run (`reward.judge_pretrain`): a frozen model on an engine of its own, a reward source.

    rl-launch ppo --reward.judge_pretrain path/to/judge --reward.judge_parser score_tag \\
        --reward.judge_template judge.txt --reward.judge_engine vllm

`JudgeWorker` is a Ray actor of its own (the role "judge", resources `ray.judge`), started before
the rollout engines: it holds the judge's engine (`reward.judge_engine` from
`rl_launch.components.ENGINES`, options `reward.judge_engine_options` verbatim over the run's) and
answers `generate` calls. It is not a rollout engine: nothing syncs weights to it, puts it to sleep
or counts it among `rollout.num_engines`. Each rollout actor gets a judge's handle (engine i asks
judge i mod `ray.judge.num_actors`) and scores its samples with `rl_rollout.JudgeReward` over
`RemoteJudgeEngine`: the template is rendered and tokenized there with the judge's tokenizer, the
call has the deadline `reward.judge_timeout_s` and follows `reward.on_error`, so a dead or hung
judge costs the step its judge rewards (or stops the run), never hangs it.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import msgspec

from .actors import EngineHolder, EngineSpec, send_output_to
from .plugins import import_plugins

__all__ = ["JudgeWorker", "RemoteJudgeEngine", "build_judge", "judge_engine_spec"]

_GRACE_S = 5.0
"""Seconds a judge call may outlive `reward.judge_timeout_s`: the reward's own deadline fires first
(a counted timeout), the thread it abandons ends at this one."""


def judge_engine_spec(spec: EngineSpec) -> EngineSpec:
    """The rollout engines' spec with the judge's model and engine: the judge model's own context
    (its template, the prompt and the response must fit; the rollout's when its config.json names
    none), one device, no LoRA adapter, no partial rollout. `reward.judge_engine_options` still go
    over these (`max_model_len` for a judge whose full context does not fit its KV cache)."""
    from .preflight import model_context

    reward = spec.reward
    context = model_context(reward.judge_pretrain)
    return msgspec.structs.replace(
        spec,
        kind=reward.judge_engine,
        options=dict(reward.judge_engine_options),
        model_path=reward.judge_pretrain,
        max_model_len=context[0] if context is not None else spec.max_model_len,
        tensor_parallel_size=1,
        lora_rank=0,
        partial_rollout=False,
        streaming=False,
    )


class JudgeWorker(EngineHolder):
    """The judge's engine in an actor of its own (Ray actor class; `rl_launch.roles.Roles.start`)."""

    def __init__(self, spec: EngineSpec, index: int = 0) -> None:
        os.environ["VLLM_LOGGING_LEVEL"] = spec.vllm_logging_level  # read when vLLM is imported
        send_output_to(spec.log_dir, f"judge-{index}")
        import_plugins(spec.plugins)
        from .components import ENGINES

        self.spec = judge_engine_spec(spec)
        self.engine = ENGINES[self.spec.kind].build(self.spec, **self.spec.options)

    def ready(self) -> bool:
        return True

    def generate(self, prompts: list[list[int]], params: Any) -> list[list[Any]]:
        """The engine's `generate` (token ids in, `Generation`s out)."""
        return self.engine.generate(prompts, params)


class RemoteJudgeEngine:
    """The engine protocol's `generate` over a `JudgeWorker` handle, bounded by `timeout_s` (+ a
    grace): past it the request is cancelled and TimeoutError raised, so no thread waits forever."""

    name = "judge"

    def __init__(self, handle: Any, timeout_s: float) -> None:
        self.handle, self.timeout_s = handle, timeout_s

    def generate(self, prompts: list[list[int]], params: Any) -> list[list[Any]]:
        import ray

        future = self.handle.generate.remote([list(prompt) for prompt in prompts], params)
        try:
            return ray.get(future, timeout=self.timeout_s + _GRACE_S)
        except ray.exceptions.GetTimeoutError:
            with contextlib.suppress(Exception):  # best effort: a running call may not stop
                ray.cancel(future)
            raise TimeoutError(f"the judge did not answer within {self.timeout_s + _GRACE_S:g} s") from None


def build_judge(spec: EngineSpec, engine: Any) -> Any:
    """The reward source "judge": `rl_rollout.JudgeReward` over `engine` (a `RemoteJudgeEngine`, or
    any engine), with the judge's tokenizer, the `reward.judge_*` options, the deadline
    `reward.judge_timeout_s` and the policy `reward.on_error` / `reward.fallback`."""
    from transformers import AutoTokenizer

    from rl_rollout import JudgeReward

    reward = spec.reward
    return JudgeReward(
        engine,
        AutoTokenizer.from_pretrained(reward.judge_pretrain),
        reward.judge_template,
        parser=reward.judge_parser,
        max_new_tokens=reward.judge_max_new_tokens,
        chat_template=reward.judge_chat_template,
        scale=reward.judge_scale,
        timeout_s=reward.judge_timeout_s,
        on_error=reward.on_error,
        fallback=reward.fallback,
        name=f"reward.judge_pretrain {reward.judge_pretrain}",
    )
