"""The "broadcast" transport's receiver: one rank of the sender's process group (`rl_data.sync.broadcast`)."""

from __future__ import annotations

from typing import Any

import torch

from rl_data import WeightSyncMeta, WeightSyncReport
from rl_data.sync import Consume, WeightSyncSpec
from rl_data.sync.broadcast import SyncGroup, receive_buckets

from ..receiver_base import RECEIVERS, TransportReceiver

__all__ = ["BroadcastReceiver"]


@RECEIVERS.register("broadcast")
class BroadcastReceiver(TransportReceiver):
    """Joins the group as `rank` in the constructor (blocks until every rank joined); buffers on
    `device` (None: CPU for gloo, the current GPU for NCCL)."""

    def __init__(
        self, spec: WeightSyncSpec, rank: int, layout: WeightSyncMeta, *, device: torch.device | str | None
    ) -> None:
        super().__init__(spec, rank, layout, device=device)
        self._group: SyncGroup | None = SyncGroup.from_spec(spec, rank, device)

    def receive(self, version: int, consume: Consume, payload: Any, *, hold: bool) -> WeightSyncReport:
        return receive_buckets(self._group, self.layout, consume)

    def close(self) -> None:
        group, self._group = self._group, None
        if group is not None:
            group.close()
