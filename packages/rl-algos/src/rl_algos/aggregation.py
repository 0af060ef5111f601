"""Reduce a per-token loss to the scalar an optimizer step minimises, with an explicit normaliser.

  token-mean               Σ_i Σ_t l·m / N_tokens                  (DAPO; the default)
  seq-mean-token-sum       Σ_i Σ_t l·m / N_seqs
  seq-mean-token-mean      Σ_i (Σ_t l·m / L_i) / N_seqs            (GRPO paper, GSPO, GMPO)
  seq-mean-token-sum-norm  Σ_i Σ_t l·m / (N_seqs·T)                (Dr.GRPO; T = `horizon`)

N_tokens and N_seqs are counts over the WHOLE optimizer step: every micro-batch of gradient
accumulation and every data-parallel rank. Pass them as `normalizer` and the sum of the
micro-batch losses (and gradients) over all micro-batches and ranks equals the loss of the full
batch, whatever the split. Computing the mean per micro-batch instead silently reweights tokens
by the size of the micro-batch they landed in (OpenRLHF #1249; verl #906, #3332, #5625, #7200;
TRL #3983). `loss_normalizer` gives the local count to all-reduce.

Note on data parallelism: frameworks that average gradients over ranks (DDP, DeepSpeed) divide
by the world size; multiply the loss by the world size (or the normaliser by 1/world size) to
keep the sum semantics above.

Worked values, l = [[1, 2, ·, ·], [1, 1, 1, 1]], m = [[1, 1, 0, 0], [1, 1, 1, 1]]: token-mean
1.166667, seq-mean-token-sum 3.5, seq-mean-token-mean 1.25, seq-mean-token-sum-norm (T = 4) 0.875.
"""

from __future__ import annotations

import torch

from ._checks import check_choice, check_floating, check_ndim, check_positive, compute_dtype, mask_as

__all__ = ["AGGREGATION_MODES", "aggregate_loss", "loss_normalizer", "resolve_normalizer"]

AGGREGATION_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def loss_normalizer(action_mask: torch.Tensor, mode: str) -> torch.Tensor:
    """This micro-batch's share of the normaliser of `mode` (sum it over the step and ranks).

    Tokens (Σ m) for `token-mean`; sequences with at least one action token for the seq modes.
    Returns a 0-d float32 tensor on the mask's device.
    """
    check_choice("mode", mode, AGGREGATION_MODES)
    check_ndim("action_mask", action_mask, 2, "[batch, seq]")
    mask = action_mask.to(torch.float32)
    if mode == "token-mean":
        return mask.sum()
    return (mask.sum(-1) > 0).to(torch.float32).sum()


def _check_positive_tensor(value: torch.Tensor) -> None:
    """A tensor normaliser must be > 0, like a float one (NaN fails too). On the CPU it is read at
    once; on an accelerator the check is a device-side assert, so no micro-batch waits for the device."""
    if value.device.type == "cpu":
        if not bool(value > 0):
            raise ValueError(f"normalizer must be > 0, got {value.item()}")
    else:
        torch._assert_async(value > 0, "normalizer must be > 0")


def resolve_normalizer(normalizer: float | torch.Tensor | None, local_count: torch.Tensor) -> torch.Tensor:
    """The divisor N as a float32 0-d tensor on `local_count`'s device.

    `normalizer` is the global count (a positive number or a one-element tensor), or None for
    this call's own `local_count`.
    """
    if normalizer is None:
        # clamp: an all-masked micro-batch contributes 0 rather than 0/0.
        return local_count.clamp(min=1)
    if isinstance(normalizer, torch.Tensor):
        if normalizer.numel() != 1 or normalizer.is_complex() or normalizer.dtype == torch.bool:
            raise ValueError(
                "normalizer must be a positive number or a one-element real tensor, got a tensor of "
                f"shape {tuple(normalizer.shape)} and dtype {normalizer.dtype}"
            )
        value = normalizer.detach().reshape(()).to(device=local_count.device, dtype=torch.float32)
        _check_positive_tensor(value)
        return value
    check_positive("normalizer", normalizer)
    return local_count.new_tensor(float(normalizer))


def aggregate_loss(
    per_token_loss: torch.Tensor,
    action_mask: torch.Tensor,
    mode: str = "token-mean",
    *,
    normalizer: float | torch.Tensor | None = None,
    horizon: int | None = None,
) -> torch.Tensor:
    """Aggregate `[batch, seq]` per-token losses into a scalar (see the module docstring).

    Args:
      per_token_loss: `[batch, seq]` float.
      action_mask: `[batch, seq]` 0/1 (bool, int or float).
      mode: one of `AGGREGATION_MODES`.
      normalizer: the global token count (`token-mean`) or sequence count (seq modes) of the
        whole optimizer step, > 0. None uses this call's own count (`loss_normalizer`), which is
        right only when this call sees the whole step.
      horizon: T for `seq-mean-token-sum-norm`, the constant length divisor (e.g. the generation
        limit, max_new_tokens). None uses `per_token_loss.shape[-1]`, which depends on padding;
        pass it explicitly when micro-batches are padded differently.

    Returns:
      A 0-d tensor: float32, or float64 when `per_token_loss` is float64.
    """
    check_choice("mode", mode, AGGREGATION_MODES)
    check_ndim("per_token_loss", per_token_loss, 2, "[batch, seq]")
    check_floating("per_token_loss", per_token_loss)
    dtype = compute_dtype(per_token_loss)
    mask = mask_as("action_mask", action_mask, per_token_loss, "per_token_loss").to(dtype)
    # where, not a product: a padding position may hold inf or NaN, and inf·0 is NaN.
    loss = torch.where(mask > 0, per_token_loss.to(dtype), 0.0) * mask
    divisor = resolve_normalizer(normalizer, loss_normalizer(mask, mode)).to(dtype)

    if mode in ("token-mean", "seq-mean-token-sum"):
        total = loss.sum()
    elif mode == "seq-mean-token-mean":
        total = (loss.sum(-1) / mask.sum(-1).clamp(min=1)).sum()
    else:
        if horizon is None:
            horizon = per_token_loss.shape[-1]
        if not isinstance(horizon, int) or horizon <= 0:
            raise ValueError(
                f"horizon must be a positive int (the constant length divisor T), got {horizon!r}"
            )
        total = loss.sum() / horizon
    return total / divisor
