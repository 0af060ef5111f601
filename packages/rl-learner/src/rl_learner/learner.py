"""DeepSpeed learners: policy (actor), reference, critic and reward models.

A `Learner` wraps one transformers model in a DeepSpeed engine. `PolicyLearner` computes
log-probs (old or reference, no grad) and trains with an `rl_algos` policy loss;
`ValueLearner` computes values and reward scores and trains with the clipped value loss. A
reference model is `PolicyLearner(model, deepspeed=..., optimizer=None)`; a reward model is
`ValueLearner(model, deepspeed=..., optimizer=None)`.

One optimizer step (`train_step`) runs over this rank's micro-batches, each an
`rl_data.ExperienceBatch`. The loss is normalised by the global count of the whole step:

    n_global = Σ_ranks Σ_micro-batches loss_normalizer(mask_j, mode)        (one all-reduce)
    L_j      = aggregate_loss(l_j, mask_j, mode, normalizer=n_global)      (per micro-batch)
    backward(world_size · L_j)                                             (DeepSpeed averages
                                                                            gradients over ranks)

so the gradient is that of the full-batch loss Σ_j L_j whatever the split into micro-batches
and ranks. DeepSpeed is configured with gradient_accumulation_steps = 1 and the learner marks
the accumulation boundary itself (`engine.set_gradient_accumulation_boundary`), calling
`engine.backward(..., scale_wrt_gas=False)`: nothing divides by the number of micro-batches.
Every rank must pass the same number of micro-batches (ZeRO's collectives run in lockstep; the
`rl_data.plan_micro_batches` plan guarantees it); an empty micro-batch runs a one-token dummy
forward/backward whose loss is exactly 0.

Sequence parallelism (`DeepSpeedConfig.sequence_parallel_size` = sp > 1; `rl_learner.sequence_parallel`).
The world's ranks form groups of sp consecutive ranks; every rank of a group is given the same
micro-batches (checked) and runs 1/sp of each packed row, and every rank of the group ends with
the full per-token log-probs / values and the same loss L_j. Each rank's backward gives the part
of ∇L_j that flows through its tokens, so the sum over the group is ∇L_j, and the rule above
still holds with world_size = sp × dp: DeepSpeed averages over all ranks, the factor world_size
turns the average into that sum. Only the first rank of a group adds to the counts (`StepCounts`)
and the metrics, so n_global counts each micro-batch once.

Tensor parallelism (FSDP2 with `DeepSpeedConfig.tensor_parallel_size` = tp > 1;
`rl_learner.tensor_parallel`). Groups of tp consecutive ranks share micro-batches the same way (same
check, first rank counts), but each rank computes the whole loss L_j and its exact share of the
gradient; FSDP2 averages over the dp = world_size / tp ranks only, so the factor is dp
(`gradient_ranks`).

Non-finite values. Before any forward the inputs (advantages, old/reference/rollout log-probs,
values, returns) are checked; each loss is checked after its forward; the gradient norm is
checked before the update. All ranks agree through an all-reduce. With `on_non_finite="skip"`
the step changes nothing (weights, optimizer state and LR schedule) and reports `skipped = 1`;
with "raise" a `NonFiniteError` names the micro-batch, the rank and the quantity. A non-finite
gradient norm found after the backward is handled by DeepSpeed's overflow path (ZeRO ≥ 1,
bf16, fp16: the update is dropped, the scheduler not stepped) or, for ZeRO-0 fp32, by the
learner before calling the optimizer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import os
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import msgspec
import torch
import torch.distributed as dist

from rl_algos import (
    AGGREGATION_MODES,
    CORRECTIONS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    aggregate_loss,
    kl_penalty,
    load_balancing_loss,
    loss_normalizer,
    policy_objective,
    value_loss,
)
from rl_data import ExperienceBatch

from .config import DeepSpeedConfig, OptimizerConfig, build_optimizer, build_scheduler, deepspeed_config
from .distributed import ensure_distributed
from .models import (
    RouterCapture,
    _vision_model,
    freeze_visual_encoder,
    packed_logprobs,
    packed_model_inputs,
    packed_scores,
    packed_values,
    shared_prefix,
    unwrap_model,
)
from .routing import (
    REPLAYABLE_MODEL_TYPES,
    ROUTER_REPLAY_MODES,
    MoERouting,
    routing_metric_keys,
    routing_metrics,
)
from .sequence_parallel import SequenceParallelGroup, check_heads, new_sequence_parallel_group

__all__ = [
    "ON_NON_FINITE",
    "Learner",
    "NonFiniteError",
    "PolicyLearner",
    "PolicyLossConfig",
    "ValueLearner",
    "ValueLossConfig",
]

ON_NON_FINITE: tuple[str, ...] = ("skip", "raise")


class NonFiniteError(FloatingPointError):
    """A non-finite loss, input or gradient norm in a train step (`on_non_finite="raise"`)."""


def _choice(owner: str, field: str, value: Any, allowed: Sequence[Any]) -> None:
    if value not in allowed:
        raise ValueError(f"{owner}.{field}: {value!r} is not one of {', '.join(map(repr, allowed))}")


def _non_negative(owner: str, field: str, value: float) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        raise ValueError(f"{owner}.{field}: {value!r} is not a finite number >= 0")


class PolicyLossConfig(msgspec.Struct, frozen=True, kw_only=True):
    """What `PolicyLearner.train_step` minimises.

    Checked when built (a ValueError names the field): the names against the registries, the
    numbers, and a dry run of the correction's and the KL's options on a 1×1 batch, done once per
    process for each option set, so a config built again every step with another `kl_coef` (an
    adaptive KL controller) and sent to every rank does not dry-run them again."""

    name: str = "ppo"
    """Policy loss, a name in `rl_algos.POLICY_LOSSES` (ppo, gspo, gmpo, cispo, sapo, reinforce, ...)."""
    options: dict[str, Any] = msgspec.field(default_factory=dict)
    """Keyword options of that loss, e.g. {"epsilon_low": 0.2, "epsilon_high": 0.28, "dual_clip": 3.0}."""
    aggregation: str = "token-mean"
    """Loss aggregation, one of `rl_algos.AGGREGATION_MODES`; normalised by the global count of the step."""
    horizon: int | None = None
    """T of "seq-mean-token-sum-norm" (Dr.GRPO), e.g. max_new_tokens; required for that mode."""
    kl_coef: float = 0.0
    """β of the KL(π‖π_ref) term added to the loss (GRPO style); 0 turns it off (needs ref_logprobs)."""
    kl_estimator: str = "k3"
    """KL estimator of that term: a name in `rl_algos.KL_ESTIMATORS` ("k3", or "k3+": k2's gradient)."""
    distill_coef: float = 0.0
    """β_d of the KL(π‖π_T) term to a distillation teacher added to the loss (on-policy
    distillation, `rl_algos.distillation`); 0 turns it off (needs teacher_logprobs)."""
    distill_estimator: str = "k2"
    """KL estimator of that term, a name in `rl_algos.KL_ESTIMATORS` (k2: the reverse-KL gradient)."""
    entropy_coef: float = 0.0
    """Coefficient of the entropy bonus (loss −= coef·entropy); 0 turns it off."""
    correction: str = "none"
    """Rollout/learner mismatch correction, a name in `rl_algos.CORRECTIONS` (needs rollout_logprobs):
    "tis" / "truncate", "icepop", "mask", "seq-mask" (kept sequences at weight 1), "seq-mask-tis"
    (kept sequences keep token weights, OpenRLHF), or one a user registered; "none" for no weights."""
    correction_options: dict[str, Any] = msgspec.field(default_factory=dict)
    """Keyword options of that correction, passed verbatim, e.g. {"level": "sequence", "low": 0.5,
    "high": 2.0} for "tis" or {"gating": "tv", "low": 0.0, "high": 0.1} for "mask"."""
    kl_options: dict[str, Any] = msgspec.field(default_factory=dict)
    """Keyword options of `rl_algos.kl_penalty` for the KL term, e.g. {"log_ratio_clamp": 20,
    "value_clamp": 10} (verl) or {"unbiased_gradient": True} (OpenRLHF; uses the old log-probs)."""
    temperature: float = 1.0
    """Sampling temperature: log-probs are computed from logits / temperature, as the sampler did."""
    old_logprobs_from_forward: bool = False
    """Use the training forward's own log-probs, detached, as the old log-probs (ratio ≡ 1), so the
    batch needs no `old_logprobs`. Exact when this is the batch's only optimizer step: the weights
    that would have scored it are the ones training on it. Refused for a model with dropout
    (its training forward differs from an inference one). Needs `rollout_logprobs`: the step
    reports logprob_mismatch_mean / _max (|old − rollout|), the check a separate forward gave."""

    aux_loss_coef: float = 0.0
    """c of the mixture-of-experts load-balancing term (`rl_algos.load_balancing_loss` of the
    routers' logits over each micro-batch's tokens): loss += c · Σ_j (A_j / A) · L_aux,j, A_j the
    action tokens of micro-batch j and A the step's; 0 turns it off. Needs an MoE policy."""
    router_replay: str = "disabled"
    """Routing replay, verl's `router_replay.mode` names (`rl_learner.routing.ROUTER_REPLAY_MODES`):
    "R3" sends every token to the experts the rollout engine chose for it (the batch's
    `routed_experts`, gate weights recomputed from the learner's router logits over them) in the
    training forward; pass the same to `logprobs` for the old log-probs. Needs an MoE policy whose
    router `rl_learner.routing` can replay and an engine that records routes. "disabled": the
    routers choose."""

    def __post_init__(self) -> None:
        owner = type(self).__name__
        if self.name not in POLICY_LOSSES:
            raise ValueError(f"{owner}.name: {self.name!r} is not one of {', '.join(sorted(POLICY_LOSSES))}")
        _choice(owner, "aggregation", self.aggregation, AGGREGATION_MODES)
        if self.aggregation == "seq-mean-token-sum-norm" and self.horizon is None:
            raise ValueError(f"{owner}.horizon: None; seq-mean-token-sum-norm needs the constant length T")
        if self.horizon is not None and (not isinstance(self.horizon, int) or self.horizon < 1):
            raise ValueError(f"{owner}.horizon: {self.horizon!r} is not an integer >= 1")
        _non_negative(owner, "kl_coef", self.kl_coef)
        _non_negative(owner, "distill_coef", self.distill_coef)
        _non_negative(owner, "aux_loss_coef", self.aux_loss_coef)
        _choice(owner, "router_replay", self.router_replay, ROUTER_REPLAY_MODES)
        for field in ("kl_estimator", "distill_estimator"):
            if getattr(self, field) not in KL_ESTIMATORS:
                raise ValueError(
                    f"{owner}.{field}: {getattr(self, field)!r} is not one of {sorted(KL_ESTIMATORS)}"
                )
        if not isinstance(self.entropy_coef, (int, float)) or not math.isfinite(self.entropy_coef):
            raise ValueError(f"{owner}.entropy_coef: {self.entropy_coef!r} is not a finite number")
        if self.correction == "none":
            if self.correction_options:
                raise ValueError(
                    f"{owner}.correction_options: {self.correction_options!r} given, but correction is "
                    "'none' (no weights); name a correction or drop the options"
                )
        elif self.correction not in CORRECTIONS:
            raise ValueError(
                f"{owner}.correction: {self.correction!r} is not 'none' nor one of {', '.join(sorted(CORRECTIONS))}"
            )
        _dry_run_options_once(self)
        if not isinstance(self.temperature, (int, float)) or not self.temperature > 0:
            raise ValueError(f"{owner}.temperature: {self.temperature!r} is not a number > 0")


_CHECKED_OPTIONS: dict[bytes, None] = {}
"""Keys (`_options_key`) of the option sets this process has dry-run, oldest first (bounded)."""
_CHECKED_OPTIONS_LIMIT = 64


def _options_key(config: PolicyLossConfig) -> bytes | None:
    """What the dry runs of `config` depend on: the correction and the KL estimator (by name and
    by the function registered under it) and their options; None when the options do not encode
    (then every construction dry-runs them)."""
    try:
        return msgspec.json.encode(
            (
                config.correction,
                id(CORRECTIONS.get(config.correction)),
                config.correction_options,
                config.kl_estimator,
                id(KL_ESTIMATORS.get(config.kl_estimator)),
                config.kl_options,
            ),
            order="sorted",
        )
    except (TypeError, msgspec.EncodeError):
        return None


def _dry_run_options_once(config: PolicyLossConfig) -> None:
    """Dry-run the correction's and the KL's options on a 1×1 batch, once per process for each
    option set: a config built again with the same options (every step, with the adaptive β of a
    KL controller) and unpickled on every rank does not run them again.

    Raises ValueError naming `PolicyLossConfig.correction_options` or `.kl_options`."""
    key = _options_key(config)
    if key is not None and key in _CHECKED_OPTIONS:
        return
    owner = type(config).__name__
    one = torch.zeros(1, 1)
    if config.correction != "none":
        # The correction checks its own options (e.g. a divergence gating needs low = 0).
        try:
            CORRECTIONS[config.correction](one, one, torch.ones(1, 1), **config.correction_options)
        except (TypeError, ValueError) as error:
            raise ValueError(
                f"{owner}.correction_options: {config.correction_options!r} for correction "
                f"{config.correction!r}: {error}"
            ) from None
    if config.kl_options:
        extra = {"old_logprobs": one} if config.kl_options.get("unbiased_gradient") else {}
        try:
            kl_penalty(one, one, config.kl_estimator, **config.kl_options, **extra)
        except (TypeError, ValueError) as error:
            raise ValueError(f"{owner}.kl_options: {config.kl_options!r}: {error}") from None
    if key is not None:
        if len(_CHECKED_OPTIONS) >= _CHECKED_OPTIONS_LIMIT:
            del _CHECKED_OPTIONS[next(iter(_CHECKED_OPTIONS))]
        _CHECKED_OPTIONS[key] = None


class ValueLossConfig(msgspec.Struct, frozen=True, kw_only=True):
    """What `ValueLearner.train_step` minimises: 0.5·max((V − R)², (clip(V, V_old ± ε) − R)²)."""

    clip_range: float | None = 0.5
    """ε of the value clip around the old values; None for the unclipped loss."""
    aggregation: str = "token-mean"
    """Loss aggregation, one of `rl_algos.AGGREGATION_MODES`, normalised by the global count."""
    horizon: int | None = None
    """T of "seq-mean-token-sum-norm"."""

    def __post_init__(self) -> None:
        owner = type(self).__name__
        if self.clip_range is not None and not (
            isinstance(self.clip_range, (int, float)) and self.clip_range > 0
        ):
            raise ValueError(f"{owner}.clip_range: {self.clip_range!r} is not a number > 0 or None")
        _choice(owner, "aggregation", self.aggregation, AGGREGATION_MODES)
        if self.aggregation == "seq-mean-token-sum-norm" and self.horizon is None:
            raise ValueError(f"{owner}.horizon: None; seq-mean-token-sum-norm needs the constant length T")


# --------------------------------------------------------------------------- process group


# --------------------------------------------------------------------------- step counts


@dataclasses.dataclass
class StepCounts:
    """The counts one optimizer step needs before any forward, summed over micro-batches and ranks.

    All are float64 so that one all-reduce (`to_tensor` / `from_tensor`) carries them together,
    next to the ranks' usage-error flags.
    """

    normalizer: float = 0.0
    """Σ loss_normalizer(mask_j, mode): what every micro-batch's loss is divided by."""
    action_tokens: float = 0.0
    """Σ action tokens (the denominator of the token-mean metrics)."""
    sequences: float = 0.0
    """Σ sequences."""
    micro_batches: float = 0.0
    """Σ_ranks M, with M the rank's number of micro-batches."""
    micro_batches_squared: float = 0.0
    """Σ_ranks M²: equals (Σ_ranks M)² / world_size only if every rank has the same M."""
    tokens: float = 0.0
    """Σ packed tokens (prompt and response)."""
    shared_prefix_tokens: float = 0.0
    """Σ tokens a shared prompt prefix saved (0 without prefix sharing)."""

    def to_tensor(self) -> torch.Tensor:
        """The counts in field order, float64 [len(fields)]."""
        return torch.tensor(dataclasses.astuple(self), dtype=torch.float64)

    @classmethod
    def from_tensor(cls, values: torch.Tensor) -> StepCounts:
        """The inverse of `to_tensor`: `values` [len(fields)] in field order."""
        size = len(dataclasses.fields(cls))
        if values.shape != (size,):
            raise ValueError(f"StepCounts.from_tensor: values has shape {tuple(values.shape)}, not ({size},)")
        return cls(*(float(value) for value in values.tolist()))

    def uniform_micro_batches(self, world_size: int) -> bool:
        """Whether every rank ran the same number M of micro-batches: Σ M² · R = (Σ M)²."""
        return self.micro_batches_squared * world_size == self.micro_batches**2


# --------------------------------------------------------------------------- base


class Learner:
    """One model in a DeepSpeed engine, trained (with `optimizer`) or inference only (`optimizer=None`).

    Args:
      model: a transformers model (see `rl_learner.models`), possibly with LoRA adapters.
      deepspeed: ZeRO stage, dtype, offload options.
      optimizer: AdamW or Muon and schedule options; None builds an inference-only engine (ZeRO-3 stays
        sharded, other stages run as plain data parallel).
      total_steps: optimizer steps of the run, for the LR schedule.
      on_non_finite: "skip" or "raise" (module docstring).

    Attributes: `engine` (DeepSpeed engine), `module` (the transformers model), `rank`,
    `world_size`, `sequence_parallel` / `tensor_parallel` (this rank's group or None), `device`,
    `deepspeed_config` (the dict DeepSpeed got), `step` (updates applied), `lr` (of the next update).
    """

    fsdp2_ready: ClassVar[bool] = False
    """Whether this learner runs on the FSDP2 backend (`DeepSpeedConfig.backend = "fsdp2"`)."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        deepspeed: DeepSpeedConfig,
        optimizer: OptimizerConfig | None = None,
        total_steps: int = 1,
        on_non_finite: str = "skip",
    ) -> None:
        import deepspeed as deepspeed_lib

        if not isinstance(deepspeed, DeepSpeedConfig):
            raise TypeError(f"deepspeed must be a DeepSpeedConfig, got {type(deepspeed).__name__}")
        if optimizer is not None and not isinstance(optimizer, OptimizerConfig):
            raise TypeError(f"optimizer must be an OptimizerConfig or None, got {type(optimizer).__name__}")
        _choice(type(self).__name__, "on_non_finite", on_non_finite, ON_NON_FINITE)
        if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1:
            raise ValueError(f"total_steps: {total_steps!r} is not an integer >= 1")
        ensure_distributed()
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.sequence_parallel = self._sequence_parallel_group(model, deepspeed.sequence_parallel_size)
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.device = torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
        self.ds = deepspeed
        self.optim = optimizer
        self.on_non_finite = on_non_finite
        self.total_steps = total_steps
        self.deepspeed_config = deepspeed_config(
            deepspeed, optimizer, world_size=self.world_size, train=optimizer is not None
        )
        self.tensor_parallel = None  # this rank's TP group (FSDP2 with tensor_parallel_size > 1)
        if deepspeed.backend == "fsdp2":
            self.engine = self._fsdp2_engine(model)
            self.tensor_parallel = self.engine.tensor_parallel
            return
        if optimizer is None:
            model.requires_grad_(False)
            engine, *_ = deepspeed_lib.initialize(model=model, config=self.deepspeed_config)
            engine.eval()
        else:
            if deepspeed.freeze_visual_encoder:
                freeze_visual_encoder(model)
            trainable = [p for p in model.parameters() if p.requires_grad]
            if not trainable:
                raise ValueError("model has no trainable parameters (requires_grad is False everywhere)")
            if optimizer.name == "muon":
                # DeepSpeed builds its Muon from the config's optimizer section and tags every
                # parameter of `model` (use_muon) on the way; the schedule wraps what it built.
                engine, *_ = deepspeed_lib.initialize(
                    model=model,
                    model_parameters=trainable,
                    lr_scheduler=lambda built: build_scheduler(built, optimizer, total_steps),
                    config=self.deepspeed_config,
                )
            else:
                client = build_optimizer(trainable, optimizer, deepspeed, device=self.device)
                scheduler = build_scheduler(client, optimizer, total_steps)
                engine, *_ = deepspeed_lib.initialize(
                    model=model, optimizer=client, lr_scheduler=scheduler, config=self.deepspeed_config
                )
        self.engine = engine

    def _fsdp2_engine(self, model: torch.nn.Module) -> Any:
        """The model sharded by torch FSDP2 (`rl_learner.fsdp2.Fsdp2Engine`), for `backend="fsdp2"`."""
        from .fsdp2 import Fsdp2Engine

        if not self.fsdp2_ready:
            raise ValueError(
                f"{type(self).__name__}: DeepSpeedConfig.backend 'fsdp2' is not wired into this learner "
                "class (its fsdp2_ready is False); use backend 'deepspeed'"
            )
        if self.ds.freeze_visual_encoder and self.trainable:
            freeze_visual_encoder(model)
        return Fsdp2Engine(model, self.ds, self.optim, total_steps=self.total_steps, device=self.device)

    def _sequence_parallel_group(self, model: torch.nn.Module, size: int) -> SequenceParallelGroup | None:
        """This rank's SP group (`new_sequence_parallel_group`), after checking the model can be split."""
        if size == 1:
            return None
        owner = type(self).__name__
        if _vision_model(unwrap_model(model)) is not None:
            raise ValueError(
                f"{owner}: sequence_parallel_size {size} is not supported for vision-language models yet "
                "(the per-rank split of mRoPE positions and image embeddings is not verified); use 1"
            )
        config = getattr(unwrap_model(model), "config", None)
        heads = getattr(config, "num_attention_heads", None)
        if heads is None:
            raise ValueError(f"{owner}: sequence parallelism needs a model config with num_attention_heads")
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        check_heads(heads, kv_heads, size, owner=type(unwrap_model(model)).__name__)
        return new_sequence_parallel_group(size)

    @property
    def counts_for_group(self) -> bool:
        """Whether this rank adds its micro-batches to the step's counts and metrics: the first
        rank of its SP group (the group's ranks hold the same micro-batches), every rank without SP."""
        group = self._batch_group
        return group is None or group.rank == 0

    @property
    def _batch_group(self) -> Any:
        """This rank's group of ranks that share micro-batches: its sequence-parallel group, its
        tensor-parallel group (FSDP2 with tensor_parallel_size > 1), or None."""
        return self.sequence_parallel if self.sequence_parallel is not None else self.tensor_parallel

    @property
    def gradient_ranks(self) -> int:
        """The ranks the engine averages gradients over, so the backward factor that turns that
        average into a sum (module docstring): the world, or with tensor parallelism its dp ranks
        (a TP group's ranks compute one micro-batch's gradient together)."""
        return self.world_size // self.ds.tensor_parallel_size

    @property
    def module(self) -> torch.nn.Module:
        """The transformers model inside the engine."""
        return unwrap_model(self.engine)

    @property
    def step(self) -> int:
        """Optimizer updates applied so far (the LR scheduler's count, restored with a DeepSpeed checkpoint)."""
        scheduler = getattr(self.engine, "lr_scheduler", None)
        return int(scheduler.last_epoch) if scheduler is not None else 0

    @property
    def trainable(self) -> bool:
        return self.optim is not None

    @property
    def lr(self) -> float:
        """Learning rate of the next update (with Muon: of the Muon matrices, DeepSpeed's first group)."""
        return float(self.engine.optimizer.param_groups[0]["lr"]) if self.trainable else 0.0

    # ----------------------------------------------------------------- hybrid engine: GPU memory

    def offload_plan(self) -> tuple[str, str]:
        """How `offload_states` frees this learner's GPU memory: ("deepspeed" | "module" | "none", why).

        - "deepspeed": a trained engine under ZeRO-1/2/3 whose optimizer lives on the GPU; DeepSpeed's
          `offload_states()` moves every state (fp32 master weights, Adam moments, gradient
          buffers, the bf16 / fp16 weights) to pinned host memory and `reload_states()` brings them back.
        - "module": an inference-only engine (reference, reward model) below ZeRO-3: its weights are
          its only state, moved with `module.to("cpu")` and back.
        - "none": on CPU (the states already live in host memory), ZeRO-0 training (DeepSpeed has no
          state offload for a plain torch optimizer), train.adam_offload (the optimizer already runs
          on the CPU), ZeRO-3 with an optimizer other than DeepSpeed's FusedAdam (where its kernel
          did not build: DeepSpeed refuses), or an inference-only ZeRO-3 engine (DeepSpeed cannot
          move one without an optimizer).
        """
        if self.ds.backend == "fsdp2":
            return "none", "the FSDP2 backend has no state offload yet"
        if self.device.type != "cuda":
            return "none", "on CPU the DeepSpeed states already live in host memory"
        if self.trainable:
            if self.ds.zero_stage == 0:
                return "none", "ZeRO-0 has no DeepSpeed state offload (use train.zero_stage >= 1)"
            if self.ds.offload_optimizer:
                return "none", "the optimizer already runs on the CPU (train.adam_offload)"
            basic = type(getattr(self.engine.optimizer, "optimizer", None)).__name__
            if self.ds.zero_stage == 3 and basic != "FusedAdam":
                # DeepSpeed 0.19's ZeRO-3 offload_states asserts on any other optimizer
                return (
                    "none",
                    f"DeepSpeed offloads ZeRO-3 states only with its FusedAdam (this rank runs {basic})",
                )
            return "deepspeed", f"DeepSpeed offload_states (ZeRO-{self.ds.zero_stage})"
        if self.ds.zero_stage == 3:
            return "none", "DeepSpeed cannot move an inference-only ZeRO-3 engine"
        return "module", "the weights move to host memory"

    @property
    def offloaded(self) -> bool:
        """Whether `offload_states` moved the states off the GPU (until `reload_states`)."""
        return getattr(self, "_offloaded", False)

    def offload_states(self) -> bool:
        """Free this learner's GPU memory for colocated engines (see `offload_plan`); True when
        something moved. Forwards and training need `reload_states` first."""
        kind, _ = self.offload_plan()
        if kind == "none" or self.offloaded:
            return False
        if kind == "deepspeed":
            if not getattr(self, "_gc_frozen", False):
                # DeepSpeed's ZeRO-1/2 offload_states runs gc.collect() three times; over the
                # ~500k objects of a process holding transformers and a model that took 0.95 s per
                # offload at 100M parameters on an H100 (benchmarks/offload_states.py). The objects
                # alive now (libraries, model, engine) live as long as the learner: freeze them, so
                # that those passes visit only what was made since (0.03 s).
                gc.collect()
                gc.freeze()
                self._gc_frozen = True
            self.engine.offload_states()
        else:
            self.engine.module.to("cpu")
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        self._offloaded = True
        return True

    def reload_states(self) -> bool:
        """Undo `offload_states` (a no-op when nothing was offloaded); True when something moved."""
        if not self.offloaded:
            return False
        if self.offload_plan()[0] == "deepspeed":
            self.engine.reload_states()
        else:
            self.engine.module.to(self.device)
        torch.cuda.synchronize(self.device)
        self._offloaded = False
        return True

    # ----------------------------------------------------------------- helpers

    def _batches(self, micro_batches: Sequence[ExperienceBatch]) -> list[ExperienceBatch]:
        if self.offloaded:
            raise RuntimeError(
                f"{type(self).__name__}: the states are offloaded to host memory; call reload_states() first"
            )
        if isinstance(micro_batches, ExperienceBatch) or not isinstance(micro_batches, Sequence):
            raise TypeError(
                f"micro_batches must be a sequence of ExperienceBatch, got {type(micro_batches).__name__}"
            )
        for index, batch in enumerate(micro_batches):
            if not isinstance(batch, ExperienceBatch):
                raise TypeError(f"micro_batches[{index}] is a {type(batch).__name__}, not an ExperienceBatch")
        return [batch.to(self.device) for batch in micro_batches]

    def _check_group_batches(self, batches: Sequence[ExperienceBatch]) -> None:
        """ValueError on every rank when the ranks of some SP group were not given the same
        micro-batches (count, tokens, token ids): they would split different rows, or wait for each
        other forever. The group compares fingerprints; one world all-reduce then tells every rank."""
        shared = self._batch_group
        if shared is None:
            return
        group = shared.group
        fingerprint = torch.tensor(
            [
                len(batches),
                *(float(b.num_tokens) for b in batches),
                *(float(b.input_ids.double().sum()) for b in batches),
            ],
            dtype=torch.float64,
        )
        sizes = torch.tensor([fingerprint.numel(), -fingerprint.numel()], dtype=torch.float64)
        dist.all_reduce(sizes, op=dist.ReduceOp.MAX, group=group)
        same = bool(sizes[0] == -sizes[1])
        if same:
            extremes = torch.cat([fingerprint, -fingerprint])
            dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)
            same = bool(torch.equal(extremes[: fingerprint.numel()], -extremes[fingerprint.numel() :]))
        # world_size − rank: the maximum names the first rank whose group disagrees
        mismatched = torch.tensor([0.0 if same else float(self.world_size - self.rank)], dtype=torch.float64)
        dist.all_reduce(mismatched, op=dist.ReduceOp.MAX)
        if mismatched.item():
            rank = self.world_size - int(mismatched.item())
            raise ValueError(
                f"micro_batches: the {shared.size} ranks of rank {rank}'s {shared.kind} "
                f"group were given different micro-batches (this is rank {self.rank}); every rank of a group "
                f"must get the same ones (plan micro-batches over world_size / {shared.size} "
                "data-parallel groups)"
            )

    @torch.no_grad()
    def _inference(
        self, micro_batches: Sequence[ExperienceBatch], run: Callable[[ExperienceBatch], Any]
    ) -> list:
        was_training = self.engine.training
        self.engine.eval()
        batches = self._batches(micro_batches)
        self._check_group_batches(batches)
        try:
            return [run(batch) for batch in batches]
        finally:
            self.engine.train(was_training)

    def _agree(self, values: torch.Tensor, op: Any = None) -> torch.Tensor:
        values = values.to(self.device)
        if self.world_size > 1:
            dist.all_reduce(values, op=op or dist.ReduceOp.SUM)
        return values

    def _flags(self, local: tuple[int, str] | None, names: Sequence[str]) -> torch.Tensor:
        """This rank's row of the ranks' first-finding flags, float64 [world_size, 2]: (1 + the
        quantity's index in `names`, micro-batch) in row `rank` when `local` is set, zeros elsewhere."""
        flags = torch.zeros(self.world_size, 2, dtype=torch.float64)
        if local is not None:
            flags[self.rank] = torch.tensor([names.index(local[1]) + 1, local[0]], dtype=torch.float64)
        return flags

    def _decode_flags(self, flags: torch.Tensor, names: Sequence[str]) -> list[tuple[int, int, str]]:
        """[(rank, micro-batch, quantity)] from the all-reduced flags ([world_size · 2] or [world_size, 2])."""
        flags = flags.reshape(self.world_size, 2)
        return [
            (rank, int(flags[rank, 1]), names[int(flags[rank, 0]) - 1])
            for rank in range(self.world_size)
            if flags[rank, 0] > 0
        ]

    def _problems(self, local: tuple[int, str] | None, names: Sequence[str]) -> list[tuple[int, int, str]]:
        """All ranks' first non-finite finding: [(rank, micro-batch, quantity)], the same on every rank."""
        return self._decode_flags(self._agree(self._flags(local, names)).cpu(), names)

    def _grad_norm_zero0(self) -> float:
        """Global gradient 2-norm of a ZeRO-0 fp32 engine (gradients are all-reduced: same on all ranks)."""
        grads = [p.grad.detach().float() for p in self.module.parameters() if p.grad is not None]
        if not grads:
            return 0.0
        return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))

    def _optimizer_step(self) -> None:
        with self._compiler_stance():
            self.engine.step()

    def _compiler_stance(self) -> contextlib.AbstractContextManager:
        """What the backward pass and the optimizer step run under: DeepSpeed's Muon on a CPU
        learner runs eager (`torch.compiler.set_stance("force_eager")`), else torch's own stance.

        DeepSpeed torch.compiles Muon's Newton–Schulz iteration (`muon_update`: in the backward
        pass's gradient reduction at ZeRO 1-2, in the step otherwise). On CPU that is inductor's
        C++ path: its instruction-set probe in child Pythons and, where the compile cache is empty
        (a fresh machine, a user's first run), C++ builds with a 150 MB precompiled header, ~25
        CPU-seconds on 2 cores before the first step, then a trace in every new process. Eager runs
        the same operations without a compiler; on CUDA DeepSpeed compiles as it chooses. A torch
        without `set_stance` (before 2.6) compiles as before.
        """
        set_stance = getattr(torch.compiler, "set_stance", None)
        if self.device.type == "cpu" and self.optim is not None and self.optim.name == "muon" and set_stance:
            return set_stance("force_eager")
        return contextlib.nullcontext()

    def _uses_basic_optimizer(self) -> bool:
        """ZeRO-0 in fp32: DeepSpeed steps the client optimizer without any overflow check."""
        return self.ds.backend == "deepspeed" and self.ds.zero_stage == 0 and self.ds.dtype == "fp32"

    def _train_step(
        self,
        micro_batches: Sequence[ExperienceBatch],
        *,
        mode: str,
        inputs: Sequence[str],
        forward_loss: Callable[[ExperienceBatch, torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]],
        dummy_loss: Callable[[], tuple[torch.Tensor, dict[str, torch.Tensor]]],
    ) -> dict[str, float]:
        """The shared optimizer step (module docstring).

        `forward_loss(batch, normalizer)` returns (loss, metrics) for a non-empty micro-batch:
        the metrics are either token means ("name"), maxima ("name" ending in "_max") or sums
        ("name" starting with "loss" — already globally normalised). `dummy_loss()` runs the
        one-token forward of an empty micro-batch and returns (0-valued loss, zero metrics with
        the same names).
        """
        if not self.trainable:
            raise RuntimeError(
                f"{type(self).__name__} was built with optimizer=None (inference only); cannot train"
            )
        batches = self._batches(micro_batches)
        if not batches:
            raise ValueError(
                "micro_batches is empty; every rank needs at least one (possibly empty) micro-batch"
            )
        self._check_group_batches(batches)
        missing = [f"missing {name}" for name in inputs]
        names = [*inputs, "loss", "gradient norm", *missing]

        # Inputs and the global normaliser, before any forward. A usage error is shared through
        # the same all-reduce, so that every rank raises instead of one waiting for the others.
        local = StepCounts(micro_batches=float(len(batches)), micro_batches_squared=float(len(batches) ** 2))
        problem: tuple[int, str] | None = None
        for index, batch in enumerate(batches):
            if batch.num_sequences == 0:
                continue
            for name in inputs:
                value = getattr(batch, name)
                if value is None:
                    problem = (index, f"missing {name}")
                    break
                if problem is None and not bool(torch.isfinite(value).all()):
                    problem = (index, name)
            if problem is not None and problem[1] in missing:
                break
            if not self.counts_for_group:
                continue
            mask = batch.response_action_mask()
            local.normalizer += float(loss_normalizer(mask, mode))
            local.action_tokens += batch.num_actions
            local.sequences += batch.num_sequences
            local.tokens += batch.num_tokens
            sharing = shared_prefix(batch) if self.ds.shares_prefix else None
            local.shared_prefix_tokens += sharing.saved_tokens if sharing is not None else 0
        local_counts = local.to_tensor()
        agreed = self._agree(torch.cat([local_counts, self._flags(problem, names).flatten()])).cpu()
        totals = StepCounts.from_tensor(agreed[: len(local_counts)])
        normalizer = max(totals.normalizer, 1.0)
        if not totals.uniform_micro_batches(self.world_size):  # else ZeRO's collectives would hang
            raise ValueError(
                f"micro_batches: rank {self.rank} has {len(batches)} micro-batches but the ranks do not all "
                f"have the same number ({int(totals.micro_batches)} in all over {self.world_size} ranks); "
                "every rank must run the same number of micro-batches (rl_data.plan_micro_batches gives "
                "each rank the same count)"
            )
        problems = self._decode_flags(agreed[len(local_counts) :], names)
        for rank, micro, quantity in problems:
            if quantity in missing:
                slot = quantity.removeprefix("missing ")
                raise ValueError(
                    f"micro_batches[{micro}].{slot} is None on rank {rank} (this is rank {self.rank}); "
                    "fill it before train_step"
                )
        lr = self.lr
        base = {
            "tokens": totals.action_tokens,
            "sequences": totals.sequences,
            "shared_tokens_frac": totals.shared_prefix_tokens / max(totals.tokens, 1.0),
            "lr": lr,
        }
        if problems:
            return self._non_finite(problems, base)

        self.engine.train()
        last = len(batches) - 1
        sums: dict[str, float] = {}
        maxima: dict[str, float] = {}
        problem = None
        for index, batch in enumerate(batches):
            self.engine.set_gradient_accumulation_boundary(index == last)
            if batch.num_sequences == 0:
                loss, metrics = dummy_loss()
                weight = 0.0
            else:
                loss, metrics = forward_loss(batch, torch.tensor(normalizer, device=self.device))
                weight = float(batch.num_actions)
            if problem is None and not bool(torch.isfinite(loss.detach())):
                problem = (index, "loss")
            share = 1.0 if self.counts_for_group else 0.0  # an SP group's metrics count once
            for key, value in metrics.items():
                value = float(value) * share
                if key.endswith("_max"):
                    maxima[key] = max(maxima.get(key, -math.inf), value if weight else -math.inf)
                elif key.startswith("loss"):
                    sums[key] = sums.get(key, 0.0) + value
                else:
                    sums[key] = sums.get(key, 0.0) + value * weight
            if index == last:
                problems = self._problems(problem, names)
                if problems and not self._uses_basic_optimizer():
                    # Make every gradient NaN so that DeepSpeed's overflow path drops the update
                    # and clears its gradient buffers on every rank.
                    loss = loss * float("nan")
            with self._compiler_stance():
                self.engine.backward(loss * self.gradient_ranks, scale_wrt_gas=False)

        if problems:
            if self._uses_basic_optimizer():
                self.engine.zero_grad()
            else:
                self._optimizer_step()
            return self._non_finite(problems, base)
        if self._uses_basic_optimizer():
            grad_norm = self._grad_norm_zero0()
            if not math.isfinite(grad_norm):
                self.engine.zero_grad()
                return self._non_finite([(self.rank, last, "gradient norm")], base)
            self._optimizer_step()
        else:
            self._optimizer_step()
            if not self.engine.was_step_applied():
                return self._non_finite([(self.rank, last, "gradient norm")], base)
            norm = self.engine.get_global_grad_norm()
            grad_norm = float(norm) if norm is not None else float("nan")

        keys = sorted(sums)
        reduced = self._agree(torch.tensor([sums[k] for k in keys], dtype=torch.float64)).cpu().tolist()
        max_keys = sorted(maxima)
        reduced_max = (
            self._agree(torch.tensor([maxima[k] for k in max_keys], dtype=torch.float64), dist.ReduceOp.MAX)
            .cpu()
            .tolist()
        )
        tokens = max(totals.action_tokens, 1.0)
        out = dict(base)
        for key, value in zip(keys, reduced, strict=True):
            out[key] = value if key.startswith("loss") else value / tokens
        for key, value in zip(max_keys, reduced_max, strict=True):
            out[key] = value if math.isfinite(value) else 0.0
        out.update(grad_norm=grad_norm, skipped=0.0)
        return out

    def _non_finite(self, problems: list[tuple[int, int, str]], base: dict[str, float]) -> dict[str, float]:
        rank, micro, quantity = problems[0]
        if self.on_non_finite == "raise":
            raise NonFiniteError(
                f"non-finite {quantity} in micro-batch {micro} on rank {rank} (this is rank {self.rank}); "
                f"the update was not applied"
            )
        return {**base, "skipped": 1.0, "grad_norm": float("nan")}


