"""Corrections for the mismatch between the rollout engine's log-probs and the learner's.

vLLM and the training framework compute log π_old differently (kernels, precision, batch
shapes), so the samples are slightly off-policy even for the "same" weights. With
Δ_t = log π_old − log π_rollout, the token importance weight w_t = exp(Δ_t) (detached), and
p_t = π_rollout(a_t), q_t = π_old(a_t) (clamped to [1e-6, 1 − 1e-6]), `rollout_correction`
returns per-token weights to multiply the policy loss by before aggregating. Three knobs:

  level   which unit is gated, and its ratio u:
            "token"      u_t = w_t
            "sequence"   u_i = exp(Σ_t m·Δ_t), the product of the sequence's token weights
            "geometric"  u_i = exp(Σ_t m·Δ_t / L_i), their geometric mean (length-invariant)
  gating  the statistic compared with the bounds:
            "ratio"      u itself, kept if low ≤ u ≤ high
            "binary_kl"  p·log(p/q) + (1 − p)·log((1 − p)/(1 − q)) per token (mean over the
                         sequence at level "sequence"), kept if ≤ high (low must be 0)
            "tv"         |p − q| per token (mean at level "sequence"), kept if ≤ high (low 0)
  mode    what happens:
            "truncate"   weight = clip(u, low, high)  (TIS; ratio gating only)
            "mask"       weight = 0 on units outside the bounds; survivors keep `mask_weight`:
                         "token" (w_t: OpenRLHF), "level" (u: verl, ICEPOP) or "one" (a pure
                         filter: Geo-Mask)
            "none"       weight = 1 (then only `sequence_mask_range` applies, or the metrics)

A divergence gate bounds from above only: a unit is dropped when its statistic exceeds `high`.
The binary KL is ≥ 0 in exact arithmetic, but in float32 a near-zero one can round below 0
(log π_rollout = −0.5, log π_old = −0.5000003 gives −4.3e-8); such a token is kept here.
OpenRLHF 0.11.2 keeps a unit only if low ≤ statistic ≤ high (with low = 0), so it drops that
token, a difference confined to tokens whose two log-probs agree to a few ulps.

The legacy `method` names map onto these: "tis" = truncate; "icepop" = mask with the level's
own weight; "none" = none. Independently, `sequence_mask_range=(lo, hi)` multiplies the weights
by [lo ≤ exp(Σ_t m·Δ_t / L_i) ≤ hi] (drop whole sequences by their geometric-mean ratio).

Recipes (weights in words):
  TIS (OpenRLHF default [0.5, 5.0])   method="tis"                         clip(w_t)
  ICEPOP                              method="icepop"                      w_t or 0
  seq-mask (Geo-Mask)                 mode="mask", level="geometric", mask_weight="one"    1 or 0
  seq-mask-tis (OpenRLHF)             mode="mask", level="geometric", mask_weight="token"  w_t or 0
  trust region on the rollout         mode="mask", gating="binary_kl", low=0, high=δ        w_t or 0

`CORRECTIONS` names the corrections a trainer picks by name (rl-learner's
`PolicyLossConfig.correction`, rl-launch's `algo.policy.correction`), each a thin wrapper over
`rollout_correction` whose keyword options are passed verbatim from the config:

  name                 options (defaults)                          weights
  "tis" ("truncate")   level="token", low=0.5, high=5.0            clip(u, low, high)
  "icepop"             level="token", gating="ratio", low, high    u or 0
  "mask"               level="token", gating="ratio", low, high    w_t or 0
  "seq-mask"           low=0.5, high=5.0                           1 or 0 per sequence
  "seq-mask-tis"       low=0.5, high=5.0                           w_t or 0 per sequence

An entry is `(old_logprobs, rollout_logprobs, action_mask, *, <options>) -> (weights, metrics)`
with `[batch, seq]` float32 detached weights; register your own with
`@CORRECTIONS.register("my_correction")`.
"""

from __future__ import annotations

import torch

from ._checks import check_choice, check_floating, check_ndim, check_positive, check_same_shape, mask_as
from .masked import masked_mean
from .registry import Registry

__all__ = [
    "CORRECTIONS",
    "CORRECTION_GATINGS",
    "CORRECTION_LEVELS",
    "CORRECTION_METHODS",
    "CORRECTION_MODES",
    "MASK_WEIGHTS",
    "mismatch_metrics",
    "rollout_correction",
]

