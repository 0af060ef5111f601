"""The base of every weight receiver: `TransportReceiver` and the `RECEIVERS` registry.

A transport's receiving loop (`rl_rollout.receivers`, or a plugin's) subclasses
`TransportReceiver` and registers with `@RECEIVERS.register("name")`; `rl_rollout.weights`
builds one from a spec (`WeightReceiver`). They live here so that the receivers import them
without importing `rl_rollout.weights`, which imports the receivers.
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar

import torch

from rl_algos import Registry
from rl_data import WeightSyncMeta, WeightSyncReport
from rl_data.sync import Consume, WeightSyncSpec

__all__ = ["RECEIVERS", "TransportReceiver"]


class TransportReceiver(abc.ABC):
    """One transport's receiving loop, built once per engine worker from the spec.

    The constructor joins the transport (a process group blocks there until every rank joined).
    `receive(version, consume, payload, hold)` runs one sync, handing each verified bucket to
    `consume(bucket, tensors)`, and returns the receiver's `WeightSyncReport`. `device`: where
    the engine would like received buffers (a transport may ignore it).

    payload_type: the msgspec struct each `receive` needs from the orchestrator (the "ipc"
    transport's `IpcPayload`, one per policy rank), None when the transport carries everything.
    views_outlive_receive: whether `hold=True` keeps the views handed to `consume` valid until
    `release()` (the "shm" transport: they are the shared pages themselves).
    """

    payload_type: ClassVar[type | None] = None
    views_outlive_receive: ClassVar[bool] = False

    def __init__(
        self, spec: WeightSyncSpec, rank: int, layout: WeightSyncMeta, *, device: torch.device | str | None
    ) -> None:
        self.spec, self.rank, self.layout, self.device = spec, rank, layout, device

    @abc.abstractmethod
    def receive(self, version: int, consume: Consume, payload: Any, *, hold: bool) -> WeightSyncReport:
        """Receive one sync; raise `WeightSyncError` on a layout or checksum mismatch."""

    def release(self) -> None:  # noqa: B027 - only transports whose views outlive receive hold anything
        """Let the sender reuse what a `receive(..., hold=True)` kept."""

    def close(self) -> None:  # noqa: B027 - a transport without resources has nothing to release
        """Leave the transport (a process group, a mapping)."""


RECEIVERS = Registry("weight-sync receiver")
"""transport name -> `TransportReceiver` subclass (`rl_rollout.receivers` holds the built-ins)."""