# --------------------------------------------------------------------------- policy


class PolicyLearner(Learner):
    """Actor (with an optimizer) or reference model (`optimizer=None`): log-probs and policy updates."""

    fsdp2_ready = True

    def logprobs(
        self,
        micro_batches: Sequence[ExperienceBatch],
        *,
        temperature: float = 1.0,
        with_entropy: bool = False,
        only_actions: bool = False,
        router_replay: str = "disabled",
    ) -> list[torch.Tensor] | list[tuple[torch.Tensor, torch.Tensor]]:
        """Log-probs [N_i] (float32, on `self.device`, no grad) of every micro-batch, in the
        `ExperienceBatch` convention; with `with_entropy`, (logprobs, entropy) pairs; with
        `only_actions`, computed at action tokens only and 0 elsewhere (`packed_logprobs`); with
        `router_replay` "R3", the batches' `routed_experts` replayed (`PolicyLossConfig.router_replay`).
        Every rank must call this with the same number of micro-batches when ZeRO-3 shards the weights."""
        _choice("PolicyLearner.logprobs", "router_replay", router_replay, ROUTER_REPLAY_MODES)
        routing = self.moe_routing(replay=True) if router_replay == "R3" else None

        def run(batch: ExperienceBatch) -> Any:
            out = packed_logprobs(
                self.engine,
                batch,
                temperature=temperature,
                with_entropy=with_entropy,
                only_actions=only_actions,
                share_prefix=self.ds.shares_prefix,
                sequence_parallel=self.sequence_parallel,
                routing=routing,
            )
            return tuple(t.float() for t in out) if with_entropy else out.float()

        with routing if routing is not None else contextlib.nullcontext():
            return self._inference(micro_batches, run)

    def moe_routing(self, *, replay: bool) -> MoERouting | None:
        """Hooks on the policy's MoE routers (`rl_learner.routing.MoERouting`), or None for a dense
        model or one whose router the hooks do not read (only recording). With `replay`, ValueError
        naming `router_replay` for a model that cannot replay."""
        module = self.module
        config = getattr(module, "config", None)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        if replay:
            try:
                return MoERouting(module, replay=True)
            except ValueError as error:
                raise ValueError(f"PolicyLossConfig.router_replay R3: {error}") from None
        if getattr(text, "model_type", None) not in REPLAYABLE_MODEL_TYPES:
            return None
        return MoERouting(module, replay=False)

    def _empty_batch_logits(self) -> torch.Tensor:
        """The model's logits for an empty micro-batch: a rank with fewer micro-batches than the
        others runs this so that its forward and backward still join ZeRO's and the SP group's
        collectives (the caller multiplies by 0 to get a loss with no gradient)."""
        inputs = packed_model_inputs(
            self.engine, ExperienceBatch.empty(), sequence_parallel=self.sequence_parallel
        )
        return self.engine(**inputs).logits

    def train_step(
        self, micro_batches: Sequence[ExperienceBatch], loss: PolicyLossConfig
    ) -> dict[str, float]:
        """One optimizer step over this rank's micro-batches (module docstring), minimising
        `rl_algos.policy_objective` with `loss`'s settings and the correction's weights.

        Each micro-batch needs `advantages` and `old_logprobs` (`rollout_logprobs` instead with
        `loss.old_logprobs_from_forward`); `ref_logprobs` when `loss.kl_coef > 0`;
        `teacher_logprobs` when `loss.distill_coef > 0`;
        `rollout_logprobs` when `loss.correction != "none"`.

        Returns metrics, equal on every rank: loss (the full-batch loss), loss_policy, loss_kl,
        loss_entropy, the policy loss's own metrics (ppo_kl, clip_fraction, ...) as token-weighted
        means, entropy (mean over action tokens), kl (mean k-estimate, when kl_coef > 0),
        loss_distill and distill_kl (the teacher term, when distill_coef > 0),
        mismatch metrics (with a correction), aux_loss (the MoE load-balancing loss, token-weighted
        mean over micro-batches) and loss_aux (its term c·L_aux in loss) when aux_loss_coef > 0, grad_norm, lr (of this update), tokens, sequences,
        shared_tokens_frac (of the micro-batches' tokens, those the model did not run because
        their prefix was shared), skipped (0 or 1).
        """
        if not isinstance(loss, PolicyLossConfig):
            raise TypeError(f"loss must be a PolicyLossConfig, got {type(loss).__name__}")
        inputs = ["advantages", "old_logprobs"]
        if loss.old_logprobs_from_forward:
            _check_no_dropout(self.engine)
            inputs = ["advantages", "rollout_logprobs"]
        if loss.kl_coef > 0:
            inputs.append("ref_logprobs")
        if loss.distill_coef > 0:
            inputs.append("teacher_logprobs")
        if loss.correction != "none" and "rollout_logprobs" not in inputs:
            inputs.append("rollout_logprobs")
        if loss.router_replay == "R3":
            inputs.append("routed_experts")
        routing = self.moe_routing(replay=loss.router_replay == "R3")

        def terms(logprobs, entropy, old, advantages, mask, ref, teacher, rollout, normalizer):
            weights, metrics = None, {}
            if loss.correction != "none":
                weights, metrics = CORRECTIONS[loss.correction](old, rollout, mask, **loss.correction_options)
            total, objective_metrics = policy_objective(
                logprobs,
                old,
                advantages,
                mask,
                loss=loss.name,
                loss_options=loss.options,
                aggregation=loss.aggregation,
                normalizer=normalizer,
                horizon=loss.horizon,
                importance_weights=weights,
                ref_logprobs=ref,
                kl_coef=loss.kl_coef,
                kl_estimator=loss.kl_estimator,
                kl_options=loss.kl_options,
                teacher_logprobs=teacher,
                distill_coef=loss.distill_coef,
                distill_estimator=loss.distill_estimator,
                entropy=entropy,
                entropy_coef=loss.entropy_coef,
            )
            return total, {**objective_metrics, **metrics}

        routers = None
        if loss.aux_loss_coef > 0:
            if self.sequence_parallel is not None:
                raise ValueError(
                    "PolicyLossConfig.aux_loss_coef: the MoE load-balancing loss is not supported with "
                    f"sequence_parallel_size {self.sequence_parallel.size} (each rank's routers see only its "
                    "slice of the tokens); set aux_loss_coef 0 or sequence_parallel_size 1"
                )
            routers = RouterCapture(self.engine)
            # A: the step's action tokens, the weight of each micro-batch's aux loss (all ranks)
            local = sum(float(batch.num_actions) for batch in micro_batches)
            step_actions = max(float(self._agree(torch.tensor([local], dtype=torch.float64))[0]), 1.0)

        def forward_loss(batch: ExperienceBatch, normalizer: torch.Tensor):
            # the objective reads action tokens only: no LM head / log-softmax at the others
            with routers if routers is not None else contextlib.nullcontext():
                logprobs, entropy = packed_logprobs(
                    self.engine,
                    batch,
                    temperature=loss.temperature,
                    with_entropy=True,
                    only_actions=True,
                    share_prefix=self.ds.shares_prefix,
                    sequence_parallel=self.sequence_parallel,
                    routing=routing,
                )
            view = batch.response_view
            ref = view(batch.ref_logprobs) if loss.kl_coef > 0 else None
            teacher = view(batch.teacher_logprobs) if loss.distill_coef > 0 else None
            rollout = view(batch.rollout_logprobs) if loss.correction != "none" else None
            old = view(logprobs).detach() if loss.old_logprobs_from_forward else view(batch.old_logprobs)
            total, metrics = terms(
                view(logprobs),
                view(entropy),
                old,
                view(batch.advantages),
                batch.response_action_mask(),
                ref,
                teacher,
                rollout,
                normalizer,
            )
            if loss.old_logprobs_from_forward:
                mask = batch.response_action_mask()
                gap = (old - view(batch.rollout_logprobs)).abs()
                metrics["logprob_mismatch_mean"] = _token_mean(gap, mask)
                metrics["logprob_mismatch_max"] = torch.where(mask, gap, 0.0).max()
            if routers is not None:
                aux = load_balancing_loss(routers.logits, routers.top_k)
                term = loss.aux_loss_coef * aux * (batch.num_actions / step_actions)
                total = total + term.to(total.dtype)
                metrics["aux_loss"] = aux.detach()
                metrics["loss_aux"] = term.detach()
                metrics["loss"] = metrics["loss"] + term.detach()  # the full loss, as minimised
            if routing is not None:
                metrics |= routing_metrics(routing)
            return total, metrics

        def dummy_loss():
            if routing is not None:
                routing.load(None)
            logits = self._empty_batch_logits()
            zero = torch.zeros(1, 1, device=self.device)
            with torch.no_grad():
                _, metrics = terms(
                    zero,
                    zero,
                    zero,
                    zero,
                    torch.zeros(1, 1, dtype=torch.bool, device=self.device),
                    zero,
                    zero,
                    zero,
                    torch.tensor(1.0, device=self.device),
                )
            if loss.old_logprobs_from_forward:  # the same metric keys on every rank
                metrics |= dict.fromkeys(("logprob_mismatch_mean", "logprob_mismatch_max"), 0.0)
            if routers is not None:
                metrics |= dict.fromkeys(("aux_loss", "loss_aux"), 0.0)
            if routing is not None:
                metrics |= dict.fromkeys(routing_metric_keys(routing.num_layers), 0.0)
            return logits.float().sum() * 0.0, {k: torch.zeros(()) for k in metrics}

        with routing if routing is not None else contextlib.nullcontext():
            return self._train_step(
                micro_batches,
                mode=loss.aggregation,
                inputs=inputs,
                forward_loss=forward_loss,
                dummy_loss=dummy_loss,
            )


