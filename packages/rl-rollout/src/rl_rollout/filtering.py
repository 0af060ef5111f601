"""DAPO dynamic sampling with refill, and reward shaping applied to rollout records.

Dynamic sampling (Yu et al., 2025, "DAPO") keeps a prompt group only when its responses disagree:

    keep group g  ⇔  low < mean_{i ∈ g}(score_i) < high        (defaults 0 and 1)

With 0/1 scores this drops all-correct and all-wrong groups, whose group-normalised advantages
are all zero. The batch is refilled with groups from new prompts until it holds `num_groups`
kept groups or `max_draws` refills were made. Groups already accepted are never dropped when
the refills run out (OpenRLHF's bug 1310 discarded them): the result is then smaller than asked
and says so (`complete=False`). Filtering uses `rl_algos.dynamic_filter_mask` on
`Trajectory.score` with the explicit `group_id`s; row order does not matter, but a group must
arrive whole in one draw.

Shaping (`shape_rewards`) applies `rl_algos.overlong_penalty` (DAPO) and
`rl_algos.stop_properly_penalty` (ProRL) to `Trajectory.reward`; `score` is left alone and the
unshaped reward is kept in `extra["unshaped_reward"]`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import islice
from typing import Any

import msgspec
import torch

from rl_algos import dynamic_filter_mask, overlong_penalty, stop_properly_penalty
from rl_data import PromptSample, Trajectory

from .episodes import episode_ends

__all__ = [
    "DynamicSampler",
    "FilterResult",
    "dynamic_sample",
    "filter_groups",
    "groups_in_order",
    "shape_rewards",
]


class FilterResult(msgspec.Struct, kw_only=True):
    """What dynamic sampling produced.

    records: the trajectories of the kept groups, group by group in order of acceptance.
    num_groups: kept groups in `records`. complete: whether `num_groups` reached the target.
    metrics: "filter/draws" (refills made), "filter/groups_seen", "filter/groups_kept"
    (accepted, before trimming), "filter/groups_filtered", "filter/groups_trimmed" (accepted
    beyond the target, left out), "filter/keep_rate".
    """

    records: list[Trajectory]
    num_groups: int
    complete: bool
    metrics: dict[str, float]


def groups_in_order(records: Sequence[Trajectory]) -> dict[int, list[Trajectory]]:
    """`records` by group id, in first-seen order (an episode's segments stay in one group)."""
    groups: dict[int, list[Trajectory]] = {}
    for record in records:
        if not isinstance(record, Trajectory):
            raise TypeError(f"records: expected Trajectory items, got {type(record).__name__}")
        groups.setdefault(record.group_id, []).append(record)
    return groups


def filter_groups(
    records: Sequence[Trajectory], *, low: float = 0.0, high: float = 1.0
) -> tuple[list[list[Trajectory]], list[list[Trajectory]]]:
    """Split `records` into kept and filtered groups (lists of a group's records, first-seen order).

    A group is kept when low < mean(score) < high (`rl_algos.dynamic_filter_mask`), the mean
    over its episodes (an episode split into segments counts once, `rl_rollout.episodes`).
    """
    groups = groups_in_order(records)
    if not groups:
        return [], []
    # one score per episode: the segments of a rewritten episode (rl_rollout.episodes) count once
    ends = {group: episode_ends(members) for group, members in groups.items()}
    ordered = [record for members in ends.values() for record in members]
    scores = torch.tensor([record.score for record in ordered], dtype=torch.float64)
    group_ids = torch.tensor([record.group_id for record in ordered], dtype=torch.int64)
    keep = dynamic_filter_mask(scores, group_ids, low=low, high=high).tolist()
    kept, filtered, position = [], [], 0
    for group, members in groups.items():
        (kept if keep[position] else filtered).append(members)
        position += len(ends[group])
    return kept, filtered


def dynamic_sample(
    records: Sequence[Trajectory],
    draw: Callable[[int], Sequence[Trajectory]] | None,
    *,
    num_groups: int,
    low: float = 0.0,
    high: float = 1.0,
    max_draws: int = 8,
    oversample: float = 1.0,
) -> FilterResult:
    """Keep groups of `records` that pass the filter; refill from `draw` until `num_groups` are kept.

    Args:
      records: the first batch of trajectories (complete groups).
      draw: `draw(k)` rolls out about k new prompts and returns their trajectories, with group
        ids not used before; an empty result means the prompts ran out. None: no refill.
      num_groups: groups wanted.
      low, high: the filter bounds on the group mean score.
      max_draws: refills at most.
      oversample: a refill asks for ceil(missing · oversample) prompts (≥ 1), to make up for
        the groups the filter will drop.

    Returns:
      a `FilterResult` with at most `num_groups` groups; accepted groups are kept even when the
      refills run out before the target is reached.
    """
    if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 1:
        raise ValueError(f"num_groups: {num_groups!r} is not allowed; expected an integer >= 1")
    if isinstance(max_draws, bool) or not isinstance(max_draws, int) or max_draws < 0:
        raise ValueError(f"max_draws: {max_draws!r} is not allowed; expected an integer >= 0")
    if not (isinstance(oversample, (int, float)) and 1.0 <= oversample < math.inf):
        raise ValueError(f"oversample: {oversample!r} is not allowed; expected a number >= 1")
    accepted: list[list[Trajectory]] = []
    seen_ids: set[int] = set()
    counts = {"seen": 0, "kept": 0, "filtered": 0}
    draws = 0

    def take(batch: Sequence[Trajectory], where: str) -> None:
        kept, filtered = filter_groups(batch, low=low, high=high)
        for members in kept + filtered:
            group_id = members[0].group_id
            if group_id in seen_ids:
                raise ValueError(
                    f"{where}: group id {group_id} was already seen; each draw needs new group ids"
                )
            seen_ids.add(group_id)
        counts["seen"] += len(kept) + len(filtered)
        counts["kept"] += len(kept)
        counts["filtered"] += len(filtered)
        accepted.extend(kept)

    take(records, "records")
    while len(accepted) < num_groups and draw is not None and draws < max_draws:
        wanted = max(1, math.ceil((num_groups - len(accepted)) * oversample))
        batch = list(draw(wanted))
        draws += 1
        if not batch:
            break
        take(batch, f"draw {draws}")
    chosen = accepted[:num_groups]
    metrics = {
        "filter/draws": float(draws),
        "filter/groups_seen": float(counts["seen"]),
        "filter/groups_kept": float(counts["kept"]),
        "filter/groups_filtered": float(counts["filtered"]),
        "filter/groups_trimmed": float(len(accepted) - len(chosen)),
        "filter/keep_rate": counts["kept"] / counts["seen"] if counts["seen"] else 0.0,
    }
    return FilterResult(
        records=[record for members in chosen for record in members],
        num_groups=len(chosen),
        complete=len(chosen) == num_groups,
        metrics=metrics,
    )


class DynamicSampler:
    """Dynamic sampling over a prompt stream: `next_batch()` returns `num_groups` kept groups.

    `rollout(prompts)` turns a list of `PromptSample`s into trajectories (e.g.
    `SingleTurnExecutor.run`, which gives each prompt a fresh group id). Prompts are taken
    from `prompts` as needed: first `num_groups`, then refills of the missing number (times
    `oversample`). When the stream ends, the groups accepted so far are returned.
    """

    def __init__(
        self,
        rollout: Callable[[list[PromptSample]], Sequence[Trajectory]],
        prompts: Iterable[PromptSample],
        *,
        num_groups: int,
        low: float = 0.0,
        high: float = 1.0,
        max_draws: int = 8,
        oversample: float = 1.0,
    ) -> None:
        if not callable(rollout):
            raise TypeError(f"rollout: expected a callable, got {type(rollout).__name__}")
        self.rollout = rollout
        self.prompts: Iterator[PromptSample] = iter(prompts)
        self.options: dict[str, Any] = {
            "num_groups": num_groups,
            "low": low,
            "high": high,
            "max_draws": max_draws,
            "oversample": oversample,
        }
        self.prompts_used = 0

    def _draw(self, count: int) -> list[Trajectory]:
        batch = list(islice(self.prompts, count))
        self.prompts_used += len(batch)
        return list(self.rollout(batch)) if batch else []

    def next_batch(self) -> FilterResult:
        """One batch of kept groups (fewer, with complete=False, when the prompts run out)."""
        first = self._draw(self.options["num_groups"])
        result = dynamic_sample(first, self._draw, **self.options)
        result.metrics["filter/prompts_used"] = float(self.prompts_used)
        return result


def shape_rewards(
    records: Sequence[Trajectory],
    *,
    max_new_tokens: int | None = None,
    overlong_buffer: int | None = None,
    overlong_factor: float = 1.0,
    stop_properly_coef: float | None = None,
) -> tuple[list[Trajectory], dict[str, float]]:
    """Records with shaped rewards, and metrics; the inputs are not modified.

    Overlong (DAPO), when `overlong_buffer` is given, with len = number of action tokens:
        r ← r − f·min(len − (max_new_tokens − buffer), buffer)/buffer   if len > max_new_tokens − buffer
    Stop-properly (ProRL), when `stop_properly_coef` c is given, for finish_reason "length":
        r ← c·r (0 ≤ c ≤ 1) or r ← c (c < 0).
    Overlong is applied first. The reward before shaping goes to extra["unshaped_reward"] (kept
    from an earlier call if already there); `score` is unchanged.
    """
    records = list(records)
    if not records:
        return [], {}
    rewards = torch.tensor([record.reward for record in records], dtype=torch.float64)
    original = rewards.clone()
    metrics: dict[str, float] = {}
    if overlong_buffer is not None:
        if max_new_tokens is None:
            raise ValueError("max_new_tokens: required when overlong_buffer is given")
        lengths = torch.tensor([record.num_actions for record in records], dtype=torch.int64)
        rewards = overlong_penalty(
            rewards,
            lengths,
            max_new_tokens=max_new_tokens,
            buffer_length=overlong_buffer,
            penalty_factor=overlong_factor,
        )
        metrics["shaping/overlong_fraction"] = float((rewards < original).double().mean())
    if stop_properly_coef is not None:
        truncated = torch.tensor([record.finish_reason == "length" for record in records], dtype=torch.bool)
        rewards = stop_properly_penalty(rewards, truncated, stop_properly_coef)
        metrics["shaping/truncated_fraction"] = float(truncated.double().mean())
    metrics["shaping/reward_delta_mean"] = float((rewards - original).mean())
    shaped = []
    for record, value in zip(records, rewards.tolist(), strict=True):
        extra = dict(record.extra)
        extra.setdefault("unshaped_reward", record.reward)
        shaped.append(msgspec.structs.replace(record, reward=value, score=record.score, extra=extra))
    return shaped, metrics
