"""Outcome-reward normalisation within groups of responses to the same prompt.

GRPO, Dr.GRPO, RLOO, REINFORCE++-baseline and their variants differ only in how a scalar
reward is centred and scaled, so one vectorised function with those knobs serves them all:

    A_i = (r_i − c_i) / (s_i + ε)   where s_i > 0,   A_i = r_i − c_i   where s_i = 0

  centre c_i:  "group"          mean of i's group
               "leave_one_out"  mean of the other members of i's group (RLOO)
               "batch"          mean of the whole batch
               "none"           0
  scale  s_i:  "group_std"          std of i's group (unbiased: N − 1)
               "leave_one_out_std"  std of the other members of i's group (NeMo-RL)
               "batch_std"          std of the whole batch
               "none"               no scaling

A zero scale leaves the centred value unscaled instead of dividing by ε alone: with a group
centre a zero-variance group is already 0 everywhere, and with a leave-one-out centre the
value stays finite (NeMo-RL's rule). The result is never NaN.

Group membership is explicit: `group_ids[i]` is any integer naming i's prompt group (verl keys
by uid; TRL assumes contiguous blocks; NeMo-RL compares prompt ids). Row order never matters.

A group of one has no group baseline. `singleton` says what to do, with one meaning across
every group estimator of `rl_algos.estimators`: "zero" (the baseline is r_i itself, A_i = 0: TRL,
NeMo-RL; the default), "raw" (the baseline is 0, A_i = r_i: verl, which uses mean 0 and std 1
there) or "error".

Statistics are computed in float64 (they are over `[batch]` vectors, so this is cheap) and the
result is returned in float32 (float64 if the rewards are float64).
"""

from __future__ import annotations

import torch

from ._checks import check_choice, check_integer, check_positive, check_rewards, check_same_shape

__all__ = [
    "CENTRES",
    "GROUP_NORM_PRESETS",
    "SCALES",
    "SINGLETON_POLICIES",
    "GroupStats",
    "fill_singletons",
    "group_normalize",
    "group_stats",
]

CENTRES = ("group", "leave_one_out", "batch", "none")
SCALES = ("group_std", "leave_one_out_std", "batch_std", "none")
SINGLETON_POLICIES = ("zero", "raw", "error")

GROUP_NORM_PRESETS: dict[str, dict[str, object]] = {
    # (r − mean_g) / (std_g + ε), unbiased std; a group of one passes r through.
    "verl": {"centre": "group", "scale": "group_std", "unbiased": True, "epsilon": 1e-6, "singleton": "raw"},
    "trl": {"centre": "group", "scale": "group_std", "unbiased": True, "epsilon": 1e-4, "singleton": "zero"},
    "openrlhf": {
        "centre": "group",
        "scale": "group_std",
        "unbiased": True,
        "epsilon": 1e-9,
        "singleton": "zero",
    },
    # Leave-one-out mean and the (population) std of the other members; divide only where > 0.
    "nemo_rl": {
        "centre": "leave_one_out",
        "scale": "leave_one_out_std",
        "unbiased": False,
        "epsilon": 1e-6,
        "singleton": "zero",
    },
}
"""Named settings of `group_normalize` that reproduce each framework's GRPO advantages."""


class GroupStats:
    """Per-sample views of group statistics (all `[batch]`, float64).

    Attributes:
      inverse: index of each sample's group in `0..num_groups-1`.
      size: number of members in the sample's group.
      mean: mean of the group.
      centred: r_i − mean of the group.
      sum_sq: Σ_j (r_j − mean)² over the group.
    """

    __slots__ = ("centred", "inverse", "mean", "num_groups", "size", "sum_sq")

    def __init__(self, rewards: torch.Tensor, group_ids: torch.Tensor) -> None:
        r = rewards.to(torch.float64)
        _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
        num_groups = counts.numel()
        sums = torch.zeros(num_groups, dtype=torch.float64, device=r.device).index_add_(0, inverse, r)
        group_mean = sums / counts
        self.inverse = inverse
        self.num_groups = num_groups
        self.size = counts[inverse].to(torch.float64)
        self.mean = group_mean[inverse]
        # Two passes (centre, then square) rather than E[r²] − E[r]², which cancels badly.
        self.centred = r - self.mean
        squares = torch.zeros_like(group_mean).index_add_(0, inverse, self.centred**2)
        self.sum_sq = squares[inverse]

    def std(self, *, unbiased: bool) -> torch.Tensor:
        dof = self.size - 1 if unbiased else self.size
        return (self.sum_sq / dof.clamp(min=1)).sqrt()

    def leave_one_out_mean(self) -> torch.Tensor:
        """Mean of the other members: mean − d_i/(K − 1) with d_i = r_i − mean (K ≥ 2)."""
        return self.mean - self.centred / (self.size - 1).clamp(min=1)

    def leave_one_out_std(self, *, unbiased: bool) -> torch.Tensor:
        """Std of the other members.

        With d_j = r_j − mean over the whole group and S = Σ_j d_j², the others' sum of squared
        deviations from their own mean is S − d_i²·K/(K − 1); no second pass is needed.
        """
        k = self.size
        others = k - 1
        sum_sq = (self.sum_sq - self.centred**2 * k / others.clamp(min=1)).clamp(min=0)
        dof = others - 1 if unbiased else others
        return (sum_sq / dof.clamp(min=1)).sqrt()


