"""Masked reductions and whitening over token tensors.

All functions take `values` and a 0/1 `mask` of the same shape (usually `[batch, seq]`) and
ignore the positions where the mask is 0. Statistics are computed in float32 (or float64 if the
input is float64) whatever the input dtype.

Statistics across data-parallel ranks: pass `all_reduce`, a callable that sums a tensor over
ranks in place, e.g. ``lambda t: torch.distributed.all_reduce(t)``. The statistics are then
those of the union of every rank's unmasked values, so whitening is independent of how the
batch was sharded.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ._checks import check_floating, check_positive, mask_as

__all__ = ["AllReduce", "last_action_index", "masked_mean", "masked_mean_var", "masked_sum", "masked_whiten"]

AllReduce = Callable[[torch.Tensor], object]
"""Sums a tensor across ranks in place (its return value is ignored)."""


def _stat_dtype(values: torch.Tensor) -> torch.dtype:
    return torch.float64 if values.dtype == torch.float64 else torch.float32


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Σ values·mask over `dim` (all dims if None)."""
    mask = mask_as("mask", mask, values, "values")
    product = values * mask
    return product.sum() if dim is None else product.sum(dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Σ values·mask / Σ mask over `dim`; 0 where the mask is all zero (never NaN).

    Masked entries are selected away, not multiplied by 0, so an inf or NaN there is ignored.
    """
    mask = mask_as("mask", mask, values, "values")
    product = torch.where(mask > 0, values, 0) * mask
    total = product.sum() if dim is None else product.sum(dim)
    count = mask.sum() if dim is None else mask.sum(dim)
    return total / count.clamp(min=1)


def masked_mean_var(
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    unbiased: bool = False,
    all_reduce: AllReduce | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean, variance and count of the unmasked entries of `values` (over every rank).

    μ = Σ m·x / N,  σ² = Σ m·(x − μ)² / (N − 1 if unbiased else N),  N = Σ m.

    Two passes (the mean first, then the centred squares) rather than E[x²] − E[x]², which
    cancels catastrophically when |μ| ≫ σ.

    Returns 0-d float tensors (mean, var, count). With N = 0, mean and var are 0; with
    `unbiased` and N = 1 the variance is 0.
    """
    check_floating("values", values)
    mask = mask_as("mask", mask, values, "values")
    stat = _stat_dtype(values)
    x = values.to(stat)
    m = mask.to(stat)
    sums = torch.stack([(x * m).sum(), m.sum()])
    if all_reduce is not None:
        all_reduce(sums)
    total, count = sums[0], sums[1]
    mean = total / count.clamp(min=1)
    squares = (((x - mean) * m) ** 2).sum()
    if all_reduce is not None:
        all_reduce(squares)
    denominator = (count - 1) if unbiased else count
    var = squares / denominator.clamp(min=1)
    return mean, var, count


def masked_whiten(
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    shift_mean: bool = True,
    unbiased: bool = False,
    epsilon: float = 1e-8,
    all_reduce: AllReduce | None = None,
) -> torch.Tensor:
    """Whiten the unmasked entries: (x − μ)·rsqrt(max(σ², ε)), masked entries set to 0.

    Defaults follow OpenRLHF (population variance, variance clamped at ε = 1e-8); verl uses
    `unbiased=True` and σ² + ε. With `shift_mean=False` the mean is added back after scaling.

    Args:
      values: `[...]` float tensor (e.g. advantages `[batch, seq]`).
      mask: same shape, 1 on the entries that count.
      shift_mean: subtract the mean (True) or only rescale (False).
      unbiased: divide the variance by N − 1 instead of N.
      epsilon: variance floor, > 0.
      all_reduce: optional in-place sum over data-parallel ranks (see the module docstring).

    Returns:
      A tensor like `values` (same dtype), zero where `mask` is 0.
    """
    check_positive("epsilon", epsilon)
    mean, var, _ = masked_mean_var(values, mask, unbiased=unbiased, all_reduce=all_reduce)
    m = mask_as("mask", mask, values, "values")
    x = values.to(mean.dtype)
    whitened = (x - mean) * torch.rsqrt(var.clamp(min=epsilon))
    if not shift_mean:
        whitened = whitened + mean
    return (whitened * m.to(mean.dtype)).to(values.dtype)


def last_action_index(mask: torch.Tensor, name: str = "action_mask") -> torch.Tensor:
    """Index of the last 1 in each row of a `[batch, seq]` 0/1 mask, `[batch]` long.

    Every row must hold at least one 1: a sample without an action token has nowhere to put
    its reward, and the error names the rows.
    """
    has_action = mask.sum(-1) > 0
    if not bool(has_action.all()):
        rows = (~has_action).nonzero().flatten()[:5].tolist()
        raise ValueError(f"{name} has rows with no action token (rows {rows}); every sample needs one")
    return mask.shape[-1] - 1 - (mask != 0).to(torch.uint8).flip(-1).argmax(-1)
