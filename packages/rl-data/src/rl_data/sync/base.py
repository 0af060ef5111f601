"""What every weight-sync transport shares: the spec both sides get, the registry of transports by
name, the layout fingerprint and the bucket buffers and checks each transport's loops use.

A transport is registered here by name (`register_transport`, a `Transport` entry); its spec
checks run when a `WeightSyncSpec` naming it is built or decoded, so the name must be registered
in every process that builds or decodes such a spec (a plugin module imported there).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import msgspec
import torch

from ..adapters import LoraAdapter
from ..serialization import encode
from ..tensors import tensor_checksum
from ..weights import BucketMeta, WeightSyncMeta, bucket_checksum
from ..wire import WIRE_FORMAT, check_wire_format

__all__ = [
    "BACKENDS",
    "TRANSPORTS",
    "Consume",
    "Produce",
    "Transport",
    "WeightSyncError",
    "WeightSyncSpec",
    "layout_fingerprint",
    "register_transport",
]

BACKENDS = ("gloo", "nccl")

Produce = Callable[[BucketMeta, torch.Tensor], torch.Tensor]
"""Sender side: `produce(bucket, out)` fills `out` (`[bucket.nbytes]` uint8) and returns it."""
Consume = Callable[[BucketMeta, Mapping[str, torch.Tensor]], None]
"""Receiver side: `consume(bucket, tensors)` applies one verified bucket (views: copy them)."""


class WeightSyncError(RuntimeError):
    """A sync that cannot go on: layouts that disagree, a corrupt bucket, a missing file."""


def _no_check(spec: WeightSyncSpec) -> None:
    """A transport that needs no field beyond `layout` and `timeout_s`."""


@dataclasses.dataclass(frozen=True)
class Transport:
    """One weight-sync transport as the wire spec knows it.

    name: what `WeightSyncSpec.transport` says. check: `check(spec)` raises ValueError naming the
    field of `spec` this transport needs and did not get (the built-ins' fields are `host`, `port`,
    `world_size`, `backend`, `directory`; a plugin's own go in `spec.options`). doc: one line for
    listings. The sender (`rl_learner.SENDERS`) and the receiver (`rl_rollout.RECEIVERS`) are
    registered under the same name on their own side.
    """

    name: str
    check: Callable[[WeightSyncSpec], None] = _no_check
    doc: str = ""


class _Transports(dict):
    """name -> `Transport`, in registration order; a taken name is refused unless `override`."""

    def register(self, transport: Transport, *, override: bool = False) -> Transport:
        if not isinstance(transport, Transport):
            raise TypeError(f"register_transport: expected a Transport, got {type(transport).__name__}")
        if not transport.name or not isinstance(transport.name, str):
            raise TypeError(
                f"register_transport: a transport name must be a non-empty str, got {transport.name!r}"
            )
        if transport.name in self and not override:
            raise ValueError(
                f"weight-sync transport {transport.name!r} is already registered; pass override=True to replace it"
            )
        self[transport.name] = transport
        return transport


TRANSPORTS: dict[str, Transport] = _Transports()
"""Every weight-sync transport this process knows, by name (the built-ins: broadcast, ipc, file, shm)."""


def register_transport(transport: Transport, *, override: bool = False) -> Transport:
    """Add `transport` to `TRANSPORTS` (a plugin's transport: import its module in every process)."""
    return TRANSPORTS.register(transport, override=override)


class WeightSyncSpec(msgspec.Struct, frozen=True, kw_only=True):
    """How one learner and its engines move weights; the same spec is given to both sides.

    transport: a name in `TRANSPORTS`: "broadcast" (a process group of 1 sender + `world_size - 1`
    receivers at `host:port`), "ipc" (CUDA IPC handles; engines on the sender's GPUs), "file"
    (bucket files under `directory`), "shm" (shared-memory slots under `directory`, a folder of
    its own per run on a memory file system, `rl_data.sync.shm.shm_directory()`; sender and engines
    on one machine) or a plugin's. layout: the bucket layout, sent once. options: a plugin
    transport's own fields (msgspec-encodable values), checked by its `Transport.check`. A
    receiver's own rank in the group is given to it separately (1 + its offset among all engine
    workers).
    """

    transport: str
    layout: WeightSyncMeta
    host: str = "127.0.0.1"
    port: int = 0
    world_size: int = 2
    backend: str = "gloo"
    directory: str | None = None
    timeout_s: float = 600.0
    options: dict[str, Any] = msgspec.field(default_factory=dict)
    adapter: LoraAdapter | None = None
    """LoRA adapter sync (`rl_data.adapters`): the layout holds the policy's adapter tensors only
    (peft's saved names), and the engines serve them on their base weights with this
    configuration; None: the layout holds the (merged) model's weights."""
    wire_format: int = WIRE_FORMAT
    """The wire format of the message (`rl_data.wire`); another major is refused on decode."""

    def __post_init__(self) -> None:
        check_wire_format(self.wire_format, "WeightSyncSpec")
        entry = TRANSPORTS.get(self.transport)
        if entry is None:
            raise ValueError(
                f"WeightSyncSpec.transport: {self.transport!r} is not one of {tuple(TRANSPORTS)} "
                "(a plugin's transport must be registered in this process: rl_data.sync.register_transport)"
            )
        if self.backend not in BACKENDS:
            raise ValueError(f"WeightSyncSpec.backend: {self.backend!r} is not one of {BACKENDS}")
        entry.check(self)
        if not self.timeout_s > 0:
            raise ValueError(f"WeightSyncSpec.timeout_s: must be positive, got {self.timeout_s}")


def layout_fingerprint(meta: WeightSyncMeta) -> int:
    """A 63-bit fingerprint of the layout (names, dtypes, shapes, offsets; not checksums or version).

    Both sides compute it from their own copy of the layout; equal fingerprints mean the bytes
    of every bucket are read the way they were written.
    """
    data = encode(msgspec.structs.replace(meta.layout_only(), version=0))
    padded = data + b"\0" * (-len(data) % 8)
    return tensor_checksum(torch.frombuffer(bytearray(padded), dtype=torch.uint8)) & ((1 << 63) - 1)


class BufferPair:
    """Two flat uint8 buffers, each as large as the largest bucket, used alternately."""

    def __init__(self, meta: WeightSyncMeta, device: torch.device) -> None:
        size = max((bucket.nbytes for bucket in meta.buckets), default=0)
        self._buffers = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(2)]

    def slot(self, index: int, nbytes: int) -> torch.Tensor:
        return self._buffers[index % 2][:nbytes]


def checksum_mismatch(bucket: BucketMeta, got: int, expected: int, where: str) -> WeightSyncError:
    """The error for bucket `bucket` arriving with checksum `got` instead of the sender's `expected`."""
    names = ", ".join(bucket.names()[:4]) + (", ..." if len(bucket.params) > 4 else "")
    return WeightSyncError(
        f"{where}: bucket {bucket.index} ({names}) arrived with checksum {got:#018x}, "
        f"the sender's is {expected:#018x}; it was not applied"
    )


def verify_bucket(bucket: BucketMeta, buffer: torch.Tensor, expected: int, where: str) -> int:
    """`bucket_checksum(buffer)`, after checking it equals `expected` (else `checksum_mismatch`)."""
    got = bucket_checksum(buffer)
    if got != expected:
        raise checksum_mismatch(bucket, got, expected, where)
    return got
