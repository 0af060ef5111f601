"""Which learner backend a run trains on (`train.backend`), and what the FSDP2 backend refuses.

"deepspeed" (default) builds every learner as a DeepSpeed engine; "fsdp2" shards the policy,
reference and teacher with torch's `fully_shard` (`rl_learner.fsdp2`). What the FSDP2 backend
does not do yet is refused here, in the validation pass (`rl_launch.validation.prepare`), before
anything starts, naming the option that asks for it:

| option                                              | why                                          |
| ---                                                 | ---                                          |
| a critic (algo.advantage.estimator gae), model.reward_pretrain | value models run on DeepSpeed only |
| model.lora_rank > 0                                 | LoRA under fully_shard is not wired in       |
| model.sequence_parallel_size > 1                    | Ulysses runs on DeepSpeed only               |
| model.dtype fp16                                    | fp16 needs a loss scaler (bf16, fp32 work)   |
| train.adam_offload, ray.ref/teacher.offload         | FSDP2 CPU offload is not wired in            |
| train.actor_optimizer muon                          | DeepSpeed's Muon                             |
| train.ema_beta                                      | the EMA reads a DeepSpeed engine's parameters |
| ray.colocate all with ray.learner_offload true      | no hybrid-engine state offload yet           |
| rl-launch sft / rm / dpo                            | only rl-launch ppo drives it yet             |
"""

from __future__ import annotations

from typing import Any

__all__ = ["fsdp2_refusals"]


def fsdp2_refusals(config: Any) -> list[tuple[str, Any, str]]:
    """[(option, value, why)] for what a `PPOConfig` asks of the FSDP2 backend that it does not do
    yet; empty when train.backend is not fsdp2 or nothing is refused."""
    if config.train.backend != "fsdp2":
        return []
    from .components.estimators import estimator_needs

    model, train, ray = config.model, config.train, config.ray
    asked = [
        (
            "algo.advantage.estimator",
            config.algo.advantage.estimator,
            estimator_needs(config.algo.advantage.estimator).critic,
            "needs a critic, a value model, which trains on DeepSpeed only",
        ),
        (
            "model.reward_pretrain",
            model.reward_pretrain,
            model.reward_pretrain is not None,
            "is a value model",
        ),
        ("model.lora_rank", model.lora_rank, model.lora_rank > 0, "LoRA is not wired into fully_shard yet"),
        (
            "model.sequence_parallel_size",
            model.sequence_parallel_size,
            model.sequence_parallel_size > 1,
            "Ulysses sequence parallelism runs on DeepSpeed only",
        ),
        ("model.dtype", model.dtype, model.dtype == "fp16", "fp16 needs a loss scaler; use bf16 or fp32"),
        ("train.adam_offload", True, train.adam_offload, "FSDP2 CPU offload is not wired in yet"),
        ("ray.ref.offload", True, ray.ref.offload, "FSDP2 CPU offload is not wired in yet"),
        ("ray.teacher.offload", True, ray.teacher.offload, "FSDP2 CPU offload is not wired in yet"),
        ("train.actor_optimizer", train.actor_optimizer, train.actor_optimizer != "adamw", "is DeepSpeed's"),
        ("train.ema_beta", train.ema_beta, train.ema_beta is not None, "the EMA is not wired in yet"),
        (
            "ray.learner_offload",
            True,
            ray.colocate == "all" and ray.learner_offload,
            "with ray.colocate all: the FSDP2 learners have no hybrid-engine state offload yet "
            "(set ray.learner_offload false)",
        ),
    ]
    return [
        (option, value, f"{why} (train.backend fsdp2; use train.backend deepspeed)")
        for option, value, refused, why in asked
        if refused
    ]
