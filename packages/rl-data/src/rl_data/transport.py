"""How weight-sync buckets travel: the framing both sides of a sync agree on.

A learner (sender, `rl_learner`) and the rollout engines (receivers, `rl_rollout`) never import
each other; they share the layout (`rl_data.weights`) and the framing defined here, for each
transport a pair of loops, one per side:

- broadcast: `SyncGroup`, a torch.distributed process group of its own (not the default one,
  which the learner's data-parallel ranks already use): rank 0 is the sender, ranks 1.. the
  engines' workers; gloo on CPU, NCCL on GPU. `broadcast_buckets` / `receive_buckets`.
- file: `write_buckets` / `read_buckets` through a folder both sides can read (a fallback that
  works anywhere, also across machines with a shared file system).
- CUDA IPC: `share_buckets` / `read_ipc_buckets`; `ipc_handle` describes a bucket buffer living
  on one GPU so that another process on the same GPU maps it (`open_ipc_handle`) without a copy.
- shm: `rl_data.shm.ShmPublisher` / `ShmReader` through a folder on a memory file system
  (/dev/shm) for a sender and receivers on the same machine: the sender packs each bucket into
  shared pages once, the receivers hand their engines views over them (no socket, no copy
  before the engine's own); see that module for the versioned slots and their cleanup.

Framing of one broadcast sync (every message is a collective on the group):

    header   int64[5]  [MAGIC, version, number of buckets, total bytes, layout fingerprint]
    then per bucket i:
      checksum int64[1]  bucket_checksum of the buffer (as a signed 64-bit value)
      buffer   uint8[meta.buckets[i].nbytes]

After the header every rank all-reduces one flag: each receiver checks the header against the
layout it was given (same fingerprint, same bucket count), and if any disagrees, every rank
raises `WeightSyncError` before a bucket is sent. A receiver checks each bucket's checksum before
it hands the bucket's tensors to its `consume` callback: from the first corrupt bucket on it
applies nothing more, still receives the rest (so the sender is never left waiting) and then
raises. Buckets applied before a failure stay applied: a failed sync needs a new one.

Both loops keep two buffers in flight: the sender packs bucket i+1 while bucket i is on the
wire, the receiver posts bucket i+1 while it applies bucket i.
"""

from __future__ import annotations

import datetime
import os
import pathlib
import shutil
import socket
import time
from collections.abc import Callable, Mapping

import msgspec
import torch

from .errors import check_integer
from .serialization import decode, encode
from .tensors import tensor_checksum
from .weights import BucketMeta, WeightSyncMeta, WeightSyncReport, bucket_checksum, unpack_bucket

__all__ = [
    "BACKENDS",
    "MAGIC",
    "TRANSPORTS",
    "IpcHandle",
    "IpcPayload",
    "SyncGroup",
    "WeightSyncError",
    "WeightSyncSpec",
    "broadcast_buckets",
    "free_port",
    "ipc_handle",
    "layout_fingerprint",
    "local_address",
    "open_ipc_handle",
    "read_buckets",
    "read_ipc_buckets",
    "receive_buckets",
    "reserve_port",
    "share_buckets",
    "write_buckets",
]

MAGIC = 0x524C5359  # "RLSY": the first word of every broadcast sync
TRANSPORTS = ("broadcast", "ipc", "file", "shm")
BACKENDS = ("gloo", "nccl")

Produce = Callable[[BucketMeta, torch.Tensor], torch.Tensor]
Consume = Callable[[BucketMeta, Mapping[str, torch.Tensor]], None]


class WeightSyncError(RuntimeError):
    """A sync that cannot go on: layouts that disagree, a corrupt bucket, a missing file."""


