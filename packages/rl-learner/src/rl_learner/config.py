"""Typed learner configuration, the DeepSpeed config dict it becomes, optimizer and LR schedule.

`OptimizerConfig` and `DeepSpeedConfig` are frozen msgspec structs (a launcher embeds them in
its own config file); every field is checked in `__post_init__`, and a bad value raises a
ValueError naming the field, the value and what is allowed.

Defaults follow OpenRLHF: AdamW with betas (0.9, 0.95), a cosine schedule with 3% linear
warmup down to 0.1·lr, gradient clipping at 1.0, ZeRO stage 2, bf16.

Two optimizers (`OptimizerConfig.name`): "adamw", a client optimizer from `build_optimizer`, and
"muon", DeepSpeed's own Muon (`"optimizer": {"type": "Muon"}` in `deepspeed_config`'s dict; the
engine builds it). DeepSpeed marks each parameter when the engine starts: a matrix (≥ 2-D) whose
name holds neither "embed" nor "lm_head" is Muon's, every other parameter (embeddings, the LM
head, norms, biases) goes to an auxiliary AdamW. For a Muon matrix W with gradient G and momentum
buffer M (β = muon_momentum; 5 Newton–Schulz steps and Nesterov momentum, fixed in DeepSpeed):

    M ← β·M + (1 − β)·G,   U = (1 − β)·G + β·M                     (Nesterov)
    W ← W·(1 − η·λ) − η · NS₅(U) · √max(1, rows / cols)           η = muon_lr × schedule factor

where NS₅(U) ≈ U·(UᵀU)^(-1/2), the nearest semi-orthogonal matrix (singular values near 1, a
quintic Newton–Schulz iteration on U / ‖U‖_F). The AdamW half uses lr, betas, eps; both halves
use weight_decay λ and the same schedule factor.

The learning-rate curve of `build_scheduler` over `total_steps` optimizer steps, with
W = ⌈warmup_ratio·total_steps⌉ warmup steps and r = min_lr_ratio:

    factor(s) = (s + 1) / W                                     s < W   (linear warmup)
    factor(s) = r + (1 − r)·½·(1 + cos(π·(s − W) / max(1, total_steps − W)))   s ≥ W (cosine)

(`scheduler="constant"` keeps the warmup and then holds 1.0.) The factor at step s is the one
the optimizer uses for its (s+1)-th update: warmup never starts from a zero learning rate.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import msgspec
import torch

__all__ = [
    "ATTN_IMPLEMENTATIONS",
    "BACKENDS",
    "DTYPES",
    "OPTIMIZERS",
    "PREFIX_SHARING_ATTENTION",
    "SCHEDULERS",
    "ZERO_STAGES",
    "DeepSpeedConfig",
    "OptimizerConfig",
    "build_optimizer",
    "build_scheduler",
    "deepspeed_config",
    "lr_factor",
    "merge_deepspeed_config",
    "muon_optimizer_section",
    "prefix_sharing_on",
    "torch_dtype",
    "warmup_steps",
]

SCHEDULERS: tuple[str, ...] = ("cosine", "constant")
OPTIMIZERS: tuple[str, ...] = ("adamw", "muon")
DTYPES: tuple[str, ...] = ("bf16", "fp16", "fp32")
ZERO_STAGES: tuple[int, ...] = (0, 1, 2, 3)
BACKENDS: tuple[str, ...] = ("deepspeed", "fsdp2")
"""Learner backends (`DeepSpeedConfig.backend`): DeepSpeed engines (default) or torch FSDP2."""
ATTN_IMPLEMENTATIONS: tuple[str, ...] = ("sdpa", "eager", "flash_attention_2")
PREFIX_SHARING_ATTENTION: tuple[str, ...] = ("sdpa", "eager")


def _choice(owner: str, field: str, value: Any, allowed: tuple) -> None:
    if isinstance(value, bool) or value not in allowed:
        raise ValueError(f"{owner}.{field}: {value!r} is not one of {', '.join(map(repr, allowed))}")


def _number(
    owner: str,
    field: str,
    value: Any,
    *,
    low: float,
    high: float = math.inf,
    open_low: bool = False,
    open_high: bool = False,
) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (value > low if open_low else value >= low) and (value < high if open_high else value <= high)
    if not ok:
        left, right = "(" if open_low else "[", ")" if open_high else "]"
        raise ValueError(f"{owner}.{field}: {value!r} is not a finite number in {left}{low}, {high}{right}")


class OptimizerConfig(msgspec.Struct, frozen=True, kw_only=True):
    """AdamW or Muon (module docstring) and the learning-rate schedule."""

    name: str = "adamw"
    """"adamw", or "muon": DeepSpeed's Muon on the hidden matrices, AdamW (lr, betas, eps) on
    the rest. With ZeRO 1-3 DeepSpeed orthogonalises before it measures the gradient norm, so
    grad_clip then clips the Newton–Schulz update (norm ≈ √Σ min(rows, cols) over the matrices),
    which shrinks Muon's step; grad_clip 0 turns clipping off. ZeRO-0 clips the gradient itself."""
    lr: float = 1e-6
    """Peak learning rate (after warmup) of AdamW (with "muon": of its AdamW half). OpenRLHF: 1e-6
    for actors, 9e-6 for critics."""
    muon_lr: float = 0.02
    """"muon" only: peak learning rate of the Muon matrices, in units of spectral norm per update."""
    muon_momentum: float = 0.95
    """"muon" only: momentum β of the Muon matrices, in [0, 1)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW (β1, β2), each in [0, 1)."""
    eps: float = 1e-8
    """AdamW ε added to the denominator, > 0."""
    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW), ≥ 0."""
    warmup_ratio: float = 0.03
    """Share of `total_steps` spent in linear warmup, in [0, 1]; warmup lasts ⌈ratio·total_steps⌉ steps."""
    min_lr_ratio: float = 0.1
    """The cosine schedule ends at min_lr_ratio·lr, in [0, 1]."""
    grad_clip: float = 1.0
    """Clip the global gradient 2-norm to this value; 0 turns clipping off."""
    scheduler: str = "cosine"
    """Learning-rate schedule after warmup: "cosine" (down to min_lr_ratio·lr) or "constant"."""

    def __post_init__(self) -> None:
        owner = type(self).__name__
        _choice(owner, "name", self.name, OPTIMIZERS)
        _number(owner, "lr", self.lr, low=0.0, open_low=True)
        _number(owner, "muon_lr", self.muon_lr, low=0.0, open_low=True)
        _number(owner, "muon_momentum", self.muon_momentum, low=0.0, high=1.0, open_high=True)
        if len(self.betas) != 2:
            raise ValueError(f"{owner}.betas: {self.betas!r} must have 2 entries (beta1, beta2)")
        for index, beta in enumerate(self.betas):
            _number(owner, f"betas[{index}]", beta, low=0.0, high=1.0, open_high=True)
        _number(owner, "eps", self.eps, low=0.0, open_low=True)
        _number(owner, "weight_decay", self.weight_decay, low=0.0)
        _number(owner, "warmup_ratio", self.warmup_ratio, low=0.0, high=1.0)
        _number(owner, "min_lr_ratio", self.min_lr_ratio, low=0.0, high=1.0)
        _number(owner, "grad_clip", self.grad_clip, low=0.0)
        _choice(owner, "scheduler", self.scheduler, SCHEDULERS)


class DeepSpeedConfig(msgspec.Struct, frozen=True, kw_only=True):
    """How a model is sharded, stored and run by DeepSpeed (or by torch FSDP2: `backend`)."""

    backend: str = "deepspeed"
    """Learner backend: "deepspeed" (default), or "fsdp2": torch's `fully_shard`
    (`rl_learner.fsdp2`; ZeRO stage, buckets and `extra` do not apply there, and what it does
    not do yet is refused: `rl_learner.fsdp2.fsdp2_refusals`)."""

    zero_stage: int = 2
    """ZeRO stage: 0 (data parallel), 1 (optimizer states), 2 (+ gradients), 3 (+ parameters)."""
    dtype: str = "bf16"
    """Training dtype of the weights and activations: "bf16", "fp16" (dynamic loss scaling) or "fp32"."""
    offload_optimizer: bool = False
    """Keep optimizer states on the CPU (ZeRO-Offload, stage ≥ 1); uses DeepSpeedCPUAdam. With
    backend "fsdp2": FSDP2's `CPUOffloadPolicy`, which keeps the sharded parameters and gradients
    in host memory too (`rl_learner.fsdp2`)."""
    offload_params: bool = False
    """Keep parameters on the CPU between uses (ZeRO-3 only; with backend "fsdp2": at any stage,
    FSDP2's `CPUOffloadPolicy`)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass instead of storing them (less memory, ~30% slower)."""
    attn_implementation: str = "sdpa"
    """Attention kernel of the HF model: "sdpa" (default), "eager", or "flash_attention_2" (needs the package)."""
    freeze_visual_encoder: bool = False
    """Vision-language models: train with the whole vision tower frozen, `model.visual` (patch
    embedding, vision blocks and the merger that projects into the language model's width);
    only the language model and LM head train. Applied when a trained learner is built, before
    its optimizer (`rl_learner.models.freeze_visual_encoder`); True on a text model is refused.
    OpenRLHF's `--actor.freeze_visual_encoder`."""
    share_prefix: bool | None = None
    """Run a prompt that several sequences of a micro-batch start with once (GRPO's n samples, a DPO
    pair): the same values and gradients for fewer tokens through the model
    (`rl_learner.models.shared_prefix`). None: on with sdpa and eager attention, off with
    flash_attention_2, whose kernel finds sequences from position ids and cannot share (True is
    refused with it)."""
    micro_batch_tokens: int = 16384
    """Token budget of one packed micro-batch (sequences are packed, never padded), ≥ 1."""
    sequence_parallel_size: int = 1
    """sp: ranks that share each packed micro-batch along its tokens (Ulysses,
    `rl_learner.sequence_parallel`), ≥ 1; 1 turns it off. The learner's ranks form groups of sp
    consecutive ranks (world size a multiple of sp), every rank of a group gets the same
    micro-batches, and each runs 1/sp of the tokens. The model's query and key-value head counts
    must divide by sp; attention must be sdpa or eager."""
    tensor_parallel_size: int = 1
    """tp: ranks that split each decoder layer's matrices (backend "fsdp2" only; Qwen2 / Llama
    family; `rl_learner.tensor_parallel`), ≥ 1; 1 turns it off. The learner's ranks form a dp × tp
    mesh (world size a multiple of tp): ranks [g·tp, (g+1)·tp) split the layers between them and get
    the same micro-batches, and FSDP2 shards over dp on top. The model's query and key-value head
    counts and MLP width must divide by tp."""
    reduce_bucket_size: int = 500_000_000
    """ZeRO gradient reduce bucket, in elements."""
    zero3_max_live_parameters: int = 1_000_000_000
    """ZeRO-3: parameters kept gathered at once, in elements."""
    zero3_prefetch_bucket_size: int = 50_000_000
    """ZeRO-3: parameters prefetched ahead of use, in elements."""
    extra: dict[str, Any] = msgspec.field(default_factory=dict)
    """DeepSpeed config keys merged last into `deepspeed_config`'s dict, nested dicts key by key
    (`{"zero_optimization": {"overlap_comm": True}}`); DeepSpeed checks them at initialize."""

    def __post_init__(self) -> None:
        owner = type(self).__name__
        _choice(owner, "backend", self.backend, BACKENDS)
        _choice(owner, "zero_stage", self.zero_stage, ZERO_STAGES)
        _choice(owner, "dtype", self.dtype, DTYPES)
        _choice(owner, "attn_implementation", self.attn_implementation, ATTN_IMPLEMENTATIONS)
        for field in (
            "offload_optimizer",
            "offload_params",
            "gradient_checkpointing",
            "freeze_visual_encoder",
        ):
            if not isinstance(getattr(self, field), bool):
                raise ValueError(f"{owner}.{field}: {getattr(self, field)!r} is not a bool")
        if self.share_prefix not in (None, True, False):
            raise ValueError(f"{owner}.share_prefix: {self.share_prefix!r} is not a bool or None")
        if self.share_prefix and self.attn_implementation not in PREFIX_SHARING_ATTENTION:
            raise ValueError(
                f"{owner}.share_prefix: True needs attn_implementation "
                f"{' or '.join(PREFIX_SHARING_ATTENTION)}, got {self.attn_implementation!r} "
                "(its kernel finds sequences from position ids); set share_prefix False or None"
            )
        if self.sequence_parallel_size != 1 and self.attn_implementation not in PREFIX_SHARING_ATTENTION:
            raise ValueError(
                f"{owner}.sequence_parallel_size: {self.sequence_parallel_size!r} needs attn_implementation "
                f"{' or '.join(PREFIX_SHARING_ATTENTION)}, got {self.attn_implementation!r} (sequence "
                "parallelism runs the packed, length-bucketed attention)"
            )
        for field in (
            "sequence_parallel_size",
            "tensor_parallel_size",
            "micro_batch_tokens",
            "reduce_bucket_size",
            "zero3_max_live_parameters",
            "zero3_prefetch_bucket_size",
        ):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{owner}.{field}: {value!r} is not an integer >= 1")
        deepspeed = self.backend == "deepspeed"  # FSDP2 offloads at any zero_stage (it does not apply)
        if deepspeed and self.tensor_parallel_size != 1:
            raise ValueError(
                f"{owner}.tensor_parallel_size: {self.tensor_parallel_size} needs backend 'fsdp2' "
                "(DTensor tensor parallelism); the DeepSpeed learners are data-parallel only "
                "(DeepSpeed's AutoTP trains a step on gloo here, but is not wired into these learners: their "
                "weight sync, checkpoints and HF export would need its split layers gathered)"
            )
        if deepspeed and self.offload_optimizer and self.zero_stage == 0:
            raise ValueError(f"{owner}.offload_optimizer: True needs zero_stage >= 1, got zero_stage 0")
        if deepspeed and self.offload_params and self.zero_stage != 3:
            raise ValueError(
                f"{owner}.offload_params: True needs zero_stage 3, got zero_stage {self.zero_stage}"
            )

    @property
    def shares_prefix(self) -> bool:
        """Whether the learner runs shared prefixes once (`prefix_sharing_on`)."""
        return prefix_sharing_on(self.share_prefix, self.attn_implementation)


def prefix_sharing_on(share_prefix: bool | None, attn_implementation: str) -> bool:
    """`share_prefix` as given, or for None whether `attn_implementation` can share (sdpa, eager)."""
    if share_prefix is None:
        return attn_implementation in PREFIX_SHARING_ATTENTION
    return share_prefix


def torch_dtype(name: str) -> torch.dtype:
    """ "bf16" → torch.bfloat16, "fp16" → torch.float16, "fp32" → torch.float32."""
    _choice("torch_dtype", "name", name, DTYPES)
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def deepspeed_config(
    ds: DeepSpeedConfig,
    optim: OptimizerConfig | None = None,
    *,
    world_size: int,
    train: bool = True,
) -> dict[str, Any]:
    """The DeepSpeed JSON config (a dict for `deepspeed.initialize(config=...)`).

    The learner drives gradient accumulation itself (one optimizer step over any number of
    packed micro-batches, each loss divided by a global count), so DeepSpeed sees one
    "sample" per micro-batch and `gradient_accumulation_steps = 1`; the learner marks the
    accumulation boundary by hand.

    Args:
      ds: sharding, dtype and offload options.
      optim: the optimizer options (gradient clipping); None for inference.
      world_size: data-parallel world size ≥ 1.
      train: False builds the config of an inference-only engine (reference or reward model):
        no optimizer sections, ZeRO stage 3 kept (parameters stay sharded), other stages become 0.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size: {world_size!r} is not an integer >= 1")
    stage = ds.zero_stage if train or ds.zero_stage == 3 else 0
    zero: dict[str, Any] = {"stage": stage}
    if stage >= 1:
        zero.update(
            reduce_bucket_size=ds.reduce_bucket_size,
            contiguous_gradients=True,
            overlap_comm=False,
        )
    if stage == 3:
        zero.update(
            stage3_max_live_parameters=ds.zero3_max_live_parameters,
            stage3_prefetch_bucket_size=ds.zero3_prefetch_bucket_size,
            stage3_param_persistence_threshold=0,
            stage3_gather_16bit_weights_on_model_save=True,
        )
        if ds.offload_params:
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    if train and ds.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": world_size,
        "zero_optimization": zero,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
    }
    if ds.dtype == "bf16":
        # check_grad_overflow: a non-finite gradient norm skips the step (as fp16 does).
        config["bf16"] = {"enabled": True, "check_grad_overflow": True}
    elif ds.dtype == "fp16":
        config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}
    if train:
        config["gradient_clipping"] = optim.grad_clip if optim is not None else 0.0
        if optim is not None and optim.name == "muon":
            config["optimizer"] = muon_optimizer_section(optim, ds)
            if stage == 3:
                # DeepSpeed's ZeRO-3 orthogonalises whole gradients: it refuses reduce-scatter
                zero["reduce_scatter"] = False
    return merge_deepspeed_config(config, ds.extra)


def muon_optimizer_section(optim: OptimizerConfig, ds: DeepSpeedConfig) -> dict[str, Any]:
    """The `"optimizer"` entry of a DeepSpeed config that runs DeepSpeed's Muon with `optim`'s settings.

    DeepSpeed gives `muon_lr` to the Muon matrices and `adam_lr` to the AdamW half, the shared
    `weight_decay` to both. Its AdamW half is torch's AdamW (`torch_adam`), as `build_optimizer`'s
    on CPU, or DeepSpeedCPUAdam with optimizer offload.
    """
    params: dict[str, Any] = {
        "lr": optim.muon_lr,
        "muon_lr": optim.muon_lr,
        "adam_lr": optim.lr,
        "momentum": optim.muon_momentum,
        "betas": list(optim.betas),
        "eps": optim.eps,
        "weight_decay": optim.weight_decay,
    }
    if not ds.offload_optimizer:
        params["torch_adam"] = True
    return {"type": "Muon", "params": params}


def merge_deepspeed_config(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """`base` with `extra` merged in: a dict value merges into the dict under the same key, any
    other value replaces it. Neither argument is modified.

        merge_deepspeed_config({"zero_optimization": {"stage": 2}}, {"zero_optimization": {"overlap_comm": True}})
        == {"zero_optimization": {"stage": 2, "overlap_comm": True}}
    """
    merged = dict(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = merge_deepspeed_config(dict(merged[key]), value)
        else:
            merged[key] = value
    return merged


def build_optimizer(
    params: Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]],
    optim: OptimizerConfig,
    ds: DeepSpeedConfig,
    *,
    device: torch.device | str = "cpu",
) -> torch.optim.Optimizer:
    """The client optimizer handed to `deepspeed.initialize` (AdamW; "muon" is built by DeepSpeed
    from `deepspeed_config`'s "optimizer" section and refused here).

    - optimizer offload → `deepspeed.ops.adam.DeepSpeedCPUAdam` (adamw_mode);
    - CUDA, ZeRO-0/1/2 → `torch.optim.AdamW(fused=True)`: torch ships its kernel, where
      DeepSpeed's FusedAdam is compiled by nvcc on a machine's first learner start (about a
      minute of start-up on every fresh machine or container without a prebuilt DeepSpeed);
      DeepSpeed's ZeRO-1/2 `offload_states` moves its Adam moments like FusedAdam's;
    - CUDA, ZeRO-3 → `deepspeed.ops.adam.FusedAdam` where its kernel builds (DeepSpeed 0.19's
      ZeRO-3 `offload_states`, the hybrid engine's hand-over, accepts no other optimizer), else
      `torch.optim.AdamW(fused=True)`;
    - CPU without offload → plain `torch.optim.AdamW` (no DeepSpeed op build).
    """
    if optim.name != "adamw":
        raise ValueError(
            f"build_optimizer: OptimizerConfig.name {optim.name!r} is built by DeepSpeed from the "
            "config's optimizer section (deepspeed_config), not as a client optimizer"
        )
    params = list(params)
    kwargs = dict(lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps, weight_decay=optim.weight_decay)
    if ds.offload_optimizer:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(params, adamw_mode=True, **kwargs)
    if torch.device(device).type == "cuda":
        if ds.zero_stage < 3:
            return torch.optim.AdamW(params, fused=True, **kwargs)
        try:
            from deepspeed.ops.adam import FusedAdam

            return FusedAdam(params, adam_w_mode=True, **kwargs)
        except Exception:  # the op failed to build or load: fall back to torch's fused AdamW
            return torch.optim.AdamW(params, fused=True, **kwargs)
    return torch.optim.AdamW(params, **kwargs)


def warmup_steps(optim: OptimizerConfig, total_steps: int) -> int:
    """W = ⌈warmup_ratio·total_steps⌉."""
    return math.ceil(optim.warmup_ratio * total_steps)


def lr_factor(step: int, optim: OptimizerConfig, total_steps: int) -> float:
    """The multiplier of `optim.lr` for optimizer step `step` (0-based; module docstring)."""
    warmup = warmup_steps(optim, total_steps)
    if step < warmup:
        return (step + 1) / warmup
    if optim.scheduler == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    ratio = optim.min_lr_ratio
    return ratio + (1.0 - ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer, optim: OptimizerConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """`LambdaLR` with `lr_factor`: linear warmup, then cosine to min_lr_ratio·lr (or constant)."""
    if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1:
        raise ValueError(f"total_steps: {total_steps!r} is not an integer >= 1")
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, optim, total_steps))
