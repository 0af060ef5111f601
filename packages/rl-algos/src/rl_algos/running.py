"""Running statistics of a stream of values, and normalisation by them (reward normalisation).

`merge_moments` is the pure step: the count, mean and sum of squared deviations of two sets
from each set's own (Chan, Golub & LeVeque 1979, "Updating formulae and a pairwise algorithm
for computing sample variances"; Welford's update is the case of a set of one):

    n = n_a + n_b,   δ = μ_b − μ_a,
    μ = μ_a + δ·n_b / n,
    M₂ = M₂_a + M₂_b + δ²·n_a·n_b / n,

where M₂ = Σ (x − μ)². The variance is the population one, σ² = M₂ / n.

`RunningMoments` holds (n, μ, M₂) as Python floats (float64, exact in a JSON checkpoint) and
normalises each batch by the statistics *including* that batch:

    update(x) then  x̂ = (x − μ) / max(σ, eps)

so the first batch is standardised by its own statistics; a stream of equal values gives 0
(every value equals μ), never a division by zero.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ._checks import check_positive, check_tensor

__all__ = ["RunningMoments", "merge_moments"]


def merge_moments(
    count_a: float, mean_a: float, m2_a: float, count_b: float, mean_b: float, m2_b: float
) -> tuple[float, float, float]:
    """(n, μ, M₂) of the union of two sets given each one's (n, μ, M₂); see the module docstring.

    Example: merge_moments(2, 1.5, 0.5, 2, 3.5, 0.5) == (4, 2.5, 5.0), the moments of
    [1, 2, 3, 4]. A set with count 0 leaves the other unchanged.
    """
    if count_a < 0 or count_b < 0:
        raise ValueError(f"counts must be >= 0, got count_a={count_a}, count_b={count_b}")
    count = count_a + count_b
    if count == 0:
        return 0.0, 0.0, 0.0
    delta = mean_b - mean_a
    mean = mean_a + delta * count_b / count
    m2 = m2_a + m2_b + delta * delta * count_a * count_b / count
    return float(count), float(mean), float(m2)


class RunningMoments:
    """Running count, mean and standard deviation of every value passed to `update`.

    `normalize(x)` updates with `x` [any shape] and returns (x − μ) / max(σ, eps) (float32, the
    shape of x); `center=False` returns x / max(σ, eps). `state_dict()` / `load_state_dict()`
    carry (n, μ, M₂) exactly, so a resumed run normalises as an uninterrupted one.
    """

    def __init__(self, *, center: bool = True, eps: float = 1e-8) -> None:
        check_positive("eps", eps)
        self.center = center
        self.eps = float(eps)
        self.count = 0.0
        self.mean = 0.0
        self.m2 = 0.0

    @property
    def var(self) -> float:
        """σ² = M₂ / n (population variance); 0 before any value."""
        return self.m2 / self.count if self.count else 0.0

    @property
    def std(self) -> float:
        return math.sqrt(self.var)

    def update(self, values: torch.Tensor) -> None:
        """Merge the values of `values` [any shape, finite] into the statistics."""
        check_tensor("values", values)
        flat = values.detach().reshape(-1).double()
        if flat.numel() == 0:
            return
        if not bool(torch.isfinite(flat).all()):
            raise ValueError("values must be finite: a NaN or inf would poison the running statistics")
        batch_mean = float(flat.mean())
        batch_m2 = float(((flat - batch_mean) ** 2).sum())
        self.count, self.mean, self.m2 = merge_moments(
            self.count, self.mean, self.m2, float(flat.numel()), batch_mean, batch_m2
        )

    def normalize(self, values: torch.Tensor) -> torch.Tensor:
        """Update with `values`, then (values − μ) / max(σ, eps) (without − μ when center=False)."""
        self.update(values)
        shifted = values.double() - self.mean if self.center else values.double()
        return (shifted / max(self.std, self.eps)).to(torch.float32)

    def state_dict(self) -> dict[str, float]:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        count, mean, m2 = float(state["count"]), float(state["mean"]), float(state["m2"])
        if count < 0 or m2 < 0 or not all(math.isfinite(v) for v in (count, mean, m2)):
            raise ValueError(f"running moments state must have finite count >= 0 and m2 >= 0, got {state}")
        self.count, self.mean, self.m2 = count, mean, m2
