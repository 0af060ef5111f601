"""Episodes split into segments: which records are one episode.

An episode whose history the chat template rewrote (Qwen3-style thinking templates drop earlier
turns' reasoning; `AgentServer(history="segments")`) is trained as several records, one per
segment, each exact token-in/token-out with its own prompt. They share the episode's reward, score
and group id, and say which episode they belong to in

    record.extra["segment"] = {"episode": j, "index": k, "count": n}

(j: the episode's number within its group, k: the segment's position 0..n-1, n: segments).
A record without it is an episode of its own. Group statistics (advantages, dynamic filtering,
pass@k) count episodes, never segments: `episode_ids` keys them, `episode_ends` keeps one record
per episode (its last segment).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["SEGMENT_KEY", "episode_ends", "episode_ids", "segment_extra"]

SEGMENT_KEY = "segment"
"""The key of `Trajectory.extra` that marks a record as one segment of an episode."""


def segment_extra(episode: int, index: int, count: int) -> dict[str, int]:
    """`extra["segment"]` of segment `index` of `count` of episode number `episode` in its group."""
    if not 0 <= index < count:
        raise ValueError(f"segment index {index} is not in [0, {count})")
    return {"episode": int(episode), "index": int(index), "count": int(count)}


def _key(record: Any, position: int) -> tuple[Any, ...]:
    segment = record.extra.get(SEGMENT_KEY) if isinstance(record.extra, dict) else None
    if segment is None:
        return ("record", position)
    return ("episode", record.group_id, segment["episode"])


def episode_ids(records: Sequence[Any]) -> list[int] | None:
    """Dense episode ids `[B]` (0, 1, ... in order of first appearance): records that are segments
    of one episode (same group id and `extra["segment"]["episode"]`) share one. None when every
    record is an episode of its own (nothing to join)."""
    if not any(SEGMENT_KEY in record.extra for record in records):
        return None
    ids: dict[tuple[Any, ...], int] = {}
    return [ids.setdefault(_key(record, position), len(ids)) for position, record in enumerate(records)]


def episode_ends(records: Sequence[Any]) -> list[Any]:
    """One record per episode, in order: a record of its own, or an episode's last segment."""
    return [
        record
        for record in records
        if (segment := record.extra.get(SEGMENT_KEY)) is None or segment["index"] == segment["count"] - 1
    ]
