"""The "broadcast" transport's sender: a torch.distributed group of its own with the engines' workers."""

from __future__ import annotations

from typing import Any

import torch

from rl_data import WeightSyncReport
from rl_data.sync import WeightSyncSpec
from rl_data.sync.broadcast import SyncGroup, broadcast_buckets

from ..sender_base import SENDERS, WeightSender

__all__ = ["BroadcastSender"]


@SENDERS.register("broadcast")
class BroadcastSender(WeightSender):
    """Broadcast in buckets over a `SyncGroup` with the engines' workers (gloo on CPU, NCCL on GPU).

    The sending rank joins the group described by `spec` (transport "broadcast") as rank 0; the
    constructor blocks until all `spec.world_size - 1` receivers have joined (or
    `spec.timeout_s` passes). The layout travels once, in the spec; each `send` moves a 5-word
    header, then per bucket one checksum word and the bucket (`rl_data.sync.broadcast`'s framing), and
    fails on every rank, before any bucket moves, when a receiver's layout differs.

    `device`: where the bucket buffers live; CPU for gloo, the current CUDA device for NCCL.
    """

    transport = "broadcast"

    def __init__(
        self,
        model: Any,
        spec: WeightSyncSpec,
        *,
        device: torch.device | str | None = None,
        is_sender: bool | None = None,
    ) -> None:
        super().__init__(model, spec, is_sender=is_sender)
        if device is None:
            device = "cpu" if spec.backend == "gloo" else torch.device("cuda", torch.cuda.current_device())
        self.device = torch.device(device)
        self._group = SyncGroup.from_spec(spec, 0, self.device) if self.is_sender else None

    def _send(self, version: int) -> WeightSyncReport:
        return broadcast_buckets(self._group, self.layout, self._produce, version=version)

    def close(self) -> None:
        """Leave the sync group (the receivers should close theirs too)."""
        super().close()
        group, self._group = self._group, None
        if group is not None:
            group.close()
