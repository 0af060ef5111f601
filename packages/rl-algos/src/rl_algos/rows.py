"""From a trainer that keeps groups as contiguous rows and one value per sequence to this library's
explicit layout.

TRL's `GRPOTrainer` (and most single-file GRPO loops) lay a batch out as `num_prompts` groups of
`num_generations` consecutive rows and keep the advantage as one number per row, `[batch]`. Here
group membership is explicit (`group_ids`, never inferred from row order inside an estimator) and
per-token tensors are `[batch, seq]`. These two functions are the whole translation:

    group_ids[i]     = i // group_size                       (rows 0..G-1 are group 0, ...)
    token_values[i, t] = values[i] · action_mask[i, t]

An episode trained as several rows (segments of an episode whose chat template rewrote its
history, each row its own prompt) is one sample for an estimator: `segment_layout`,
`join_segments` and `split_segments` lay its rows end to end as one row, and back, so group
statistics count the episode once and a return flows across its segments.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ._checks import check_integer, check_ndim, check_positive, check_rows, check_tensor

__all__ = [
    "SegmentLayout",
    "contiguous_group_ids",
    "expand_to_tokens",
    "join_segments",
    "segment_layout",
    "split_segments",
]


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


class SegmentLayout(NamedTuple):
    """Where each response token of `[batch, seq]` rows goes in `[episodes, episode_seq]` rows.

    rows, columns: `[N]` the token's place in the segment rows; episodes, positions: `[N]` its
    place in the joined rows; first, last: `[episodes]` the first and last segment row of each
    episode; shape: (batch, seq) of the segment rows; joined_shape: (episodes, episode_seq).
    """

    rows: torch.Tensor
    columns: torch.Tensor
    episodes: torch.Tensor
    positions: torch.Tensor
    first: torch.Tensor
    last: torch.Tensor
    shape: tuple[int, int]
    joined_shape: tuple[int, int]


def segment_layout(lengths: torch.Tensor, episode_ids: torch.Tensor, seq: int) -> SegmentLayout:
    """The layout joining the rows of each episode end to end, in row order.

        joined[e] = row_{b₁}[:L_{b₁}] ‖ row_{b₂}[:L_{b₂}] ‖ …   for the rows b₁ < b₂ < … of episode e

    Args:
      lengths: `[batch]` response tokens of each row (L_b ≤ seq).
      episode_ids: `[batch]` integer episode of each row; rows of one episode share it (any
        integers; episodes are numbered in order of their first row).
      seq: the padded width of the segment rows.

    Example: lengths [2, 1, 3], episode_ids [7, 7, 9] → episode 0 = row 0's 2 tokens then row 1's
    1, episode 1 = row 2's 3; joined_shape (2, 3).
    """
    lengths = check_ndim("lengths", check_tensor("lengths", lengths), 1, "[batch]")
    episode_ids = check_ndim("episode_ids", check_tensor("episode_ids", episode_ids), 1, "[batch]")
    check_integer("episode_ids", episode_ids)
    check_rows("episode_ids", episode_ids, "lengths", lengths)
    if bool((lengths < 0).any()) or bool((lengths > seq).any()):
        raise ValueError(f"lengths must be in [0, seq = {seq}], got {lengths.tolist()}")
    order: dict[int, int] = {}
    dense = [order.setdefault(int(e), len(order)) for e in episode_ids.tolist()]
    count = len(order)
    offsets = [0] * count
    rows, columns, episodes, positions = [], [], [], []
    first, last = [-1] * count, [-1] * count
    for row, (episode, length) in enumerate(zip(dense, lengths.tolist(), strict=True)):
        first[episode] = row if first[episode] < 0 else first[episode]
        last[episode] = row
        rows += [row] * length
        columns += range(length)
        episodes += [episode] * length
        positions += range(offsets[episode], offsets[episode] + length)
        offsets[episode] += length
    tensors = [
        torch.tensor(values, dtype=torch.long, device=lengths.device)
        for values in (rows, columns, episodes, positions, first, last)
    ]
    return SegmentLayout(
        *tensors,
        (lengths.numel(), int(seq)),
        (count, max(offsets, default=0)),
    )


def join_segments(values: torch.Tensor, layout: SegmentLayout) -> torch.Tensor:
    """`[batch, seq, ...]` segment rows → `[episodes, episode_seq, ...]`, 0 (False) past each end."""
    values = check_tensor("values", values)
    if tuple(values.shape[:2]) != layout.shape:
        raise ValueError(f"values must have shape {list(layout.shape)} + [...], got {list(values.shape)}")
    out = values.new_zeros((*layout.joined_shape, *values.shape[2:]))
    out[layout.episodes, layout.positions] = values[layout.rows, layout.columns]
    return out


def split_segments(joined: torch.Tensor, layout: SegmentLayout) -> torch.Tensor:
    """The inverse of `join_segments`: `[episodes, episode_seq, ...]` → `[batch, seq, ...]`, 0 on padding."""
    joined = check_tensor("joined", joined)
    if tuple(joined.shape[:2]) != layout.joined_shape:
        raise ValueError(
            f"joined must have shape {list(layout.joined_shape)} + [...], got {list(joined.shape)}"
        )
    out = joined.new_zeros((*layout.shape, *joined.shape[2:]))
    out[layout.rows, layout.columns] = joined[layout.episodes, layout.positions]
    return out