def _check_no_dropout(model: torch.nn.Module) -> None:
    """ValueError when `model` drops activations in training mode (dropout modules or config rates)."""
    module = unwrap_model(model)
    rates = {
        name: module.p for name, module in module.named_modules() if isinstance(module, torch.nn.Dropout)
    }
    config = getattr(module, "config", None)
    if config is not None:
        rates |= {
            f"config.{key}": value
            for key, value in config.to_dict().items()
            if (key.endswith("dropout") or key.endswith("pdrop")) and isinstance(value, float)
        }
    active = {name: rate for name, rate in rates.items() if rate > 0}
    if active:
        raise ValueError(
            "PolicyLossConfig.old_logprobs_from_forward: the model has dropout "
            f"({', '.join(f'{k}={v:g}' for k, v in sorted(active.items())[:3])}), so its training forward "
            "is not the forward that would score the batch; compute old_logprobs separately"
        )


def _token_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask = mask.to(values.dtype)
    return (torch.where(mask > 0, values, 0.0) * mask).sum() / mask.sum().clamp(min=1)


# --------------------------------------------------------------------------- value


class ValueLearner(Learner):
    """Critic (with an optimizer) or reward model (`optimizer=None`): values, scores and value updates."""

    fsdp2_ready = True

    def values(self, micro_batches: Sequence[ExperienceBatch]) -> list[torch.Tensor]:
        """Values [N_i] (float32, no grad): values[t] = V(tokens before t), 0 at sequence starts."""
        return self._inference(
            micro_batches,
            lambda batch: packed_values(
                self.engine,
                batch,
                share_prefix=self.ds.shares_prefix,
                sequence_parallel=self.sequence_parallel,
            ).float(),
        )

    def scores(self, micro_batches: Sequence[ExperienceBatch]) -> list[torch.Tensor]:
        """Reward-model scores [S_i] (float32, no grad): the score head at each sequence's last token."""
        return self._inference(
            micro_batches,
            lambda batch: packed_scores(
                self.engine,
                batch,
                share_prefix=self.ds.shares_prefix,
                sequence_parallel=self.sequence_parallel,
            ).float(),
        )

    def train_step(self, micro_batches: Sequence[ExperienceBatch], loss: ValueLossConfig) -> dict[str, float]:
        """One critic update with the clipped value loss; micro-batches need `values` (the old
        values) and `returns`. Metrics: loss, value_mean, value_clip_fraction, grad_norm, lr,
        tokens, sequences, shared_tokens_frac, skipped."""
        if not isinstance(loss, ValueLossConfig):
            raise TypeError(f"loss must be a ValueLossConfig, got {type(loss).__name__}")

        def terms(values, old, returns, mask, normalizer):
            per_token, metrics = value_loss(values, old, returns, mask, clip_range=loss.clip_range)
            total = aggregate_loss(
                per_token, mask, loss.aggregation, normalizer=normalizer, horizon=loss.horizon
            )
            return total, {**metrics, "loss": total.detach()}

        def forward_loss(batch: ExperienceBatch, normalizer: torch.Tensor):
            view = batch.response_view
            values = packed_values(
                self.engine,
                batch,
                share_prefix=self.ds.shares_prefix,
                sequence_parallel=self.sequence_parallel,
            )
            return terms(
                view(values),
                view(batch.values),
                view(batch.returns),
                batch.response_action_mask(),
                normalizer,
            )

        def dummy_loss():
            values = packed_values(
                self.engine, ExperienceBatch.empty(), sequence_parallel=self.sequence_parallel
            )
            zero = torch.zeros(1, 1, device=self.device)
            with torch.no_grad():
                _, metrics = terms(
                    zero,
                    zero,
                    zero,
                    torch.zeros(1, 1, dtype=torch.bool, device=self.device),
                    torch.tensor(1.0, device=self.device),
                )
            return values.sum() * 0.0, {k: torch.zeros(()) for k in metrics}

        return self._train_step(
            micro_batches,
            mode=loss.aggregation,
            inputs=["values", "returns"],
            forward_loss=forward_loss,
            dummy_loss=dummy_loss,
        )
