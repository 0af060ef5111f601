"""The receiving side of weight sync, shared by every engine that can take new weights.

An engine gives a `WeightReceiver` the spec it was handed (`rl_data.transport.WeightSyncSpec`,
the same one the learner's sender holds), its rank in the sync group and a function that
applies named tensors to its model; `receive` then runs one sync over the spec's transport and
returns the receiver's `WeightSyncReport` (per-bucket checksums for the sender to compare).

    receiver = WeightReceiver(spec, rank=1, apply=lambda named: model.load_weights(named))
    report = receiver.receive(version=3)

The tensors handed to `apply` are views into a transfer buffer that is reused: `apply` must
copy them (every `load_weights` does).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch

from rl_data import BucketMeta, WeightSyncReport
from rl_data.transport import (
    IpcPayload,
    SyncGroup,
    WeightSyncError,
    WeightSyncSpec,
    read_buckets,
    read_ipc_buckets,
    receive_buckets,
)

__all__ = ["WeightReceiver"]

Apply = Callable[[Iterable[tuple[str, torch.Tensor]]], None]


class WeightReceiver:
    """Receives weight syncs over the transport `spec` names and hands each bucket to `apply`.

    For "broadcast" the constructor joins the process group, which blocks until the sender and
    every other receiver have joined (or `spec.timeout_s` passes). `device` is where received
    buffers live: CPU for gloo, this rank's GPU for NCCL and IPC.
    """

    def __init__(
        self, spec: WeightSyncSpec, rank: int, apply: Apply, *, device: torch.device | str | None = None
    ) -> None:
        self.spec, self.rank, self._apply = spec, rank, apply
        self.layout = spec.layout.layout_only()
        self._group = SyncGroup.from_spec(spec, rank, device) if spec.transport == "broadcast" else None

    def _consume(self, bucket: BucketMeta, tensors: Mapping[str, torch.Tensor]) -> None:
        self._apply(tensors.items())

    def receive(self, version: int, payload: IpcPayload | None = None) -> WeightSyncReport:
        """Run one sync of weights `version`; raises WeightSyncError on any mismatch.

        `payload` is the sender's `IpcPayload` for the "ipc" transport and must be None otherwise.
        """
        transport = self.spec.transport
        if (payload is not None) != (transport == "ipc"):
            raise ValueError(
                f"WeightReceiver.receive: an IpcPayload goes with the 'ipc' transport only; this one is {transport!r}"
            )
        if transport == "broadcast":
            report = receive_buckets(self._group, self.layout, self._consume)
        elif transport == "file":
            report = read_buckets(self.spec.directory, self.layout, self._consume, version=version)
        else:
            report = read_ipc_buckets(payload, self.layout, self._consume)
        if report.version != version:
            raise WeightSyncError(
                f"WeightReceiver.receive: asked for version {version}, the sender sent version {report.version}"
            )
        return report

    def close(self) -> None:
        """Leave the sync group (broadcast transport)."""
        if self._group is not None:
            self._group.close()
            self._group = None
