"""The "file" weight-sync transport: bucket files in a folder both sides can read.

A fallback that works anywhere, also across machines with a shared file system; spec field
`directory`. `write_buckets` (sender) writes `directory/version-<v>/` under a temporary name and
renames it when complete; `read_buckets` (receiver) reads and verifies it bucket by bucket. A
reader does not wait for a version: the sender must have returned before the receivers start.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import time

import msgspec
import torch

from ..errors import check_integer
from ..serialization import decode, encode
from ..weights import WeightSyncMeta, WeightSyncReport, bucket_checksum, unpack_bucket
from .base import (
    BufferPair,
    Consume,
    Produce,
    Transport,
    WeightSyncError,
    WeightSyncSpec,
    layout_fingerprint,
    register_transport,
    verify_bucket,
)

__all__ = ["read_buckets", "write_buckets"]


def _check_spec(spec: WeightSyncSpec) -> None:
    if not spec.directory:
        raise ValueError("WeightSyncSpec.directory: the file transport needs a directory")


register_transport(
    Transport(name="file", check=_check_spec, doc="bucket files under directory, one version kept")
)

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
    buffers = BufferPair(meta, torch.device("cpu"))
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
    buffers = BufferPair(meta, torch.device("cpu"))
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
        checksums.append(verify_bucket(bucket, buffer, sent.checksum, f"read_buckets ({path})"))
        consume(bucket, unpack_bucket(bucket, buffer))
    return WeightSyncReport(
        version=version,
        num_bytes=meta.total_bytes,
        seconds=time.perf_counter() - start,
        checksums=tuple(checksums),
    )
