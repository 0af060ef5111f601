"""Per-token KL estimators between the policy and a reference, and KL coefficient controllers.

With d = logπ(a|s) − logπ_ref(a|s) for the sampled token (samples drawn from π):

  k1  = d                   unbiased, can be negative              (alias "kl")
  k2  = d²/2                biased, ≥ 0, gradient = the true KL's   (alias "mse")
  k3  = exp(−d) − 1 + d     unbiased, ≥ 0, low variance (Schulman)  (alias "low_var_kl")
  abs = |d|

A "+" suffix (`k1+`, `k3+`, `abs+`, ...) gives the named estimator's value with k2's
gradient (straight-through), as in verl: value = sg(k) + k2 − sg(k2).
Worked values at logπ = −1.0, logπ_ref = −1.5: k1 0.5, k2 0.125, k3 0.106531.

Clamps: OpenRLHF clamps the estimate to [−10, 10] (`value_clamp=10`); verl clamps d to ±20
(`log_ratio_clamp=20`) and k3 to ±10; TRL clamps nothing (both None).
"""

from __future__ import annotations

import torch

from ._checks import check_floating, check_positive, check_same_shape, compute_dtype
from .registry import Registry

__all__ = [
    "KL_ESTIMATORS",
    "AdaptiveKLController",
    "FixedKLController",
    "kl_penalty",
]

KL_ESTIMATORS = Registry("KL estimator")


@KL_ESTIMATORS.register("k1", aliases=("kl",))
def _k1(log_ratio: torch.Tensor) -> torch.Tensor:
    return log_ratio


@KL_ESTIMATORS.register("k2", aliases=("mse",))
def _k2(log_ratio: torch.Tensor) -> torch.Tensor:
    return 0.5 * log_ratio.square()


@KL_ESTIMATORS.register("k3", aliases=("low_var_kl",))
def _k3(log_ratio: torch.Tensor) -> torch.Tensor:
    # expm1 keeps precision for small d, where exp(−d) − 1 would cancel.
    return torch.expm1(-log_ratio) + log_ratio


@KL_ESTIMATORS.register("abs")
def _abs(log_ratio: torch.Tensor) -> torch.Tensor:
    return log_ratio.abs()


def kl_penalty(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    estimator: str = "k1",
    *,
    log_ratio_clamp: float | None = None,
    value_clamp: float | None = 10.0,
) -> torch.Tensor:
    """Per-token KL estimate between the policy and the reference.

    Args:
      logprobs: `[batch, seq]` log π of the sampled tokens (may require grad).
      ref_logprobs: `[batch, seq]` log π_ref of the same tokens.
      estimator: a name in `KL_ESTIMATORS`, optionally with a "+" suffix (k2 gradient).
      log_ratio_clamp: clamp d to [−c, c] before the estimator (verl: 20), or None.
      value_clamp: clamp the estimate to [−c, c] (OpenRLHF: 10), or None.

    Returns:
      `[batch, seq]` float32 (float64 for float64 inputs) estimate (not masked: multiply by the action mask or aggregate).
    """
    check_floating("logprobs", logprobs)
    check_same_shape("ref_logprobs", ref_logprobs, "logprobs", logprobs)
    straight_through = estimator.endswith("+")
    base = estimator[:-1] if straight_through else estimator
    if base not in KL_ESTIMATORS:
        known = sorted(KL_ESTIMATORS) + [f"{name}+" for name in sorted(KL_ESTIMATORS)]
        raise ValueError(f"unknown KL estimator {estimator!r}; known names: {', '.join(known)}")
    dtype = compute_dtype(logprobs, ref_logprobs)
    log_ratio = logprobs.to(dtype) - ref_logprobs.to(dtype)
    if log_ratio_clamp is not None:
        check_positive("log_ratio_clamp", log_ratio_clamp)
        log_ratio = log_ratio.clamp(-log_ratio_clamp, log_ratio_clamp)
    kl = KL_ESTIMATORS[base](log_ratio)
    if value_clamp is not None:
        check_positive("value_clamp", value_clamp)
        kl = kl.clamp(-value_clamp, value_clamp)
    if straight_through:
        surrogate = _k2(log_ratio)
        kl = kl.detach() + surrogate - surrogate.detach()
    return kl


class FixedKLController:
    """A constant KL coefficient β."""

    def __init__(self, kl_coef: float) -> None:
        self.value = check_positive("kl_coef", kl_coef, allow_zero=True)

    def update(self, current_kl: float, n_steps: int) -> float:
        return self.value


class AdaptiveKLController:
    """Proportional β controller (Ziegler et al., 2019).

        e = clip(KL / target − 1, −0.2, 0.2),   β ← β·(1 + e·n_steps / horizon)

    Args:
      init_kl_coef: initial β > 0.
      target: the KL to hold, > 0.
      horizon: how many samples the controller takes to react, > 0.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: float) -> None:
        self.value = check_positive("init_kl_coef", init_kl_coef)
        self.target = check_positive("target", target)
        self.horizon = check_positive("horizon", horizon)

    def update(self, current_kl: float, n_steps: int) -> float:
        """Move β towards holding `current_kl` at the target after `n_steps` samples."""
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon
        return self.value
