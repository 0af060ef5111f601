"""The "broadcast" weight-sync transport: a torch.distributed process group of its own.

`SyncGroup` is a process group outside `torch.distributed`'s default one (which the learner's
data-parallel ranks already use): rank 0 is the sender, ranks 1.. the engines' workers; gloo on
CPU, NCCL on GPU. `broadcast_buckets` (sender) and `receive_buckets` (receiver) are the two loops.
Spec fields: `host`, `port` (where rank 0 serves the rendezvous store), `world_size`, `backend`.

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
import socket
import time
from typing import Any

import torch

from ..errors import check_integer
from ..weights import BucketMeta, WeightSyncMeta, WeightSyncReport, bucket_checksum, unpack_bucket
from .base import (
    BACKENDS,
    BufferPair,
    Consume,
    Produce,
    Transport,
    WeightSyncError,
    WeightSyncSpec,
    checksum_mismatch,
    layout_fingerprint,
    register_transport,
)

__all__ = [
    "MAGIC",
    "SyncGroup",
    "broadcast_buckets",
    "free_port",
    "listening_socket",
    "local_address",
    "master_store",
    "receive_buckets",
    "reserve_port",
]

MAGIC = 0x524C5359  # "RLSY": the first word of every broadcast sync


def _check_spec(spec: WeightSyncSpec) -> None:
    check_integer("WeightSyncSpec.port", spec.port, 1)
    check_integer("WeightSyncSpec.world_size", spec.world_size, 2)


register_transport(
    Transport(
        name="broadcast",
        check=_check_spec,
        doc="a process group of 1 sender and world_size - 1 receivers at host:port (gloo or NCCL)",
    )
)


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


def listening_socket(host: str, port: int = 0) -> socket.socket:
    """A TCP socket listening at `host:port` only (port 0: the OS picks one), with SO_REUSEADDR.

    torch's `TCPStore` server binds every interface whatever host it is given; handed this socket
    (`master_store`) it listens where the run's nodes meet and nowhere else (127.0.0.1 locally).
    """
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind, proto)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(socket.SOMAXCONN)
    except BaseException:
        listener.close()
        raise
    return listener


def master_store(host: str, port: int, world_size: int | None, timeout: datetime.timedelta) -> Any:
    """The server side of a `torch.distributed.TCPStore`, listening at `host:port` only (port 0:
    the OS picks; `.port` says which). The store owns the socket from then on."""
    import torch.distributed as dist

    listener = listening_socket(host, port)
    bound = listener.getsockname()[1]
    fd = listener.detach()
    try:
        return dist.TCPStore(
            host,
            bound,
            world_size,
            is_master=True,
            wait_for_workers=False,
            timeout=timeout,
            master_listen_fd=fd,
        )
    except BaseException:
        os.close(fd)
        raise


def local_address(peer: str) -> str:
    """The IPv4 address of this machine that packets to `peer` leave from (the routing table's
    choice; a UDP `connect` sends nothing). A receiver on another node binds its gloo device
    there: binding to the sender's address (`peer` itself) fails anywhere but on the sender's node.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((peer, 9))
        return probe.getsockname()[0]


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _unsigned(value: int) -> int:
    return value + (1 << 64) if value < 0 else value


class SyncGroup:
    """A process group of its own for weight sync, outside `torch.distributed`'s default group.

    Rank 0 (the sender) hosts the rendezvous store at `host:port`, listening at that address
    only (`master_store`); every rank blocks in the
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
        if rank == 0:  # listening at `host` only, not on every interface
            self._store = master_store(host, port, world_size, timeout)
        else:
            self._store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
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
    buffers = BufferPair(meta, group.device)
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
    buffers = BufferPair(meta, group.device)

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
            failure = checksum_mismatch(bucket, got, expected, where)
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
