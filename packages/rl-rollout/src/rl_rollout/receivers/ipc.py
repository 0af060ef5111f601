"""The "ipc" transport's receiver: maps the sender's GPU buffers (`rl_data.sync.ipc.read_ipc_buckets`)."""

from __future__ import annotations

from typing import Any

from rl_data import WeightSyncReport
from rl_data.sync import Consume
from rl_data.sync.ipc import IpcPayload, read_ipc_buckets

from ..receiver_base import RECEIVERS, TransportReceiver

__all__ = ["IpcReceiver"]


@RECEIVERS.register("ipc")
class IpcReceiver(TransportReceiver):
    """Each `receive` takes the `IpcPayload` of the policy rank on this engine's GPU."""

    payload_type = IpcPayload

    def receive(self, version: int, consume: Consume, payload: Any, *, hold: bool) -> WeightSyncReport:
        return read_ipc_buckets(payload, self.layout, consume)