CORRECTION_METHODS = ("tis", "icepop", "none")
CORRECTION_MODES = ("truncate", "mask", "none")
CORRECTION_LEVELS = ("token", "sequence", "geometric")
CORRECTION_GATINGS = ("ratio", "binary_kl", "tv")
MASK_WEIGHTS = ("token", "level", "one")

CORRECTIONS = Registry("rollout correction")
"""Rollout/learner mismatch corrections by name (module docstring): name -> `(old_logprobs,
rollout_logprobs, action_mask, *, **options) -> (weights [batch, seq], metrics)`."""

_LOG_CLAMP = 20.0
_PROB_CLAMP = 1e-6


def _prepare(
    old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, action_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    check_ndim("old_logprobs", old_logprobs, 2, "[batch, seq]")
    check_floating("old_logprobs", old_logprobs)
    check_same_shape("rollout_logprobs", rollout_logprobs, "old_logprobs", old_logprobs)
    mask = mask_as("action_mask", action_mask, old_logprobs, "old_logprobs").float()
    delta = (old_logprobs.detach().float() - rollout_logprobs.detach().float()) * mask
    return delta, mask


def _check_range(name: str, bounds: tuple[float, float]) -> tuple[float, float]:
    low, high = bounds
    check_positive(f"{name}[0] (low)", low)
    if not high > low:
        raise ValueError(f"{name} must satisfy 0 < low < high, got ({low}, {high})")
    return float(low), float(high)


def mismatch_metrics(
    old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, action_mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Health metrics of the rollout/learner log-prob mismatch over the action tokens.

    Returns detached 0-d tensors:
      mismatch_abs_mean, mismatch_abs_max: mean and max |Δ_t|;
      mismatch_k3: mean of exp(Δ) − 1 − Δ, a non-negative estimate of KL(π_rollout ‖ π_old);
      mismatch_ess: effective sample size of the token weights as a fraction,
        (Σ w)² / (N·Σ w²) in (0, 1]; 1 means no mismatch.
    """
    delta, mask = _prepare(old_logprobs, rollout_logprobs, action_mask)
    count = mask.sum().clamp(min=1)
    abs_delta = delta.abs()
    clamped = delta.clamp(-_LOG_CLAMP, _LOG_CLAMP)
    weights = clamped.exp() * mask
    k3 = (torch.expm1(clamped) - clamped) * mask
    return {
        "mismatch_abs_mean": abs_delta.sum() / count,
        "mismatch_abs_max": abs_delta.max() if abs_delta.numel() else abs_delta.new_zeros(()),
        "mismatch_k3": k3.sum() / count,
        "mismatch_ess": weights.sum().square() / (count * weights.square().sum()).clamp(min=1e-30),
    }


def rollout_correction(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    method: str | None = None,
    mode: str | None = None,
    level: str = "token",
    gating: str = "ratio",
    low: float = 0.5,
    high: float = 5.0,
    mask_weight: str | None = None,
    sequence_mask_range: tuple[float, float] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Importance weights that correct for the rollout/learner mismatch (module docstring).

    Worked values, one sequence, Δ = [log 2, log 8, log 0.25], bounds (0.5, 5):
      truncate, token             [2, 5, 0.5]
      mask, token                 [2, 0, 0]
      mask, geometric ("token")   u = exp(mean Δ) = 4^{1/3} = 1.587, kept → [2, 8, 0.25]
      mask, geometric ("one")     [1, 1, 1]
      truncate, sequence          u = 4 → [4, 4, 4]

    Args:
      old_logprobs: `[batch, seq]` learner log-probs of the sampled tokens before the update.
      rollout_logprobs: `[batch, seq]` log-probs the rollout engine reported for them.
      action_mask: `[batch, seq]`.
      method: legacy name, one of `CORRECTION_METHODS` ("tis" = mode "truncate", "icepop" =
        mode "mask" with mask_weight "level"); give `method` or `mode`, not both.
      mode: one of `CORRECTION_MODES`; None with no `method` means "truncate".
      level: one of `CORRECTION_LEVELS`.
      gating: one of `CORRECTION_GATINGS` (divergences: mode "mask", level token or sequence).
      low, high: the bounds; 0 < low < high for ratio gating, low = 0 < high for divergences.
      mask_weight: what mode "mask" keeps, one of `MASK_WEIGHTS`; None means "token" (for
        method "icepop": "level").
      sequence_mask_range: optional (lo, hi) range for the geometric-mean sequence mask.

    Returns:
      (weights `[batch, seq]` float32, detached, 0 off the action tokens and on dropped tokens,
       metrics: `mismatch_metrics` plus the fraction of action tokens clipped or masked).
    """
    if method is not None and mode is not None:
        raise ValueError(f"give method (legacy) or mode, not both; got method={method!r}, mode={mode!r}")
    if method is not None:
        check_choice("method", method, CORRECTION_METHODS)
        mode = {"tis": "truncate", "icepop": "mask", "none": "none"}[method]
        if mask_weight is None and method == "icepop":
            mask_weight = "level"
    mode = "truncate" if mode is None else mode
    check_choice("mode", mode, CORRECTION_MODES)
    check_choice("level", level, CORRECTION_LEVELS)
    check_choice("gating", gating, CORRECTION_GATINGS)
    mask_weight = "token" if mask_weight is None else mask_weight
    check_choice("mask_weight", mask_weight, MASK_WEIGHTS)
    divergence = gating != "ratio"
    if divergence:
        if mode != "mask":
            raise ValueError(f"gating={gating!r} is a filter: it needs mode='mask', got mode={mode!r}")
        if level == "geometric":
            raise ValueError(
                f"level='geometric' is a ratio level; with gating={gating!r} use level='token' or "
                "'sequence' (the per-sequence mean divergence)"
            )
        if low != 0 or not high > 0:
            raise ValueError(
                f"gating={gating!r} takes an upper bound only: pass low=0 and high=δ > 0, got ({low}, {high})"
            )
    else:
        low, high = _check_range("(low, high)", (low, high))
    delta, mask = _prepare(old_logprobs, rollout_logprobs, action_mask)
    metrics = mismatch_metrics(old_logprobs, rollout_logprobs, action_mask)
    lengths = mask.sum(-1, keepdim=True).clamp(min=1)

    token_weight = delta.clamp(-_LOG_CLAMP, _LOG_CLAMP).exp()
    if level == "token":
        log_unit = delta
    elif level == "sequence":
        log_unit = delta.sum(-1, keepdim=True).expand_as(delta)
    else:
        log_unit = (delta.sum(-1, keepdim=True) / lengths).expand_as(delta)
    unit_weight = log_unit.clamp(-_LOG_CLAMP, _LOG_CLAMP).exp()

    if divergence:
        p = rollout_logprobs.detach().float().exp().clamp(_PROB_CLAMP, 1 - _PROB_CLAMP)
        q = old_logprobs.detach().float().exp().clamp(_PROB_CLAMP, 1 - _PROB_CLAMP)
        if gating == "binary_kl":
            statistic = p * (p / q).log() + (1 - p) * ((1 - p) / (1 - q)).log()
        else:
            statistic = (p - q).abs()
        statistic = statistic * mask
        if level == "sequence":
            statistic = (statistic.sum(-1, keepdim=True) / lengths).expand_as(delta)
        outside = statistic > high
        metrics[f"mismatch_{gating}"] = masked_mean(statistic, mask)
    else:
        outside = (unit_weight < low) | (unit_weight > high)

    if mode == "truncate":
        weights = unit_weight.clamp(low, high)
        metrics["correction_clip_fraction"] = masked_mean(outside.float(), mask)
    elif mode == "mask":
        kept = {"token": token_weight, "level": unit_weight, "one": torch.ones_like(unit_weight)}[mask_weight]
        weights = torch.where(outside, torch.zeros_like(kept), kept)
        metrics["correction_mask_fraction"] = masked_mean(outside.float(), mask)
    else:
        weights = torch.ones_like(unit_weight)

    if sequence_mask_range is not None:
        lo, hi = _check_range("sequence_mask_range", sequence_mask_range)
        geometric = (delta.sum(-1, keepdim=True) / lengths).exp()
        keep = (geometric >= lo) & (geometric <= hi)
        weights = weights * keep
        has_tokens = mask.sum(-1) > 0
        dropped = (~keep.squeeze(-1)) & has_tokens
        metrics["sequence_mask_fraction"] = dropped.float().sum() / has_tokens.float().sum().clamp(min=1)
    return (weights * mask).detach(), metrics


# --------------------------------------------------------------------------------------------
# The named corrections. Worked values: one sequence, Δ = [log 2, log 8, log 0.25] (token
# weights w = [2, 8, 0.25], geometric mean 4^{1/3} = 1.587, product 4), bounds (0.5, 5).


@CORRECTIONS.register("tis", aliases=("truncate",))
def truncated_importance_sampling(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    level: str = "token",
    low: float = 0.5,
    high: float = 5.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Truncated importance sampling: weight = clip(u, low, high), u the `level`'s ratio.

    Worked values: level "token" → [2, 5, 0.5]; level "sequence" (u = 4) → [4, 4, 4].
    OpenRLHF: `--vllm_is_correction_type tis` / 0.11's mode "truncate"; verl: rollout_is at
    level token / sequence (truncated importance weights). Options: `level` (one of `CORRECTION_LEVELS`), 0 < low < high.
    Returns `rollout_correction`'s (weights, metrics), with correction_clip_fraction.
    """
    return rollout_correction(
        old_logprobs, rollout_logprobs, action_mask, mode="truncate", level=level, low=low, high=high
    )


@CORRECTIONS.register("icepop")
def icepop(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    level: str = "token",
    gating: str = "ratio",
    low: float = 0.5,
    high: float = 5.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """ICEPOP: weight = u on units whose statistic is inside the bounds, 0 outside (u = the
    `level`'s ratio, so the survivors keep the level's own weight).

    Worked values: level "token" → [2, 0, 0]; level "geometric" (u = 1.587, kept) → [1.587] * 3.
    OpenRLHF: `--vllm_is_correction_type icepop`; verl: rejection sampling (rollout_rs) at the
    level, survivors weighted by the level's own ratio.
    Options: `level`, `gating` (`CORRECTION_GATINGS`; a divergence takes low=0, high=δ), low, high.
    """
    return rollout_correction(
        old_logprobs,
        rollout_logprobs,
        action_mask,
        mode="mask",
        level=level,
        gating=gating,
        low=low,
        high=high,
        mask_weight="level",
    )


@CORRECTIONS.register("mask")
def token_weight_mask(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    level: str = "token",
    gating: str = "ratio",
    low: float = 0.5,
    high: float = 5.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """OpenRLHF 0.11.2's mode "mask": weight = w_t = exp(Δ_t) on units whose statistic (the
    `level`'s ratio, or a `gating` divergence) is inside the bounds, 0 outside.

    Worked values: level "token" → [2, 0, 0]; level "geometric" (1.587, kept) → [2, 8, 0.25].
    Options: `level`, `gating` (a divergence "binary_kl" / "tv" takes low=0, high=δ), low, high.
    """
    return rollout_correction(
        old_logprobs,
        rollout_logprobs,
        action_mask,
        mode="mask",
        level=level,
        gating=gating,
        low=low,
        high=high,
        mask_weight="token",
    )


@CORRECTIONS.register("seq-mask")
def sequence_mask(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    low: float = 0.5,
    high: float = 5.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Geo-Mask: keep a sequence, at weight 1, when low ≤ exp(Σ_t m·Δ_t / L_i) ≤ high; drop it
    (weight 0) otherwise. A pure filter: kept tokens are not reweighted.

    Worked values: geometric mean 1.587 inside (0.5, 5) → [1, 1, 1]; with high = 1.5 → [0, 0, 0].
    verl: rejection sampling (rollout_rs) at level geometric, no reweighting. Metrics:
    sequence_mask_fraction.
    """
    return rollout_correction(
        old_logprobs, rollout_logprobs, action_mask, mode="none", sequence_mask_range=(low, high)
    )


@CORRECTIONS.register("seq-mask-tis")
def sequence_mask_token_weights(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    low: float = 0.5,
    high: float = 5.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """OpenRLHF's sequence mask: drop a sequence whose geometric-mean ratio exp(Σ_t m·Δ_t / L_i)
    is outside [low, high]; kept sequences keep each token's weight w_t = exp(Δ_t).

    Worked values: geometric mean 1.587 inside (0.5, 5) → [2, 8, 0.25]; with high = 1.5 → [0, 0, 0].
    OpenRLHF: `--vllm_is_correction_type seq-mask-tis`. Metrics: correction_mask_fraction.
    """
    return rollout_correction(
        old_logprobs,
        rollout_logprobs,
        action_mask,
        mode="mask",
        level="geometric",
        low=low,
        high=high,
        mask_weight="token",
    )
