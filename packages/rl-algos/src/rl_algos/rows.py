"""From a trainer that keeps groups as contiguous rows and one value per sequence to this library's
explicit layout.

TRL's `GRPOTrainer` (and most single-file GRPO loops) lay a batch out as `num_prompts` groups of
`num_generations` consecutive rows and keep the advantage as one number per row, `[batch]`. Here
group membership is explicit (`group_ids`, never inferred from row order inside an estimator) and
per-token tensors are `[batch, seq]`. These two functions are the whole translation:

    group_ids[i]     = i // group_size                       (rows 0..G-1 are group 0, ...)
    token_values[i, t] = values[i] · action_mask[i, t]
"""

from __future__ import annotations

import torch

from ._checks import check_ndim, check_positive, check_rows, check_tensor

__all__ = ["contiguous_group_ids", "expand_to_tokens"]


def contiguous_group_ids(
    num_rows: int, group_size: int, *, device: torch.device | str | None = None
) -> torch.Tensor:
    """Group ids `[num_rows]` (int64) for `num_rows / group_size` groups of consecutive rows.

    Args:
      num_rows: rows in the batch; a multiple of `group_size`.
      group_size: rows per group (TRL's `num_generations`), >= 1.
      device: where the ids live (the rewards' device).

    Example: `contiguous_group_ids(6, 3)` is `tensor([0, 0, 0, 1, 1, 1])`.
    """
    for name, value in (("num_rows", num_rows), ("group_size", group_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an integer, got {value!r}")
    check_positive("group_size", group_size)
    if num_rows < 0 or num_rows % group_size:
        raise ValueError(
            f"num_rows {num_rows} is not a multiple of group_size {group_size}: contiguous groups need "
            "every group complete (give group_ids yourself for groups of different sizes)"
        )
    return torch.arange(num_rows, device=device) // group_size


def expand_to_tokens(values: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
    """One value per sequence `[batch]` on every action token: `[batch, seq]`, 0 off the mask.

    Args:
      values: `[batch]` per-sequence values (advantages, rewards).
      action_mask: `[batch, seq]`, 1 on the tokens the policy chose (TRL's `completion_mask`).

    Returns values[:, None] · action_mask in `values`' floating dtype (float32 for integer values).
    """
    values = check_ndim("values", check_tensor("values", values), 1, "[batch]")
    action_mask = check_ndim("action_mask", check_tensor("action_mask", action_mask), 2, "[batch, seq]")
    check_rows("action_mask", action_mask, "values", values)
    dtype = values.dtype if values.is_floating_point() else torch.float32
    return values.to(dtype)[:, None] * action_mask.to(dtype)
