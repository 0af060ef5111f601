"""Corrections for the mismatch between the rollout engine's log-probs and the learner's.

vLLM and the training framework compute log π_old differently (kernels, precision, batch
shapes), so the samples are slightly off-policy even for the "same" weights. With
Δ_t = log π_old − log π_rollout and the importance weight w_t = exp(Δ_t) (detached):

  "tis"     truncated importance sampling: w ← clip(w, low, high)      (Yao et al., 2025)
  "icepop"  keep w where low ≤ w ≤ high, set it to 0 elsewhere         (Ling team, 2025)
  "none"    w ← 1 (use only the sequence mask below, or the metrics)

`level="token"` uses the per-token weights; `level="sequence"` uses the product of a
sequence's token weights, exp(Σ_t m·Δ_t), on all its tokens. Independently,
`sequence_mask_range=(lo, hi)` drops (weight 0) sequences whose geometric-mean ratio
exp(Σ_t m·Δ_t / L_i) is outside [lo, hi]. Multiply the policy loss by the weights before
aggregating.

OpenRLHF's TIS default range is [0.5, 5.0].
"""

from __future__ import annotations

import torch

from ._checks import check_choice, check_floating, check_ndim, check_positive, check_same_shape, mask_as
from .masked import masked_mean

__all__ = ["CORRECTION_LEVELS", "CORRECTION_METHODS", "mismatch_metrics", "rollout_correction"]

CORRECTION_METHODS = ("tis", "icepop", "none")
CORRECTION_LEVELS = ("token", "sequence")

_LOG_CLAMP = 20.0


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
    method: str = "tis",
    level: str = "token",
    low: float = 0.5,
    high: float = 5.0,
    sequence_mask_range: tuple[float, float] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Importance weights that correct for the rollout/learner mismatch (module docstring).

    Args:
      old_logprobs: `[batch, seq]` learner log-probs of the sampled tokens before the update.
      rollout_logprobs: `[batch, seq]` log-probs the rollout engine reported for them.
      action_mask: `[batch, seq]`.
      method: one of `CORRECTION_METHODS`.
      level: one of `CORRECTION_LEVELS`.
      low, high: the weight range, 0 < low < high.
      sequence_mask_range: optional (lo, hi) range for the geometric-mean sequence mask.

    Returns:
      (weights `[batch, seq]` float32, detached, 0 off the action tokens and on dropped tokens,
       metrics: `mismatch_metrics` plus the fraction of tokens clipped or masked).
    """
    check_choice("method", method, CORRECTION_METHODS)
    check_choice("level", level, CORRECTION_LEVELS)
    low, high = _check_range("(low, high)", (low, high))
    delta, mask = _prepare(old_logprobs, rollout_logprobs, action_mask)
    metrics = mismatch_metrics(old_logprobs, rollout_logprobs, action_mask)

    log_weight = delta if level == "token" else delta.sum(-1, keepdim=True).expand_as(delta)
    raw = log_weight.clamp(-_LOG_CLAMP, _LOG_CLAMP).exp()
    outside = (raw < low) | (raw > high)
    if method == "tis":
        weights = raw.clamp(low, high)
        metrics["correction_clip_fraction"] = masked_mean(outside.float(), mask)
    elif method == "icepop":
        weights = torch.where(outside, torch.zeros_like(raw), raw)
        metrics["correction_mask_fraction"] = masked_mean(outside.float(), mask)
    else:
        weights = torch.ones_like(raw)

    if sequence_mask_range is not None:
        lo, hi = _check_range("sequence_mask_range", sequence_mask_range)
        lengths = mask.sum(-1, keepdim=True).clamp(min=1)
        geometric = (delta.sum(-1, keepdim=True) / lengths).exp()
        keep = (geometric >= lo) & (geometric <= hi)
        weights = weights * keep
        has_tokens = mask.sum(-1) > 0
        dropped = (~keep.squeeze(-1)) & has_tokens
        metrics["sequence_mask_fraction"] = dropped.float().sum() / has_tokens.float().sum().clamp(min=1)
    return (weights * mask).detach(), metrics
