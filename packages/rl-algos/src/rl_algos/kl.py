"""Per-token KL estimators between the policy and a reference, and KL coefficient controllers.

With d = logπ(a|s) − logπ_ref(a|s) for the sampled token (samples drawn from π):

  k1  = d                   unbiased, can be negative              (alias "kl")
  k2  = d²/2                biased, ≥ 0, gradient = the true KL's   (alias "mse")
  k3  = exp(−d) − 1 + d     unbiased, ≥ 0, low variance (Schulman)  (alias "low_var_kl")
  abs = |d|

The "+" entries (`k1+`, `k2+`, `k3+`, `abs+` and `kl+`, `mse+`, `low_var_kl+`) are registry
names of their own, each a `StraightThroughKL`: the named estimator's value with k2's gradient
(straight-through), as in verl: value = sg(k) + k2 − sg(k2). In `kl_penalty` the k2 surrogate is
built from the UNCLAMPED d (verl does the same), so the gradient is d even where the value is
clamped. Worked values: logπ = −30, logπ_ref = −1, `k3+` with verl's clamps → value 10.0,
gradient −29. A user's estimator gets its "+" the same way:
`KL_ESTIMATORS.register("mine+", StraightThroughKL(mine))`.

OpenRLHF's `unbiased_gradient` (`kl_penalty(..., unbiased_gradient=True, old_logprobs=...)`)
also keeps the named estimator's value, with the gradient of sg(w)·d²/2, w = π/π_old =
exp(logπ − logπ_old) (capped at `importance_weight_cap`): the reverse-KL gradient when the
samples came from π_old, not π. Without `old_logprobs`, w = 1 (the "+" variant). OpenRLHF caps w
at 10 (its `KL_IS_WEIGHT_CLIP`); pass `importance_weight_cap=10` for its numbers (the default,
None, does not cap). At logπ = −1, logπ_ref = −1.5, logπ_old = −4 (w = e³ = 20.09) the gradient
w·d is 10.04 uncapped and 10·0.5 = 5.0 with the cap, OpenRLHF's.

Worked values at logπ = −1.0, logπ_ref = −1.5: k1 0.5, k2 0.125, k3 0.106531.

Clamps: OpenRLHF clamps the estimate to [−10, 10] (`value_clamp=10`); verl clamps d to ±20
(`log_ratio_clamp=20`) and k3 to ±10; TRL clamps nothing (both None).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from ._checks import check_floating, check_positive, check_same_shape, compute_dtype
from .registry import Registry

__all__ = [
    "KL_ESTIMATORS",
    "AdaptiveKLController",
    "FixedKLController",
    "StraightThroughKL",
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


@dataclasses.dataclass(frozen=True)
class StraightThroughKL:
    """A KL estimator with `estimator`'s value and k2's gradient: sg(k(d)) + k2(d) − sg(k2(d)).

    Called on its own it does exactly that; `kl_penalty` clamps the value as for `estimator` and
    builds the k2 surrogate from the unclamped d (module docstring).
    """

    estimator: Callable[[torch.Tensor], torch.Tensor]
    """The estimator whose value is kept, e.g. k3."""

    def __call__(self, log_ratio: torch.Tensor) -> torch.Tensor:
        surrogate = _k2(log_ratio)
        return self.estimator(log_ratio).detach() + surrogate - surrogate.detach()


for _name, _aliases in (("k1", ("kl",)), ("k2", ("mse",)), ("k3", ("low_var_kl",)), ("abs", ())):
    KL_ESTIMATORS.register(
        f"{_name}+", StraightThroughKL(KL_ESTIMATORS[_name]), aliases=[f"{alias}+" for alias in _aliases]
    )
del _name, _aliases


def kl_penalty(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    estimator: str = "k1",
    *,
    log_ratio_clamp: float | None = None,
    value_clamp: float | None = 10.0,
    unbiased_gradient: bool = False,
    old_logprobs: torch.Tensor | None = None,
    importance_weight_cap: float | None = None,
) -> torch.Tensor:
    """Per-token KL estimate between the policy and the reference.

    Args:
      logprobs: `[batch, seq]` log π of the sampled tokens (may require grad).
      ref_logprobs: `[batch, seq]` log π_ref of the same tokens.
      estimator: a name in `KL_ESTIMATORS` ("k3", or "k3+": a `StraightThroughKL`, k2's gradient).
      log_ratio_clamp: clamp d to [−c, c] before the estimator (verl: 20), or None.
      value_clamp: clamp the estimate to [−c, c] (OpenRLHF: 10), or None.
      unbiased_gradient: OpenRLHF's option: the value of `estimator`, the gradient of
        sg(w)·d²/2 with d unclamped and w = exp(logπ − logπ_old) (1 without `old_logprobs`).
      old_logprobs: `[batch, seq]` log π_old of the sampled tokens, for w (only with
        `unbiased_gradient`).
      importance_weight_cap: cap w at this value (> 0; OpenRLHF: 10), or None for no cap.

    Returns:
      `[batch, seq]` float32 (float64 for float64 inputs) estimate (not masked: multiply by the action mask or aggregate).
    """
    check_floating("logprobs", logprobs)
    check_same_shape("ref_logprobs", ref_logprobs, "logprobs", logprobs)
    entry = KL_ESTIMATORS[estimator]
    straight_through = isinstance(entry, StraightThroughKL)
    value_of = entry.estimator if straight_through else entry
    dtype = compute_dtype(logprobs, ref_logprobs)
    if old_logprobs is not None and not unbiased_gradient:
        raise ValueError("old_logprobs is used only with unbiased_gradient=True; pass both or neither")
    if importance_weight_cap is not None:
        if old_logprobs is None:
            raise ValueError("importance_weight_cap needs old_logprobs (the weight is π/π_old)")
        check_positive("importance_weight_cap", importance_weight_cap)
    raw_log_ratio = logprobs.to(dtype) - ref_logprobs.to(dtype)
    log_ratio = raw_log_ratio
    if log_ratio_clamp is not None:
        check_positive("log_ratio_clamp", log_ratio_clamp)
        log_ratio = log_ratio.clamp(-log_ratio_clamp, log_ratio_clamp)
    kl = value_of(log_ratio)
    if value_clamp is not None:
        check_positive("value_clamp", value_clamp)
        kl = kl.clamp(-value_clamp, value_clamp)
    if straight_through or unbiased_gradient:
        # The surrogate uses the unclamped d: its gradient must not vanish where the value is clamped.
        surrogate = _k2(raw_log_ratio)
        if old_logprobs is not None:
            check_same_shape("old_logprobs", old_logprobs, "logprobs", logprobs)
            log_weight = logprobs.detach().to(dtype) - old_logprobs.detach().to(dtype)
            weight = log_weight.clamp(-20.0, 20.0).exp()
            if importance_weight_cap is not None:
                weight = weight.clamp(max=importance_weight_cap)
            surrogate = weight * surrogate
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
