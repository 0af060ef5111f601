"""From scalar outcome rewards to what the estimators consume: shaping and token rewards.

Shaping works on `[batch]` scalar rewards before advantages are computed:
  - `clip_rewards`: clamp to a range (OpenRLHF clips to [−10, 10]);
  - `overlong_penalty`: DAPO's soft penalty for responses close to the length limit;
  - `stop_properly_penalty`: ProRL's treatment of responses cut off by the length limit;
  - `dynamic_filter_mask`: DAPO dynamic sampling, which keeps only groups whose scores differ.
`token_level_rewards` then lays the scalar reward on each sample's last action token and the KL
penalty on every action token, for GAE and REINFORCE++.
"""

from __future__ import annotations

import torch

from ._checks import (
    check_integer,
    check_ndim,
    check_positive,
    check_rewards,
    check_rows,
    check_same_shape,
    check_tensor,
)
from .group import group_stats
from .masked import last_action_index

__all__ = [
    "clip_rewards",
    "dynamic_filter_mask",
    "overlong_penalty",
    "stop_properly_penalty",
    "token_level_rewards",
]


def clip_rewards(rewards: torch.Tensor, low: float = -10.0, high: float = 10.0) -> torch.Tensor:
    """clamp(r, low, high) for `[batch]` rewards; `low` < `high`."""
    check_rewards("rewards", rewards)
    if not low < high:
        raise ValueError(f"low must be < high, got low={low}, high={high}")
    return rewards.clamp(min=low, max=high)


def token_level_rewards(
    rewards: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    reward_clip: float | None = 10.0,
) -> torch.Tensor:
    """Per-token rewards for PPO / REINFORCE++ with the KL penalty in the reward (OpenRLHF).

        r_t = −β·KL_t·m_t + [t = last action token]·clip(r, −c, c)

    Args:
      rewards: `[batch]` scalar outcome rewards (after shaping), finite.
      action_mask: `[batch, seq]` 1 on tokens the policy chose; every row needs one.
      kl: optional `[batch, seq]` per-token KL estimate (see `kl_penalty`), detached.
      kl_coef: β ≥ 0.
      reward_clip: c > 0, or None for no clipping.

    Returns:
      `[batch, seq]` float32 token rewards, zero off the action tokens.
    """
    check_rewards("rewards", rewards)
    check_ndim("action_mask", action_mask, 2, "[batch, seq]")
    check_rows("action_mask", action_mask, "rewards", rewards)
    check_positive("kl_coef", kl_coef, allow_zero=True)
    mask = action_mask.to(torch.float32)
    scalar = rewards.float()
    if reward_clip is not None:
        check_positive("reward_clip", reward_clip)
        scalar = scalar.clamp(-reward_clip, reward_clip)
    last = last_action_index(mask, "action_mask")
    out = torch.zeros_like(mask)
    out.scatter_(1, last[:, None], scalar[:, None])
    if kl is not None:
        check_same_shape("kl", kl, "action_mask", action_mask)
        out = out - kl_coef * kl.detach().float() * mask
    return out


def overlong_penalty(
    rewards: torch.Tensor,
    response_lengths: torch.Tensor,
    *,
    max_new_tokens: int,
    buffer_length: int,
    penalty_factor: float = 1.0,
) -> torch.Tensor:
    """DAPO soft overlong punishment (Yu et al., 2025).

    With L_max = `max_new_tokens`, L_buf = `buffer_length`, f = `penalty_factor`:
        r ← r − f·min(len − (L_max − L_buf), L_buf) / L_buf   if len > L_max − L_buf.
    The penalty grows linearly from 0 to f over the last L_buf tokens.

    Args:
      rewards: `[batch]` float.
      response_lengths: `[batch]` integer response lengths in tokens.
    """
    check_rewards("rewards", rewards)
    check_integer("response_lengths", response_lengths)
    check_same_shape("response_lengths", response_lengths, "rewards", rewards)
    if not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if not isinstance(buffer_length, int) or not 0 < buffer_length <= max_new_tokens:
        raise ValueError(
            f"buffer_length must be an int in (0, max_new_tokens={max_new_tokens}], got {buffer_length!r}"
        )
    check_positive("penalty_factor", penalty_factor, allow_zero=True)
    excess = (response_lengths.to(rewards.dtype) - (max_new_tokens - buffer_length)).clamp(
        min=0, max=buffer_length
    )
    return rewards - penalty_factor * excess / buffer_length


def stop_properly_penalty(rewards: torch.Tensor, truncated: torch.Tensor, coefficient: float) -> torch.Tensor:
    """ProRL penalty for samples cut by the length limit (Liu et al., 2025).

    For truncated samples: r ← c·r if 0 ≤ c ≤ 1, r ← c if c < 0; others keep r.

    Args:
      rewards: `[batch]` float.
      truncated: `[batch]` bool, True where generation stopped at the length limit.
      coefficient: c ≤ 1.
    """
    check_rewards("rewards", rewards)
    check_tensor("truncated", truncated)
    check_same_shape("truncated", truncated, "rewards", rewards)
    if truncated.dtype != torch.bool:
        raise TypeError(f"truncated must be a bool tensor, got dtype {truncated.dtype}")
    if not coefficient <= 1:
        raise ValueError(
            f"coefficient must be <= 1 (a scale in [0, 1] or a fixed reward < 0), got {coefficient}"
        )
    penalised = rewards * coefficient if coefficient >= 0 else torch.full_like(rewards, coefficient)
    return torch.where(truncated, penalised, rewards)


def dynamic_filter_mask(
    scores: torch.Tensor, group_ids: torch.Tensor, *, low: float = 0.0, high: float = 1.0
) -> torch.Tensor:
    """DAPO dynamic sampling: keep a group only if low < mean(group scores) < high.

    With 0/1 scores and the defaults this drops groups that are all right or all wrong, whose
    group-normalised advantages are all zero. Refill the batch from new prompts without
    dropping groups already accepted (OpenRLHF's bug 1310).

    Args:
      scores: `[batch]` float task scores (often the unshaped reward).
      group_ids: `[batch]` integer group of each sample.

    Returns:
      `[batch]` bool, True for samples whose group is kept.
    """
    if not low < high:
        raise ValueError(f"low must be < high, got low={low}, high={high}")
    stats = group_stats(scores, group_ids)
    return (stats.mean > low) & (stats.mean < high)
