"""The judge's actor (`reward.judge_pretrain`, `rl_launch.judge`): the judge model's engine in a Ray
actor of its own, answering `generate` calls; never weight-synced, put to sleep or counted among
the rollout engines (`rl_launch.roles.Roles` starts it before the engines that are handed it)."""

from __future__ import annotations

import os
from typing import Any

import msgspec

from .actors import EngineHolder, EngineSpec, send_output_to
from .plugins import import_plugins

__all__ = ["JudgeWorker", "judge_engine_spec"]


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
