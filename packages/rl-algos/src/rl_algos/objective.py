"""The whole objective a policy learner minimises, as one function.

    J = agg(l ⊙ w) + β·agg(KL) + β_d·agg(KL_T) − c·agg(H)

  l    `[batch, seq]` per-token policy loss of the named loss in `POLICY_LOSSES`
       (`loss_fn(logprobs, old_logprobs, advantages, action_mask, **loss_options)`);
  w    `[batch, seq]` detached importance weights (rollout correction, see
       `rollout_correction`), or 1;
  KL   `[batch, seq]` per-token estimate `kl_penalty(logprobs, ref_logprobs, kl_estimator,
       **kl_options)` against the reference policy, with coefficient β ≥ 0 (KL in the loss,
       GRPO style; with KL in the reward instead, leave β = 0);
  KL_T `[batch, seq]` per-token estimate `kl_penalty(logprobs, teacher_logprobs, distill_estimator)`
       against a teacher (on-policy distillation in the loss, `rl_algos.distillation`), with
       coefficient β_d ≥ 0; k2 gives the reverse-KL gradient under the student's own samples;
  H    `[batch, seq]` per-token entropy of the policy (`entropy_from_logits`), coefficient c;
  agg  `aggregate_loss(·, action_mask, aggregation, normalizer=N, horizon=T)`, the same mode,
       normaliser and horizon for every term.

How it is normalised (as NeMo-RL's loss functions declare it). `aggregation` says whether the
loss is token-level (`token-mean`: N = number of action tokens) or sequence-level (the
`seq-mean-*` modes: N = number of sequences with at least one action token); `normalizer` is N
for the WHOLE optimizer step, summed over every micro-batch and data-parallel rank
(`loss_normalizer` per micro-batch, then all-reduced). With it, the sum over micro-batches of
`policy_objective(...)` is the full-batch objective, and so is its gradient, however the batch
is split. Leave `normalizer=None` only when this call sees the whole step.

Worked values, one sequence of two tokens, π = π_old (ρ = 1), A = [1, 1], log π = [−1, −2],
log π_ref = [−1.5, −2], H = [0.5, 1.5], `ppo`, token-mean, β = 0.1 with k1, c = 0.01:
  agg(l) = −1;  agg(KL) = (0.5 + 0)/2 = 0.25;  agg(H) = 1;  J = −1 + 0.025 − 0.01 = −0.985.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ._checks import check_positive
from .aggregation import aggregate_loss
from .kl import kl_penalty
from .masked import masked_mean
from .policy_losses import POLICY_LOSSES

__all__ = ["policy_objective"]


def policy_objective(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    loss: str = "ppo",
    loss_options: Mapping[str, Any] | None = None,
    aggregation: str = "token-mean",
    normalizer: float | torch.Tensor | None = None,
    horizon: int | None = None,
    importance_weights: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    kl_options: Mapping[str, Any] | None = None,
    teacher_logprobs: torch.Tensor | None = None,
    distill_coef: float = 0.0,
    distill_estimator: str = "k2",
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """J = agg(l ⊙ w) + β·agg(KL) + β_d·agg(KL_T) − c·agg(H) for one micro-batch (module docstring).

    Args:
      logprobs: `[batch, seq]` log π_θ of the sampled tokens (carries the gradient).
      old_logprobs: `[batch, seq]` log π_old (the ratio's denominator; constants).
      advantages: `[batch, seq]`.
      action_mask: `[batch, seq]` 1 on tokens the policy chose.
      loss: a name in `POLICY_LOSSES`; `loss_options` its keyword options.
      aggregation: a mode of `AGGREGATION_MODES`, for every term.
      normalizer: the global token or sequence count of the step (see the module docstring).
      horizon: T of `seq-mean-token-sum-norm`.
      importance_weights: `[batch, seq]` detached weights w multiplying l, or None.
      ref_logprobs: `[batch, seq]` log π_ref; needed when `kl_coef > 0`.
      kl_coef: β ≥ 0; 0 leaves the KL term out.
      kl_estimator: a name in `KL_ESTIMATORS` (a "+" name such as "k3+" has k2's gradient).
      kl_options: keyword options of `kl_penalty` (log_ratio_clamp, value_clamp,
        unbiased_gradient, importance_weight_cap); with `unbiased_gradient` the weight π/π_old
        uses `old_logprobs`.
      teacher_logprobs: `[batch, seq]` log π_T of a teacher; needed when `distill_coef > 0`.
      distill_coef: β_d ≥ 0; 0 leaves the teacher term out.
      distill_estimator: a name in `KL_ESTIMATORS` for KL_T (default k2: the reverse-KL gradient).
      entropy: `[batch, seq]` per-token entropy (carries the gradient when c ≠ 0), or None.
      entropy_coef: c; 0 leaves the entropy term out (H is still reported when given).

    Returns:
      (J, a 0-d tensor; metrics: the loss's own metrics, `loss`, `loss_policy`, and when they
       apply `loss_kl` and `kl` (mean KL estimate per action token), `loss_distill` and
       `distill_kl` (mean KL_T estimate per action token), `loss_entropy`, `entropy`
       (mean per action token); all detached 0-d tensors).
    """
    loss_fn = POLICY_LOSSES[loss]
    per_token, loss_metrics = loss_fn(
        logprobs, old_logprobs, advantages, action_mask, **dict(loss_options or {})
    )
    metrics = dict(loss_metrics)
    if importance_weights is not None:
        if importance_weights.shape != per_token.shape:
            raise ValueError(
                f"importance_weights has shape {tuple(importance_weights.shape)} but logprobs has "
                f"shape {tuple(per_token.shape)}; they must match"
            )
        per_token = per_token * importance_weights.detach().to(per_token.dtype)

    def aggregate(values: torch.Tensor) -> torch.Tensor:
        return aggregate_loss(values, action_mask, aggregation, normalizer=normalizer, horizon=horizon)

    policy = aggregate(per_token)
    total = policy
    metrics["loss_policy"] = policy.detach()
    check_positive("kl_coef", kl_coef, allow_zero=True)
    if kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError("ref_logprobs is required when kl_coef > 0")
        options = dict(kl_options or {})
        if options.get("unbiased_gradient") and "old_logprobs" not in options:
            options["old_logprobs"] = old_logprobs
        kl = kl_penalty(logprobs, ref_logprobs, kl_estimator, **options)
        kl_term = aggregate(kl)
        total = total + kl_coef * kl_term
        metrics["loss_kl"] = kl_term.detach()
        metrics["kl"] = masked_mean(kl.detach(), action_mask.to(kl.dtype))
    check_positive("distill_coef", distill_coef, allow_zero=True)
    if distill_coef > 0:
        if teacher_logprobs is None:
            raise ValueError("teacher_logprobs is required when distill_coef > 0")
        distill = kl_penalty(logprobs, teacher_logprobs, distill_estimator)
        distill_term = aggregate(distill)
        total = total + distill_coef * distill_term
        metrics["loss_distill"] = distill_term.detach()
        metrics["distill_kl"] = masked_mean(distill.detach(), action_mask.to(distill.dtype))
    if entropy is not None:
        metrics["entropy"] = masked_mean(entropy.detach().to(policy.dtype), action_mask.to(policy.dtype))
    if entropy_coef != 0:
        if entropy is None:
            raise ValueError(f"entropy is required when entropy_coef != 0 (got {entropy_coef})")
        entropy_term = aggregate(entropy)
        total = total - entropy_coef * entropy_term
        metrics["loss_entropy"] = entropy_term.detach()
    metrics["loss"] = total.detach()
    return total, metrics
