"""Weight-sync metadata: how a learner's parameters are laid out in flat byte buckets.

A learner sends new weights to rollout engines in buckets: flat `uint8` buffers, each holding a
run of parameters back to back. The layout (names, dtypes, shapes, byte offsets) is planned
once by `plan_buckets` and sent once as a `WeightSyncMeta`; each sync then moves only the
bucket buffers (broadcast, CUDA IPC or files, whichever strategy) plus, optionally, one checksum
per bucket. Learner and engine never import each other: they meet here.

    meta = plan_buckets((name, p.dtype, p.shape) for name, p in model.named_parameters())
    # sender, per bucket:
    buffer = pack_bucket(meta.buckets[i], state_dict)            # [B] uint8
    checksum = bucket_checksum(buffer)
    # receiver, per bucket:
    views = unpack_bucket(meta.buckets[i], received)             # name -> tensor view
    assert bucket_checksum(received) == checksum

Layout. Parameters keep the given order. Inside a bucket each parameter starts at an offset
that is a multiple of max(alignment, itemsize) bytes, so `buffer[offset:offset + nbytes]` can
be viewed as its dtype without a copy; the gap bytes are zero. A bucket's `nbytes` runs to the
end of its last parameter rounded up to the alignment (the tail), so buckets concatenate without
breaking alignment. Buckets are filled greedily up to `bucket_bytes`; a parameter whose aligned
size exceeds `bucket_bytes` gets a bucket of its own.

Bucket checksums are `rl_data.tensors.tensor_checksum` of the whole buffer, padding included:
they detect corruption in transfer, they are not cryptographic hashes.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Mapping, Sequence

import msgspec
import torch

from .errors import check_integer
from .tensors import dtype_from_name, dtype_name, supported_dtype_names, tensor_checksum
from .wire import WIRE_FORMAT, check_wire_format

__all__ = [
    "BucketMeta",
    "ParamMeta",
    "WeightSyncMeta",
    "WeightSyncReport",
    "bucket_checksum",
    "compare_checksums",
    "pack_bucket",
    "plan_buckets",
    "unpack_bucket",
]

_UINT64_MAX = (1 << 64) - 1


def _check_checksum(value: int | None, where: str) -> None:
    if value is not None and not 0 <= value <= _UINT64_MAX:
        raise ValueError(f"{where}: checksum {value} is outside [0, 2^64)")


class ParamMeta(msgspec.Struct, frozen=True):
    """One parameter inside a bucket: bytes [offset, offset + nbytes) of the bucket buffer.

    `dtype` is a wire name (`rl_data.tensors.dtype_name`), `shape` the parameter's shape, and
    nbytes = prod(shape) · itemsize(dtype).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    def __post_init__(self) -> None:
        where = f"parameter {self.name!r}"
        if self.dtype not in supported_dtype_names():
            raise ValueError(
                f"{where}: unknown dtype {self.dtype!r}; expected one of {supported_dtype_names()}"
            )
        if any(dim < 0 for dim in self.shape):
            raise ValueError(f"{where}: negative dimension in shape {self.shape}")
        if self.offset < 0:
            raise ValueError(f"{where}: negative offset {self.offset}")
        expected = math.prod(self.shape) * self.itemsize
        if self.nbytes != expected:
            raise ValueError(
                f"{where}: nbytes {self.nbytes} != prod{self.shape} * {self.itemsize} = {expected}"
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype as a `torch.dtype`."""
        return dtype_from_name(self.dtype)

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return dtype_from_name(self.dtype).itemsize

    @property
    def numel(self) -> int:
        """Number of elements, prod(shape)."""
        return math.prod(self.shape)

    @property
    def end(self) -> int:
        """One past the last byte of this parameter in its bucket."""
        return self.offset + self.nbytes


class BucketMeta(msgspec.Struct, frozen=True):
    """One flat `uint8` buffer of `nbytes` bytes holding `params` (sorted by offset, not overlapping).

    `checksum` is `bucket_checksum` of the buffer as sent, or None when not computed (layout only).
    """

    index: int
    params: tuple[ParamMeta, ...]
    nbytes: int
    checksum: int | None = None

    def __post_init__(self) -> None:
        where = f"bucket {self.index}"
        if self.index < 0:
            raise ValueError(f"{where}: negative index")
        _check_checksum(self.checksum, where)
        previous_end = 0
        for param in self.params:
            if param.offset < previous_end:
                raise ValueError(
                    f"{where}: parameter {param.name!r} at offset {param.offset} overlaps the previous one"
                )
            previous_end = param.end
        if previous_end > self.nbytes:
            raise ValueError(f"{where}: parameters end at byte {previous_end}, past nbytes {self.nbytes}")

    def names(self) -> tuple[str, ...]:
        """Parameter names in this bucket, in layout order."""
        return tuple(param.name for param in self.params)


class WeightSyncMeta(msgspec.Struct, frozen=True):
    """The full layout of one model's weights in buckets, plus per-bucket checksums when filled in.

    The layout (`layout_only()`) is sent once; `with_checksums` makes the per-sync copy.
    `version` is the policy version these weights belong to.
    """

    buckets: tuple[BucketMeta, ...]
    total_bytes: int
    version: int = 0

    def __post_init__(self) -> None:
        for position, bucket in enumerate(self.buckets):
            if bucket.index != position:
                raise ValueError(f"bucket at position {position} has index {bucket.index}")
        total = sum(bucket.nbytes for bucket in self.buckets)
        if total != self.total_bytes:
            raise ValueError(f"total_bytes {self.total_bytes} != sum of bucket sizes {total}")
        seen: set[str] = set()
        for bucket in self.buckets:
            for param in bucket.params:
                if param.name in seen:
                    raise ValueError(f"parameter {param.name!r} appears twice")
                seen.add(param.name)

    @property
    def num_params(self) -> int:
        """Number of parameters over all buckets."""
        return sum(len(bucket.params) for bucket in self.buckets)

    @property
    def checksums(self) -> tuple[int | None, ...]:
        """Per-bucket checksums (None where not filled in)."""
        return tuple(bucket.checksum for bucket in self.buckets)

    def names(self) -> tuple[str, ...]:
        """All parameter names, in layout order."""
        return tuple(param.name for bucket in self.buckets for param in bucket.params)

    def locate(self, name: str) -> tuple[int, ParamMeta]:
        """(bucket index, ParamMeta) of parameter `name`; KeyError if it is not in the layout."""
        for bucket in self.buckets:
            for param in bucket.params:
                if param.name == name:
                    return bucket.index, param
        raise KeyError(f"parameter {name!r} is not in the weight-sync layout ({self.num_params} parameters)")

    def param(self, name: str) -> ParamMeta:
        """The ParamMeta of parameter `name`; KeyError if it is not in the layout."""
        return self.locate(name)[1]

    def with_checksums(self, checksums: Sequence[int]) -> WeightSyncMeta:
        """The same layout with bucket i's checksum set to `checksums[i]` (one per bucket)."""
        checksums = tuple(checksums)
        if len(checksums) != len(self.buckets):
            raise ValueError(
                f"with_checksums: got {len(checksums)} checksums for {len(self.buckets)} buckets"
            )
        buckets = tuple(
            msgspec.structs.replace(bucket, checksum=int(checksum))
            for bucket, checksum in zip(self.buckets, checksums, strict=True)
        )
        return msgspec.structs.replace(self, buckets=buckets)

    def layout_only(self) -> WeightSyncMeta:
        """The same layout with every checksum cleared (what is sent once, up front)."""
        buckets = tuple(msgspec.structs.replace(bucket, checksum=None) for bucket in self.buckets)
        return msgspec.structs.replace(self, buckets=buckets)


class WeightSyncReport(msgspec.Struct, frozen=True):
    """What one side of a sync measured: the version, bytes moved, seconds taken, bucket checksums."""

    version: int
    num_bytes: int
    seconds: float
    checksums: tuple[int, ...]
    wire_format: int = WIRE_FORMAT
    """The wire format of the message (`rl_data.wire`); another major is refused on decode."""

    def __post_init__(self) -> None:
        check_wire_format(self.wire_format, "WeightSyncReport")
        for index, checksum in enumerate(self.checksums):
            _check_checksum(checksum, f"checksum {index}")

    @property
    def bytes_per_second(self) -> float:
        """Throughput, num_bytes / seconds (inf for an instant sync)."""
        return self.num_bytes / self.seconds if self.seconds > 0 else math.inf


def _checksum_list(value: WeightSyncMeta | WeightSyncReport | Sequence[int], side: str) -> list[int]:
    checksums = list(value.checksums if isinstance(value, (WeightSyncMeta, WeightSyncReport)) else value)
    missing = [index for index, checksum in enumerate(checksums) if checksum is None]
    if missing:
        raise ValueError(f"compare_checksums: {side} has no checksum for buckets {missing}")
    return checksums


def compare_checksums(
    sent: WeightSyncMeta | WeightSyncReport | Sequence[int],
    received: WeightSyncMeta | WeightSyncReport | Sequence[int],
) -> list[int]:
    """Indices of the buckets whose checksums differ between `sent` and `received` ([] if all match).

    Each side is a WeightSyncMeta (its bucket checksums), a WeightSyncReport or a sequence of
    ints. Raises ValueError if the two sides have different numbers of buckets or a checksum is
    missing.
    """
    sent_list = _checksum_list(sent, "sent")
    received_list = _checksum_list(received, "received")
    if len(sent_list) != len(received_list):
        raise ValueError(
            f"compare_checksums: sent has {len(sent_list)} bucket checksums, received has {len(received_list)}"
        )
    return [index for index, (a, b) in enumerate(zip(sent_list, received_list, strict=True)) if a != b]


def _align_up(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


def plan_buckets(
    params: Iterable[tuple[str, torch.dtype | str, Sequence[int]]],
    *,
    bucket_bytes: int = 256 * 2**20,
    alignment: int = 256,
    version: int = 0,
) -> WeightSyncMeta:
    """Lay parameters out in buckets of at most `bucket_bytes` bytes, in the given order.

    Greedy: a parameter goes into the current bucket at the next offset that is a multiple of
    max(alignment, itemsize) if the bucket, rounded up to `alignment`, still fits in
    `bucket_bytes`; otherwise it opens a new bucket at offset 0. A parameter whose aligned size
    alone exceeds `bucket_bytes` gets a bucket of its own. Every bucket's `nbytes` is rounded
    up to `alignment`. Checksums are left empty.

    Args:
      params: (name, dtype, shape) triples, e.g. `(n, p.dtype, p.shape) for n, p in
        model.named_parameters()`; dtype is a torch dtype or a wire name.
      bucket_bytes: target bucket size in bytes, positive.
      alignment: byte alignment of every offset, a positive power of two.
      version: policy version recorded in the metadata.

    Raises:
      ValueError naming the parameter for a duplicate name, an unknown dtype or a bad shape,
      and naming the argument for a bad `bucket_bytes` or `alignment`.
    """
    check_integer("plan_buckets: bucket_bytes", bucket_bytes, 1)
    if (
        isinstance(alignment, bool)
        or not isinstance(alignment, int)
        or alignment <= 0
        or alignment & (alignment - 1)
    ):
        raise ValueError(f"plan_buckets: alignment must be a positive power of two, got {alignment!r}")

    buckets: list[BucketMeta] = []
    current: list[ParamMeta] = []
    cursor = 0  # end of the last parameter in the current bucket
    seen: set[str] = set()

    def close() -> None:
        nonlocal current, cursor
        buckets.append(
            BucketMeta(index=len(buckets), params=tuple(current), nbytes=_align_up(cursor, alignment))
        )
        current, cursor = [], 0

    for position, entry in enumerate(params):
        try:
            name, dtype, shape = entry
        except (TypeError, ValueError):
            raise ValueError(
                f"plan_buckets: params[{position}] must be a (name, dtype, shape) triple, got {entry!r}"
            ) from None
        if not isinstance(name, str):
            raise ValueError(
                f"plan_buckets: params[{position}] name must be a str, got {type(name).__name__}"
            )
        if name in seen:
            raise ValueError(f"plan_buckets: duplicate parameter name {name!r}")
        seen.add(name)
        try:
            wire_dtype = dtype if isinstance(dtype, str) else dtype_name(dtype)
            itemsize = dtype_from_name(wire_dtype).itemsize
        except ValueError as error:
            raise ValueError(f"plan_buckets: parameter {name!r}: {error}") from None
        try:
            dims = tuple(operator.index(dim) for dim in shape)
        except (TypeError, ValueError):
            raise ValueError(
                f"plan_buckets: parameter {name!r}: shape must be a sequence of ints, got {shape!r}"
            ) from None
        if any(dim < 0 for dim in dims):
            raise ValueError(f"plan_buckets: parameter {name!r}: negative dimension in shape {dims}")
        nbytes = math.prod(dims) * itemsize
        param_alignment = max(alignment, itemsize)
        offset = _align_up(cursor, param_alignment)
        if current and _align_up(offset + nbytes, alignment) > bucket_bytes:
            close()
            offset = 0
        current.append(ParamMeta(name=name, dtype=wire_dtype, shape=dims, offset=offset, nbytes=nbytes))
        cursor = offset + nbytes
    if current:
        close()
    return WeightSyncMeta(
        buckets=tuple(buckets), total_bytes=sum(bucket.nbytes for bucket in buckets), version=version
    )


def _check_buffer(bucket: BucketMeta, buffer: torch.Tensor, argument: str) -> None:
    if not isinstance(buffer, torch.Tensor):
        raise TypeError(f"{argument}: expected a torch.Tensor, got {type(buffer).__name__}")
    if buffer.dtype != torch.uint8 or buffer.ndim != 1:
        raise ValueError(
            f"{argument}: expected a 1-D torch.uint8 tensor, got {buffer.dtype} of shape {tuple(buffer.shape)}"
        )
    if buffer.numel() != bucket.nbytes:
        raise ValueError(
            f"{argument}: bucket {bucket.index} needs {bucket.nbytes} bytes, got {buffer.numel()}"
        )
    if not buffer.is_contiguous():
        raise ValueError(f"{argument}: must be contiguous")


def _param_view(buffer: torch.Tensor, param: ParamMeta, argument: str) -> torch.Tensor:
    window = buffer[param.offset : param.end]
    try:
        return window.view(param.torch_dtype).view(param.shape)
    except RuntimeError as error:  # a buffer that starts at a misaligned storage offset
        raise ValueError(
            f"{argument}: cannot view parameter {param.name!r} as {param.dtype}: {error}"
        ) from None


def pack_bucket(
    bucket: BucketMeta, tensors: Mapping[str, torch.Tensor], *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Copy the bucket's parameters from `tensors` into one flat `[bucket.nbytes]` uint8 buffer.

    Each tensor is cast to its planned dtype; padding bytes are zero. Names in `tensors` that
    are not in the bucket are ignored, so a whole state dict can be passed. The buffer is `out`
    when given (1-D, uint8, exactly `bucket.nbytes` long), else a new one on the device of the
    bucket's first tensor (CPU for an empty bucket).

    Raises:
      KeyError naming a parameter missing from `tensors`; ValueError naming a parameter whose
      shape differs from the plan, or describing a bad `out`.
    """
    for param in bucket.params:
        if param.name not in tensors:
            raise KeyError(
                f"pack_bucket: bucket {bucket.index} needs parameter {param.name!r}, missing from tensors"
            )
        tensor = tensors[param.name]
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(
                f"pack_bucket: parameter {param.name!r} must be a torch.Tensor, got {type(tensor).__name__}"
            )
        if tuple(tensor.shape) != param.shape:
            raise ValueError(
                f"pack_bucket: parameter {param.name!r} has shape {tuple(tensor.shape)}, planned {param.shape}"
            )
    if out is None:
        device = tensors[bucket.params[0].name].device if bucket.params else torch.device("cpu")
        out = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)
    else:
        _check_buffer(bucket, out, "pack_bucket: out")
    cursor = 0
    with torch.no_grad():
        for param in bucket.params:
            if param.offset > cursor:
                out[cursor : param.offset].zero_()
            _param_view(out, param, "pack_bucket: out").copy_(tensors[param.name])
            cursor = param.end
        if bucket.nbytes > cursor:
            out[cursor:].zero_()
    return out


def unpack_bucket(bucket: BucketMeta, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
    """Views into `buffer` (a `[bucket.nbytes]` uint8 tensor), one per parameter, with its planned dtype and shape.

    No copy is made: writing to a view writes to `buffer`, and the views live as long as it.
    Raises ValueError if `buffer` has the wrong size, dtype or rank.
    """
    _check_buffer(bucket, buffer, "unpack_bucket: buffer")
    return {param.name: _param_view(buffer, param, "unpack_bucket: buffer") for param in bucket.params}


def bucket_checksum(buffer: torch.Tensor) -> int:
    """`tensor_checksum` of a whole bucket buffer, padding included (zero on both sides)."""
    return tensor_checksum(buffer)