class WeightSyncSpec(msgspec.Struct, frozen=True, kw_only=True):
    """How one learner and its engines move weights; the same spec is given to both sides.

    transport: "broadcast" (a process group of 1 sender + `world_size - 1` receivers at
    `host:port`), "ipc" (CUDA IPC handles; engines on the sender's GPUs), "file" (bucket files
    under `directory`) or "shm" (shared-memory slots under `directory`, a folder of its own per
    run on a memory file system, `rl_data.shm.shm_directory()`; sender and engines on one
    machine). layout: the bucket layout, sent once. A receiver's own rank in the group
    is given to it separately (1 + its offset among all engine workers).
    """

    transport: str
    layout: WeightSyncMeta
    host: str = "127.0.0.1"
    port: int = 0
    world_size: int = 2
    backend: str = "gloo"
    directory: str | None = None
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"WeightSyncSpec.transport: {self.transport!r} is not one of {TRANSPORTS}")
        if self.backend not in BACKENDS:
            raise ValueError(f"WeightSyncSpec.backend: {self.backend!r} is not one of {BACKENDS}")
        if self.transport == "broadcast":
            check_integer("WeightSyncSpec.port", self.port, 1)
            check_integer("WeightSyncSpec.world_size", self.world_size, 2)
        if self.transport == "file" and not self.directory:
            raise ValueError("WeightSyncSpec.directory: the file transport needs a directory")
        if self.transport == "shm" and not self.directory:
            raise ValueError(
                "WeightSyncSpec.directory: the shm transport needs a directory of its own on a memory "
                "file system, e.g. rl_data.shm.shm_directory()"
            )
        if not self.timeout_s > 0:
            raise ValueError(f"WeightSyncSpec.timeout_s: must be positive, got {self.timeout_s}")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on `host` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def reserve_port(host: str = "") -> socket.socket:
    """A socket holding a port the OS chose on `host` ("" = every address); its port is
    `getsockname()[1]`. Close it once the real server has bound the port.

    Unlike `free_port`, nothing else can take the port in between: the socket stays bound
    (with SO_REUSEADDR, never listening), so the OS hands the port to no other `bind(0)` or
    outgoing connection, while a server that also sets SO_REUSEADDR, as torch's `TCPStore`
    does, may still bind and listen on it. Hold it on the machine that will serve the port.
    """
    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind((host, 0))
    except BaseException:
        holder.close()
        raise
    return holder


