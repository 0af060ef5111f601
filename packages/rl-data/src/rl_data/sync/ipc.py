"""The "ipc" weight-sync transport: CUDA IPC handles for engines on the sender's own GPUs.

`ipc_handle` describes a bucket buffer living on one GPU so that another process on the same GPU
maps it (`open_ipc_handle`) without a copy. `share_buckets` (sender) packs every bucket into a
buffer of its own and returns an `IpcPayload` (the layout stamped with version and checksums,
one handle per bucket), which the orchestrator hands to each engine with `receive`;
`read_ipc_buckets` (receiver) maps, verifies and consumes them. No spec field beyond the layout.
"""

from __future__ import annotations

import time

import msgspec
import torch

from ..weights import WeightSyncMeta, WeightSyncReport, bucket_checksum, unpack_bucket
from .base import (
    Consume,
    Produce,
    Transport,
    WeightSyncError,
    layout_fingerprint,
    register_transport,
    verify_bucket,
)

__all__ = ["IpcHandle", "IpcPayload", "ipc_handle", "open_ipc_handle", "read_ipc_buckets", "share_buckets"]

register_transport(
    Transport(name="ipc", doc="CUDA IPC handles of the sender's GPU buffers, for engines on the same GPUs")
)


class IpcHandle(msgspec.Struct, frozen=True):
    """What another process on the same GPU needs to map a CUDA uint8 buffer (no pickle).

    The fields are those of `torch.multiprocessing.reductions.rebuild_cuda_tensor`, with the
    tensor and storage classes left out (always a plain uint8 tensor).
    """

    size: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    device: int
    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes | None
    event_sync_required: bool


def ipc_handle(buffer: torch.Tensor) -> IpcHandle:
    """Describe the CUDA uint8 `buffer` for `open_ipc_handle` in another process on the same GPU.

    The sender must keep `buffer` alive (and unchanged) until every receiver has copied it.
    """
    if not buffer.is_cuda or buffer.dtype != torch.uint8:
        raise ValueError(f"ipc_handle: needs a CUDA uint8 tensor, got {buffer.dtype} on {buffer.device}")
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(buffer)
    (_, size, stride, offset, _, _, device, handle, storage_size, storage_offset, _, ref_handle, ref_offset,
     event_handle, event_sync) = args  # fmt: skip
    return IpcHandle(
        size=tuple(size),
        stride=tuple(stride),
        storage_offset=offset,
        device=device,
        handle=handle,
        storage_size_bytes=storage_size,
        storage_offset_bytes=storage_offset,
        ref_counter_handle=ref_handle,
        ref_counter_offset=ref_offset,
        event_handle=event_handle,
        event_sync_required=event_sync,
    )


def open_ipc_handle(handle: IpcHandle) -> torch.Tensor:
    """Map the buffer that `handle` describes (a CUDA uint8 tensor sharing the sender's memory)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return rebuild_cuda_tensor(
        torch.Tensor,
        torch.Size(handle.size),
        tuple(handle.stride),
        handle.storage_offset,
        torch.storage.TypedStorage,
        torch.uint8,
        handle.device,
        handle.handle,
        handle.storage_size_bytes,
        handle.storage_offset_bytes,
        False,
        handle.ref_counter_handle,
        handle.ref_counter_offset,
        handle.event_handle,
        handle.event_sync_required,
    )


class IpcPayload(msgspec.Struct, frozen=True):
    """One CUDA IPC sync: the layout stamped with version and checksums, one handle per bucket."""

    layout: WeightSyncMeta
    handles: tuple[IpcHandle, ...]


def share_buckets(
    meta: WeightSyncMeta, produce: Produce, *, version: int, device: torch.device | str
) -> tuple[IpcPayload, list[torch.Tensor]]:
    """Sender side of a CUDA IPC sync: every bucket packed into its own buffer on `device`.

    Returns the payload to hand to the receivers (through any channel: it is a msgspec struct)
    and the buffers, which the sender must keep alive until every receiver has returned from
    `read_ipc_buckets`. Peak extra memory: the whole model in the engine's dtype.
    """
    buffers = [
        produce(bucket, torch.empty(bucket.nbytes, dtype=torch.uint8, device=device))
        for bucket in meta.buckets
    ]
    checksums = [bucket_checksum(buffer) for buffer in buffers]
    torch.cuda.synchronize(device)
    stamped = msgspec.structs.replace(meta.with_checksums(checksums), version=version)
    return IpcPayload(layout=stamped, handles=tuple(ipc_handle(buffer) for buffer in buffers)), buffers


def read_ipc_buckets(payload: IpcPayload, meta: WeightSyncMeta, consume: Consume) -> WeightSyncReport:
    """Receiver side of a CUDA IPC sync: map each bucket, verify its checksum, `consume` it."""
    start = time.perf_counter()
    if layout_fingerprint(payload.layout) != layout_fingerprint(meta):
        raise WeightSyncError("read_ipc_buckets: the sender's layout differs from this receiver's layout")
    if len(payload.handles) != len(meta.buckets):
        raise WeightSyncError(
            f"read_ipc_buckets: {len(payload.handles)} handles for {len(meta.buckets)} buckets"
        )
    checksums = []
    for bucket, sent, handle in zip(meta.buckets, payload.layout.buckets, payload.handles, strict=True):
        buffer = open_ipc_handle(handle)
        checksums.append(verify_bucket(bucket, buffer, sent.checksum, "read_ipc_buckets"))
        consume(bucket, unpack_bucket(bucket, buffer))
    torch.cuda.synchronize()
    return WeightSyncReport(
        version=payload.layout.version,
        num_bytes=meta.total_bytes,
        seconds=time.perf_counter() - start,
        checksums=tuple(checksums),
    )
