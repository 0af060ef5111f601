"""The launcher config's `model` and `train` sections as `rl_learner` settings, in one place.

`rl-launch ppo` (`roles.Roles`, its learner actors in `actors.LearnerWorker`) and `rl-launch
sft` / `rm` / `dpo` (`trainers.loop`) build their DeepSpeed learners from the same two sections
(`config.ModelConfig`, `config.TrainConfig` or its subclass), so they read them here:

    dtype     = learner_dtype(model.dtype, use_gpus=...)            "auto": bf16 on GPUs, fp32 on CPU
    settings  = learner_settings(model, train, dtype=dtype,         DeepSpeedConfig (with
                    use_gpus=...,
                    **role_optimizer(train, "actor"))               train.deepspeed_config merged
                                                                    last), OptimizerConfig (AdamW
                                                                    or Muon, the role's lr), LoRA
    frozen    = settings.frozen(offload=..., use_gpus=...)         a reference / reward model's DeepSpeedConfig
    options   = model_load_options(settings.deepspeed, settings.optimizer, world_size=...)
    model     = load_causal_lm(path, **options)                     (or load_value_model)

`rl_learner` is imported when a function runs, not with this module, so that the command line
starts without it.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rl_learner import DeepSpeedConfig, LoraOptions, OptimizerConfig

    from .config import ModelConfig, TrainConfig

__all__ = [
    "LearnerSettings",
    "frozen_offload",
    "learner_dtype",
    "learner_settings",
    "model_load_options",
    "offload_words",
    "optimizer_offload",
    "role_optimizer",
]


def learner_dtype(dtype: str, *, use_gpus: bool) -> str:
    """`model.dtype` resolved: "auto" is bf16 where the learners run on GPUs and fp32 on CPU."""
    if dtype != "auto":
        return dtype
    return "bf16" if use_gpus else "fp32"


@dataclasses.dataclass(frozen=True)
class LearnerSettings:
    """What a trained learner is built with; `inference` is the DeepSpeed config of a frozen one."""

    deepspeed: DeepSpeedConfig
    optimizer: OptimizerConfig
    lora: LoraOptions | None
    """None when `model.lora_rank` is 0 (all weights train)."""

    @property
    def inference(self) -> DeepSpeedConfig:
        """`deepspeed` without optimizer offload: a reference or reward model has no optimizer."""
        import msgspec

        return msgspec.structs.replace(self.deepspeed, offload_optimizer=False)

    def frozen(self, *, offload: bool, use_gpus: bool) -> DeepSpeedConfig:
        """`inference` for a reference or reward model, its parameters offloaded to CPU memory
        (DeepSpeed's ZeRO-3 `offload_param`) when `offload` (ray.ref.offload,
        ray.reward_model.offload) asks and `frozen_offload` says it applies."""
        import msgspec

        applied, _ = frozen_offload(
            offload, zero_stage=self.deepspeed.zero_stage, use_gpus=use_gpus, backend=self.deepspeed.backend
        )
        return msgspec.structs.replace(self.inference, offload_params=applied)


def frozen_offload(
    offload: bool, *, zero_stage: int, use_gpus: bool, backend: str = "deepspeed"
) -> tuple[bool, str]:
    """Whether a frozen model's parameter offload is applied, and why (for the start-up line).

    As in OpenRLHF, where DeepSpeed ignores offload_param below ZeRO-3: it takes effect with
    train.zero_stage 3 on GPUs. On CPU the parameters already live in host memory (and DeepSpeed's
    pinned offload buffers need CUDA), so the option is accepted and changes nothing. With
    `backend` "fsdp2" it takes effect on GPUs at any zero_stage (FSDP2's CPUOffloadPolicy).
    """
    if not offload:
        return False, "not asked"
    if not use_gpus:
        return False, "a no-op on CPU: the parameters already live in host memory"
    if backend == "fsdp2":
        return True, "parameters offloaded to CPU memory (FSDP2 CPUOffloadPolicy)"
    if zero_stage != 3:
        return (
            False,
            f"a no-op with train.zero_stage {zero_stage}: DeepSpeed offloads parameters under ZeRO-3 only",
        )
    return True, "parameters offloaded to CPU memory (ZeRO-3 offload_param)"


def optimizer_offload(asked: bool, *, use_gpus: bool, backend: str = "deepspeed") -> tuple[bool, str]:
    """Whether the trained models' optimizer offload (train.adam_offload) is applied, and why (for
    the start-up line).

    On GPUs DeepSpeed's ZeRO-Offload keeps the optimizer states in CPU memory and steps them with
    DeepSpeedCPUAdam, as OpenRLHF's --adam_offload does. With DeepSpeed on CPU the states already
    live in host memory: the option is accepted and changes nothing, and DeepSpeed's CPU Adam op
    (a minute of compiling at a machine's first start) is not built. FSDP2's CPUOffloadPolicy is
    applied on either device (parameters, gradients and AdamW state).
    """
    if not asked:
        return False, "not asked"
    if backend == "fsdp2":
        return True, "parameters, gradients and AdamW state in CPU memory (FSDP2 CPUOffloadPolicy)"
    if not use_gpus:
        return (
            False,
            "a no-op on CPU: the optimizer states already live in host memory (no CPU Adam op to build)",
        )
    return True, "optimizer states offloaded to CPU memory (ZeRO-Offload, DeepSpeedCPUAdam)"


def offload_words(config: Any, started: set[str], *, use_gpus: bool) -> str | None:
    """The start-up words of train.adam_offload and ray.ref / ray.teacher / ray.reward_model.offload
    (of the roles in `started`): applied, or why it is a no-op here; None when none is set."""
    words = []
    if config.train.adam_offload:
        _, why = optimizer_offload(True, use_gpus=use_gpus, backend=config.train.backend)
        words.append(f"train.adam_offload: {why}")
    for role in ("ref", "teacher", "reward_model"):
        if getattr(config.ray, role).offload and role in started:
            _, why = frozen_offload(
                True, zero_stage=config.train.zero_stage, use_gpus=use_gpus, backend=config.train.backend
            )
            words.append(f"ray.{role}.offload: {why}")
    return "; ".join(words) or None


def learner_settings(
    model: ModelConfig,
    train: TrainConfig,
    *,
    dtype: str,
    lr: float,
    optimizer: str = "adamw",
    muon_lr: float = 0.02,
    use_gpus: bool = True,
) -> LearnerSettings:
    """The learner settings of the `model` and `train` sections, with resolved `dtype` and peak `lr`.

    `lr`, `optimizer` and `muon_lr` are passed because a run has one of each per trained role
    (`train.actor_learning_rate`, `train.actor_optimizer`, `train.actor_muon_learning_rate`
    and the critic's; `role_optimizer` reads them); `use_gpus`, whether the learners run on GPUs,
    decides whether train.adam_offload applies (`optimizer_offload`); everything else comes from
    the sections as they are.
    """
    from rl_learner import DeepSpeedConfig, LoraOptions, OptimizerConfig

    deepspeed = DeepSpeedConfig(
        backend=train.backend,
        zero_stage=train.zero_stage,
        dtype=dtype,
        offload_optimizer=optimizer_offload(train.adam_offload, use_gpus=use_gpus, backend=train.backend)[0],
        gradient_checkpointing=model.gradient_checkpointing,
        attn_implementation=model.attn_implementation,
        share_prefix=model.share_prefix,
        micro_batch_tokens=train.micro_batch_tokens,
        sequence_parallel_size=model.sequence_parallel_size,
        tensor_parallel_size=train.tensor_parallel_size,
        extra=dict(train.deepspeed_config),
    )
    optim = OptimizerConfig(
        name=optimizer,
        lr=lr,
        muon_lr=muon_lr,
        muon_momentum=train.muon_momentum,
        betas=train.adam_betas,
        weight_decay=train.weight_decay,
        warmup_ratio=train.lr_warmup_ratio,
        min_lr_ratio=train.min_lr_ratio,
        grad_clip=train.max_norm,
    )
    lora = None
    if model.lora_rank > 0:
        targets = model.target_modules
        lora = LoraOptions(
            rank=model.lora_rank,
            alpha=float(model.lora_alpha),
            dropout=model.lora_dropout,
            target_modules="all-linear" if targets == ["all-linear"] else list(targets),
        )
    return LearnerSettings(deepspeed=deepspeed, optimizer=optim, lora=lora)


def role_optimizer(train: TrainConfig, role: str) -> dict[str, Any]:
    """`learner_settings`' per-role keywords for `role` "actor" or "critic": lr, optimizer, muon_lr."""
    if role not in ("actor", "critic"):
        raise ValueError(f"role: {role!r} is not 'actor' or 'critic'")
    return {
        "lr": getattr(train, f"{role}_learning_rate"),
        "optimizer": getattr(train, f"{role}_optimizer"),
        "muon_lr": getattr(train, f"{role}_muon_learning_rate"),
    }


def model_load_options(
    deepspeed: DeepSpeedConfig, optimizer: OptimizerConfig | None, *, world_size: int
) -> dict[str, Any]:
    """Keyword arguments of `rl_learner.load_causal_lm` / `load_value_model` for a learner.

    Under ZeRO-3 the model is built partitioned (`zero3_config`: the DeepSpeed config of this
    engine, `optimizer` and `world_size` included, so that transformers' `zero.Init` shards it
    the way the engine will).
    """
    import torch

    from rl_learner import deepspeed_config
    from rl_learner.config import torch_dtype

    zero3 = None
    fsdp2 = deepspeed.backend == "fsdp2"
    if deepspeed.zero_stage == 3 and not fsdp2:
        zero3 = deepspeed_config(deepspeed, optimizer, world_size=world_size)
    trained_fsdp2 = fsdp2 and optimizer is not None  # fp32 master weights (rl_learner.fsdp2)
    return {
        "dtype": torch.float32 if trained_fsdp2 else torch_dtype(deepspeed.dtype),
        "attn_implementation": deepspeed.attn_implementation,
        "gradient_checkpointing": deepspeed.gradient_checkpointing,
        "zero3_config": zero3,
    }