def group_stats(rewards: torch.Tensor, group_ids: torch.Tensor) -> GroupStats:
    """Group statistics of `rewards` `[batch]` keyed by `group_ids` `[batch]` (checked)."""
    _check_rewards_and_groups(rewards, group_ids)
    return GroupStats(rewards, group_ids)


def group_normalize(
    rewards: torch.Tensor,
    group_ids: torch.Tensor | None = None,
    *,
    centre: str = "group",
    scale: str = "group_std",
    unbiased: bool = True,
    epsilon: float = 1e-6,
    singleton: str = "zero",
) -> torch.Tensor:
    """Centre and scale scalar rewards within groups (see the module docstring for the knobs).

    Worked values (one group, r = [1, 0, 0.5, 0], mean 0.375, unbiased std 0.478714):
    group/group_std → [1.305580, −0.783348, 0.261116, −0.783348] (verl, ε = 1e-6);
    group/none → [0.625, −0.375, 0.125, −0.375] (Dr.GRPO);
    leave_one_out/none → [0.833333, −0.5, 0.166667, −0.5] (RLOO).

    Args:
      rewards: `[batch]` float scalar rewards, finite.
      group_ids: `[batch]` integer group of each sample; may be None only when neither the
        centre nor the scale is group based.
      centre: one of `CENTRES`.
      scale: one of `SCALES`.
      unbiased: divide squared deviations by N − 1 (N − 2 for leave-one-out) instead of N.
      epsilon: added to a positive scale, > 0.
      singleton: what a group of one gets: "zero", "raw" (r itself) or "error".

    Returns:
      `[batch]` advantages, float32 (float64 for float64 rewards).
    """
    check_choice("centre", centre, CENTRES)
    check_choice("scale", scale, SCALES)
    check_choice("singleton", singleton, SINGLETON_POLICIES)
    check_positive("epsilon", epsilon)
    out_dtype = torch.float64 if rewards.dtype == torch.float64 else torch.float32
    grouped = centre in ("group", "leave_one_out") or scale in ("group_std", "leave_one_out_std")
    if group_ids is None:
        if grouped:
            raise ValueError(f"group_ids is required for centre={centre!r} and scale={scale!r}")
        check_rewards("rewards", rewards)
    else:
        _check_rewards_and_groups(rewards, group_ids)

    r = rewards.to(torch.float64)
    stats = GroupStats(rewards, group_ids) if grouped else None
    if centre == "group":
        centred = stats.centred
    elif centre == "leave_one_out":
        centred = r - stats.leave_one_out_mean()
    elif centre == "batch":
        centred = r - r.mean()
    else:
        centred = r

    if scale == "group_std":
        spread = stats.std(unbiased=unbiased)
    elif scale == "leave_one_out_std":
        spread = stats.leave_one_out_std(unbiased=unbiased)
    elif scale == "batch_std":
        spread = r.std(correction=1 if unbiased and r.numel() > 1 else 0).expand_as(r)
    else:
        spread = None

    advantages = centred if spread is None else torch.where(spread > 0, centred / (spread + epsilon), centred)

    if stats is not None:
        advantages = fill_singletons(advantages, r, stats, group_ids, singleton)
    return advantages.to(out_dtype)


def fill_singletons(
    advantages: torch.Tensor,
    rewards: torch.Tensor,
    stats: GroupStats,
    group_ids: torch.Tensor,
    singleton: str,
) -> torch.Tensor:
    """Apply the `singleton` policy to the members of groups of one (`[batch]` tensors).

    "zero": A = 0 (the baseline is r itself); "raw": A = r (the baseline is 0, verl);
    "error": raise, naming some of the lonely group ids.
    """
    check_choice("singleton", singleton, SINGLETON_POLICIES)
    alone = stats.size == 1
    if singleton == "error" and bool(alone.any()):
        lonely = group_ids[alone][:5].tolist()
        raise ValueError(
            f"group_ids has {int(alone.sum())} group(s) of one sample (e.g. {lonely}); a group "
            "baseline needs at least 2 samples per group (or pass singleton='zero' or 'raw')"
        )
    fill = rewards.to(advantages.dtype) if singleton == "raw" else torch.zeros_like(advantages)
    return torch.where(alone, fill, advantages)


def _check_rewards_and_groups(rewards: torch.Tensor, group_ids: torch.Tensor) -> None:
    check_rewards("rewards", rewards)
    check_integer("group_ids", group_ids)
    check_same_shape("group_ids", group_ids, "rewards", rewards)