def local_address(peer: str) -> str:
    """The IPv4 address of this machine that packets to `peer` leave from (the routing table's
    choice; a UDP `connect` sends nothing). A receiver on another node binds its gloo device
    there: binding to the sender's address (`peer` itself) fails anywhere but on the sender's node.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((peer, 9))
        return probe.getsockname()[0]


def layout_fingerprint(meta: WeightSyncMeta) -> int:
    """A 63-bit fingerprint of the layout (names, dtypes, shapes, offsets; not checksums or version).

    Both sides compute it from their own copy of the layout; equal fingerprints mean the bytes
    of every bucket are read the way they were written.
    """
    data = encode(msgspec.structs.replace(meta.layout_only(), version=0))
    padded = data + b"\0" * (-len(data) % 8)
    return tensor_checksum(torch.frombuffer(bytearray(padded), dtype=torch.uint8)) & ((1 << 63) - 1)


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _unsigned(value: int) -> int:
    return value + (1 << 64) if value < 0 else value


class SyncGroup:
    """A process group of its own for weight sync, outside `torch.distributed`'s default group.

    Rank 0 (the sender) hosts the rendezvous store at `host:port`; every rank blocks in the
    constructor until all `world_size` ranks have joined or `timeout_s` passes. gloo moves CPU
    tensors, NCCL CUDA tensors (`device` is where this rank's buffers live). With gloo, rank 0
    listens at `host` and every other rank at its own address towards `host` (`local_address`),
    so the ranks may sit on different machines.
    """

    def __init__(
        self,
        *,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        backend: str = "gloo",
        timeout_s: float = 600.0,
        device: torch.device | str | None = None,
    ) -> None:
        check_integer("SyncGroup: world_size", world_size, 1)
        check_integer("SyncGroup: rank", rank, 0)
        if rank >= world_size:
            raise ValueError(f"SyncGroup: rank {rank} is outside [0, {world_size})")
        if backend not in BACKENDS:
            raise ValueError(f"SyncGroup: backend {backend!r} is not one of {BACKENDS}")
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=timeout_s)
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.device = torch.device(device if device is not None else ("cpu" if backend == "gloo" else "cuda"))
        self._store = dist.TCPStore(
            host, port, world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=False
        )
        if backend == "gloo":
            options = dist.ProcessGroupGloo._Options()
            options._timeout = timeout
            # rank 0 serves at `host`, its own address; the others at theirs towards it
            hostname = host if rank == 0 else local_address(host)
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=hostname)]
            self._group = dist.ProcessGroupGloo(self._store, rank, world_size, options)
        else:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self._group = dist.ProcessGroupNCCL(self._store, rank, world_size, options)

    @classmethod
    def from_spec(
        cls, spec: WeightSyncSpec, rank: int, device: torch.device | str | None = None
    ) -> SyncGroup:
        """Join the group that `spec` (transport "broadcast") describes as `rank`."""
        if spec.transport != "broadcast":
            raise ValueError(f"SyncGroup.from_spec: transport is {spec.transport!r}, not 'broadcast'")
        return cls(
            host=spec.host,
            port=spec.port,
            rank=rank,
            world_size=spec.world_size,
            backend=spec.backend,
            timeout_s=spec.timeout_s,
            device=device,
        )

    def broadcast(self, tensor: torch.Tensor, src: int = 0):
        """Start broadcasting `tensor` from rank `src` to every rank; returns the work to `.wait()`."""
        import torch.distributed as dist

        options = dist.BroadcastOptions()
        options.rootRank = src
        return self._group.broadcast([tensor], options)

    def all_agree(self, ok: bool) -> bool:
        """True when every rank passes `ok=True` (a blocking all-reduce of one flag)."""
        import torch.distributed as dist

        flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=self.device)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN
        self._group.allreduce([flag], options).wait()
        return bool(flag.item())

    def close(self) -> None:
        """Leave the group (the other ranks should close too)."""
        group, self._group = getattr(self, "_group", None), None
        if group is not None and hasattr(group, "shutdown"):
            group.shutdown()
        self._store = None


def _header(meta: WeightSyncMeta, version: int) -> torch.Tensor:
    return torch.tensor(
        [MAGIC, version, len(meta.buckets), meta.total_bytes, layout_fingerprint(meta)], dtype=torch.int64
    )


class _BufferPair:
    """Two flat uint8 buffers, each as large as the largest bucket, used alternately."""

    def __init__(self, meta: WeightSyncMeta, device: torch.device) -> None:
        size = max((bucket.nbytes for bucket in meta.buckets), default=0)
        self._buffers = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(2)]

    def slot(self, index: int, nbytes: int) -> torch.Tensor:
        return self._buffers[index % 2][:nbytes]


def broadcast_buckets(
    group: SyncGroup, meta: WeightSyncMeta, produce: Produce, *, version: int
) -> WeightSyncReport:
    """Sender side of a broadcast sync: every bucket of `meta`, framed as the module docstring says.

    `produce(bucket, out)` fills `out` (a `[bucket.nbytes]` uint8 tensor on the group's device,
    e.g. with `rl_data.pack_bucket(bucket, tensors, out=out)`) and returns it; this is where a
    learner gathers ZeRO-3 shards, merges LoRA and casts to the engine's dtype, one bucket at a
    time. Returns the sender's report (bytes, seconds, per-bucket checksums).
    """
    if group.rank != 0:
        raise ValueError(
            f"broadcast_buckets: the sender must be rank 0 of the group, this is rank {group.rank}"
        )
    start = time.perf_counter()
    group.broadcast(_header(meta, version).to(group.device)).wait()
    if not group.all_agree(True):
        raise WeightSyncError(
            f"broadcast_buckets: a receiver rejected the layout of version {version} "
            f"({len(meta.buckets)} buckets, {meta.total_bytes} bytes); its own error says how they differ"
        )
    buffers = _BufferPair(meta, group.device)
    checksums: list[int] = []
    in_flight: list = []
    for bucket in meta.buckets:
        out = produce(bucket, buffers.slot(bucket.index, bucket.nbytes))
        checksum = bucket_checksum(out)
        checksums.append(checksum)
        word = torch.tensor([_signed(checksum)], dtype=torch.int64, device=group.device)
        works = [group.broadcast(word), group.broadcast(out)]
        for work in in_flight:  # bucket i-1 must be out before its buffer is packed again
            work.wait()
        in_flight = works
    for work in in_flight:
        work.wait()
    return WeightSyncReport(
        version=version,
        num_bytes=meta.total_bytes,
        seconds=time.perf_counter() - start,
        checksums=tuple(checksums),
    )


def _check_header(header: list[int], meta: WeightSyncMeta, where: str) -> int:
    magic, version, num_buckets, total_bytes, fingerprint = header
    if magic != MAGIC:
        raise WeightSyncError(f"{where}: the first message is not a weight-sync header (magic {magic:#x})")
    expected = layout_fingerprint(meta)
    if (num_buckets, total_bytes, fingerprint) != (len(meta.buckets), meta.total_bytes, expected):
        raise WeightSyncError(
            f"{where}: the sender's layout ({num_buckets} buckets, {total_bytes} bytes, fingerprint "
            f"{fingerprint:#x}) differs from this receiver's ({len(meta.buckets)} buckets, "
            f"{meta.total_bytes} bytes, fingerprint {expected:#x}); give both sides the same layout"
        )
    return version


def _mismatch(bucket: BucketMeta, got: int, expected: int, where: str) -> WeightSyncError:
    names = ", ".join(bucket.names()[:4]) + (", ..." if len(bucket.params) > 4 else "")
    return WeightSyncError(
        f"{where}: bucket {bucket.index} ({names}) arrived with checksum {got:#018x}, "
        f"the sender's is {expected:#018x}; it was not applied"
    )


def _verify(bucket: BucketMeta, buffer: torch.Tensor, expected: int, where: str) -> int:
    got = bucket_checksum(buffer)
    if got != expected:
        raise _mismatch(bucket, got, expected, where)
    return got


def receive_buckets(group: SyncGroup, meta: WeightSyncMeta, consume: Consume) -> WeightSyncReport:
    """Receiver side of a broadcast sync; `consume(bucket, tensors)` applies one verified bucket.

    `tensors` maps each parameter name of the bucket to a view (planned dtype and shape) into a
    buffer that is reused two buckets later: copy out of it (e.g. `model.load_weights`), do not
    keep it. Raises WeightSyncError, naming the bucket and its parameters, on a layout or
    checksum mismatch. Returns the receiver's report with the version the sender announced.
    """
    where = f"receive_buckets (rank {group.rank})"
    start = time.perf_counter()
    header = torch.empty(5, dtype=torch.int64, device=group.device)
    group.broadcast(header).wait()
    try:
        version = _check_header(header.tolist(), meta, where)
    except WeightSyncError:
        group.all_agree(False)  # tell the sender before it sends a bucket nobody can read
        raise
    if not group.all_agree(True):
        raise WeightSyncError(f"{where}: another receiver rejected the layout; nothing was received")
    buffers = _BufferPair(meta, group.device)

    def post(bucket: BucketMeta):
        word = torch.empty(1, dtype=torch.int64, device=group.device)
        buffer = buffers.slot(bucket.index, bucket.nbytes)
        return bucket, word, buffer, [group.broadcast(word), group.broadcast(buffer)]

    checksums: list[int] = []
    failure: WeightSyncError | None = None
    pending = post(meta.buckets[0]) if meta.buckets else None
    for index in range(len(meta.buckets)):
        bucket, word, buffer, works = pending
        for work in works:
            work.wait()
        pending = post(meta.buckets[index + 1]) if index + 1 < len(meta.buckets) else None
        expected, got = _unsigned(int(word.item())), bucket_checksum(buffer)
        checksums.append(got)
        if failure is None and got != expected:
            failure = _mismatch(bucket, got, expected, where)
        if failure is None:  # from the first corrupt bucket on, keep receiving but apply nothing
            consume(bucket, unpack_bucket(bucket, buffer))
    if failure is not None:
        raise failure
    return WeightSyncReport(
        version=version,
        num_bytes=meta.total_bytes,
        seconds=time.perf_counter() - start,
        checksums=tuple(checksums),
    )


# --- file transport -------------------------------------------------------------------------------

_LAYOUT_FILE = "layout.msgpack"


def _version_dir(directory: str | os.PathLike, version: int) -> pathlib.Path:
    return pathlib.Path(directory) / f"version-{version:08d}"


def write_buckets(
    directory: str | os.PathLike, meta: WeightSyncMeta, produce: Produce, *, version: int, keep: int = 1
) -> WeightSyncReport:
    """Sender side of a file sync: `directory/version-<v>/` with one file per bucket and the layout.

    The folder is written under a temporary name and renamed when complete, so a reader never
    sees half a version; the layout file carries the per-bucket checksums. Older versions beyond
    the newest `keep` are removed.
    """
    check_integer("write_buckets: keep", keep, 1)
    start = time.perf_counter()
    final = _version_dir(directory, version)
    staging = final.with_name(f".tmp-{final.name}-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    buffers = _BufferPair(meta, torch.device("cpu"))
    checksums = []
    for bucket in meta.buckets:
        out = produce(bucket, buffers.slot(bucket.index, bucket.nbytes)).cpu()
        checksums.append(bucket_checksum(out))
        with open(staging / f"bucket-{bucket.index:05d}.bin", "wb") as handle:
            handle.write(out.numpy().tobytes())
            handle.flush()
            os.fsync(handle.fileno())
    stamped = msgspec.structs.replace(meta.with_checksums(checksums), version=version)
    (staging / _LAYOUT_FILE).write_bytes(encode(stamped))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(staging, final)
    versions = sorted(path for path in pathlib.Path(directory).glob("version-*") if path.is_dir())
    for old in versions[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return WeightSyncReport(
        version=version,
        num_bytes=meta.total_bytes,
        seconds=time.perf_counter() - start,
        checksums=tuple(checksums),
    )


def read_buckets(
    directory: str | os.PathLike, meta: WeightSyncMeta, consume: Consume, *, version: int
) -> WeightSyncReport:
    """Receiver side of a file sync: read `directory/version-<v>/`, verify, `consume` bucket by bucket.

    Raises WeightSyncError naming the folder or file when the version is missing, its layout
    differs from `meta`, a file has the wrong size or a bucket's checksum does not match.
    """
    start = time.perf_counter()
    folder = _version_dir(directory, version)
    layout_path = folder / _LAYOUT_FILE
    if not layout_path.is_file():
        raise WeightSyncError(
            f"read_buckets: {folder} has no {_LAYOUT_FILE}; version {version} was not written"
        )
    written = decode(layout_path.read_bytes(), WeightSyncMeta)
    if layout_fingerprint(written) != layout_fingerprint(meta):
        raise WeightSyncError(
            f"read_buckets: the layout in {layout_path} differs from this receiver's layout"
        )
    buffers = _BufferPair(meta, torch.device("cpu"))
    checksums = []
    for bucket, sent in zip(meta.buckets, written.buckets, strict=True):
        path = folder / f"bucket-{bucket.index:05d}.bin"
        size = path.stat().st_size if path.is_file() else None
        if size != bucket.nbytes:
            raise WeightSyncError(
                f"read_buckets: {path} holds {size} bytes, bucket {bucket.index} needs {bucket.nbytes}"
            )
        buffer = buffers.slot(bucket.index, bucket.nbytes)
        with open(path, "rb") as handle:
            handle.readinto(buffer.numpy())
        checksums.append(_verify(bucket, buffer, sent.checksum, f"read_buckets ({path})"))
        consume(bucket, unpack_bucket(bucket, buffer))
    return WeightSyncReport(
        version=version,
        num_bytes=meta.total_bytes,
        seconds=time.perf_counter() - start,
        checksums=tuple(checksums),
    )


# --- CUDA IPC -------------------------------------------------------------------------------------


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
        checksums.append(_verify(bucket, buffer, sent.checksum, "read_ipc_buckets"))
        consume(bucket, unpack_bucket(bucket, buffer))
    torch.cuda.synchronize()
    return WeightSyncReport(
        version=payload.layout.version,
        num_bytes=meta.total_bytes,
        seconds=time.perf_counter() - start,
        checksums=tuple(checksums),
    )
