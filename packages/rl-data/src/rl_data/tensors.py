"""Tensors on the wire: a dtype table, a compact binary codec and a device-side checksum.

Every `rl_data` message that carries a tensor (trajectories, weight-sync buckets) uses the same
three pieces:

- A table of supported dtypes, each with a stable name (`"bfloat16"`) and a one-byte wire code.
  Names and codes never change meaning, so a message written by one torch version decodes under
  another; dtypes the installed torch lacks (unsigned 16/32/64-bit, float8) are left out of the
  table rather than given a different code.
- `encode_tensor` / `decode_tensor`: the payload of one msgpack extension value,

      byte 0        dtype code (see `DTYPE_CODES`)
      byte 1        ndim, 0..255
      bytes 2..     shape, ndim little-endian int64s
      rest          the raw bytes of the tensor, C-contiguous, prod(shape) * itemsize bytes

  The raw bytes are taken through a `uint8` view, so bfloat16 and float8 (which numpy does not
  know) travel like any other dtype, and NaN payloads and -0.0 survive bit for bit.
  The byte order is little-endian on both sides; every platform torch ships for is, and this
  module refuses to import on a big-endian host rather than silently swap bytes.
- `tensor_checksum`: a 64-bit checksum of a tensor's raw bytes, computed where the tensor lives,
  so the two ends of a weight sync can compare what they sent and what they received.
"""

from __future__ import annotations

import math
import struct
import sys

import msgspec
import torch

from .errors import check_integer

__all__ = [
    "DEFAULT_CHECKSUM_ROW_WORDS",
    "DTYPE_CODES",
    "TENSOR_EXT_CODE",
    "TENSOR_HEADER_FORMAT",
    "decode_tensor",
    "dtype_from_name",
    "dtype_itemsize",
    "dtype_name",
    "encode_tensor",
    "supported_dtype_names",
    "tensor_checksum",
]

if sys.byteorder != "little":  # pragma: no cover - no such host in CI
    raise ImportError(
        f"rl_data.tensors assumes a little-endian host (the wire format is little-endian), got {sys.byteorder!r}"
    )

TENSOR_EXT_CODE = 1
"""msgpack extension type code under which `rl_data.serialization` stores `encode_tensor` payloads."""

# Stable names and wire codes. Append only: a code, once given, keeps its meaning forever.
_DTYPE_TABLE: tuple[tuple[str, int], ...] = (
    ("bool", 1),
    ("uint8", 2),
    ("int8", 3),
    ("int16", 4),
    ("int32", 5),
    ("int64", 6),
    ("float16", 7),
    ("bfloat16", 8),
    ("float32", 9),
    ("float64", 10),
    ("uint16", 11),
    ("uint32", 12),
    ("uint64", 13),
    ("float8_e4m3fn", 14),
    ("float8_e5m2", 15),
)

DTYPE_CODES: dict[str, int] = {name: code for name, code in _DTYPE_TABLE if hasattr(torch, name)}
"""Stable name -> one-byte wire code, for the dtypes the installed torch has."""

_NAME_TO_DTYPE: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_CODES}
_DTYPE_TO_NAME: dict[torch.dtype, str] = {dtype: name for name, dtype in _NAME_TO_DTYPE.items()}
_CODE_TO_DTYPE: dict[int, torch.dtype] = {DTYPE_CODES[name]: dtype for name, dtype in _NAME_TO_DTYPE.items()}

TENSOR_HEADER_FORMAT = "<BB"
"""struct format of the fixed part of the header: dtype code, ndim. The shape (`<{ndim}q`) follows."""
_FIXED = struct.Struct(TENSOR_HEADER_FORMAT)
_MAX_NDIM = 255
# One compiled struct per rank: the whole header, and the shape alone (read after the fixed part).
_HEADERS = [struct.Struct(f"<BB{ndim}q") for ndim in range(_MAX_NDIM + 1)]
_SHAPES = [struct.Struct(f"<{ndim}q") for ndim in range(_MAX_NDIM + 1)]
# Dtypes whose CPU tensors `Tensor.numpy()` can view directly (the fast path of `encode_tensor`).
_NUMPY_DTYPES = frozenset(
    getattr(torch, name)
    for name in ("bool", "uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64")
)


def supported_dtype_names() -> tuple[str, ...]:
    """The stable names of every dtype this torch build can send, in wire-code order."""
    return tuple(DTYPE_CODES)


def dtype_name(dtype: torch.dtype) -> str:
    """Stable wire name of a torch dtype: `torch.bfloat16` -> `"bfloat16"`.

    Raises ValueError for dtypes that have no wire name (complex, quantized, sub-byte).
    """
    try:
        return _DTYPE_TO_NAME[dtype]
    except (KeyError, TypeError):
        raise ValueError(
            f"dtype {dtype!r} is not supported on the wire; supported: {', '.join(DTYPE_CODES)}"
        ) from None


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype for a stable wire name: `"bfloat16"` -> `torch.bfloat16`.

    Raises ValueError naming the allowed names when `name` is not one of them.
    """
    try:
        return _NAME_TO_DTYPE[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown dtype name {name!r}; expected one of: {', '.join(DTYPE_CODES)}") from None


def dtype_itemsize(dtype: torch.dtype | str) -> int:
    """Bytes per element of a dtype given as a torch dtype or a wire name (`bool` is 1)."""
    if isinstance(dtype, str):
        dtype = dtype_from_name(dtype)
    else:
        dtype_name(dtype)  # refuses dtypes without a wire name
    return dtype.itemsize


def _raw_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of `tensor` as a flat, contiguous `uint8` tensor on its own device (no copy if possible)."""
    flat = tensor.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8)


def encode_tensor(tensor: torch.Tensor) -> msgspec.msgpack.Ext:
    """`tensor` as a msgpack extension value (code `TENSOR_EXT_CODE`); see the module docstring.

    Accepts any shape (0-d and empty included), any strides (non-contiguous tensors are made
    contiguous) and any device (other devices are copied to the CPU first). Gradients are not
    kept: the value is detached. The payload is built with one copy of the data.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"encode_tensor: expected a torch.Tensor, got {type(tensor).__name__}")
    dtype = tensor.dtype
    code = DTYPE_CODES[dtype_name(dtype)]
    shape = tensor.shape
    if len(shape) > _MAX_NDIM:  # pragma: no cover - torch itself caps dimensions lower
        raise ValueError(f"encode_tensor: at most {_MAX_NDIM} dimensions, got {len(shape)}")
    header = _HEADERS[len(shape)].pack(code, len(shape), *shape)
    if tensor.device.type != "cpu":
        tensor = tensor.detach().to("cpu")
    if tensor.numel() == 0:
        return msgspec.msgpack.Ext(TENSOR_EXT_CODE, header)
    if dtype in _NUMPY_DTYPES and tensor.is_contiguous():
        # Cheapest route for the common case: numpy's view of the tensor, no torch reshaping.
        raw = tensor.detach().numpy()
    else:
        raw = _raw_bytes(tensor).numpy()
    return msgspec.msgpack.Ext(TENSOR_EXT_CODE, b"".join((header, memoryview(raw).cast("B"))))


def decode_tensor(data: memoryview | bytes | bytearray) -> torch.Tensor:
    """The tensor in an `encode_tensor` payload, as a new CPU tensor that owns writable memory.

    The bytes are copied out of `data`, so the message buffer can be released or reused.
    Raises ValueError saying which check failed: header length, dtype code, a negative
    dimension, the payload length against prod(shape) * itemsize, or a bool byte other than 0/1.
    """
    view = memoryview(data).cast("B")
    size = len(view)
    if size < _FIXED.size:
        raise ValueError(f"tensor payload: header needs at least {_FIXED.size} bytes, got {size}")
    code, ndim = _FIXED.unpack_from(view, 0)
    dtype = _CODE_TO_DTYPE.get(code)
    if dtype is None:
        known = ", ".join(f"{c} ({n})" for n, c in DTYPE_CODES.items())
        raise ValueError(f"tensor payload: unknown dtype code {code}; known codes: {known}")
    shape_format = _SHAPES[ndim]
    start = _FIXED.size + shape_format.size
    if size < start:
        raise ValueError(
            f"tensor payload: header with ndim={ndim} needs {start} bytes, the payload has only {size}"
        )
    shape = shape_format.unpack_from(view, _FIXED.size)
    if any(dim < 0 for dim in shape):
        raise ValueError(f"tensor payload: negative dimension in shape {shape}")
    expected = math.prod(shape) * dtype.itemsize
    if size - start != expected:
        raise ValueError(
            f"tensor payload: shape {shape} of {_DTYPE_TO_NAME[dtype]} needs {expected} data bytes, "
            f"got {size - start}"
        )
    try:
        if expected == 0:
            return torch.empty(shape, dtype=dtype)
        raw = torch.empty(expected, dtype=torch.uint8)
        # Copy through a memoryview of the new tensor: torch.frombuffer on the read-only message
        # would warn, and would keep the whole message alive.
        memoryview(raw.numpy())[:] = view[start:]
        if dtype == torch.bool and bool((raw > 1).any()):
            raise ValueError("tensor payload: bool tensor holds bytes other than 0 and 1")
        return raw.view(dtype).view(shape)
    except RuntimeError as error:  # e.g. a shape whose element count overflows int64
        raise ValueError(f"tensor payload: cannot build a tensor of shape {shape}: {error}") from None


_UINT64_MASK = (1 << 64) - 1
_LENGTH_MULTIPLIER = 0x9E3779B97F4A7C15  # odd, so distinct lengths map to distinct offsets mod 2^64
DEFAULT_CHECKSUM_ROW_WORDS = 4096


def _mix64(value: int) -> int:
    """A bijection of [0, 2^64) that spreads every input bit over the output (splitmix64's finaliser)."""
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _UINT64_MASK
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _UINT64_MASK
    return value ^ (value >> 31)


def tensor_checksum(tensor: torch.Tensor, *, row_words: int = DEFAULT_CHECKSUM_ROW_WORDS) -> int:
    """A 64-bit checksum of the raw bytes of `tensor`, computed on the tensor's own device.

    It detects corruption and mix-ups in transfer; it is NOT a cryptographic hash (an adversary
    can easily build collisions). The bytes (length L, C order, little-endian) are read as
    N = ⌈L / 8⌉ 64-bit words q_0 .. q_{N-1}, the last one zero-padded, and

        s1 = Σ_i q_i                (mod 2^64)
        s2 = Σ_i (i + 1) · q_i      (mod 2^64)
        checksum = mix64(mix64(s1 + K · L) + s2  mod 2^64),   K = 0x9E3779B97F4A7C15

    where mix64 is the splitmix64 finaliser, a bijection of 64-bit integers. s1 changes when
    any single bit flips, s2 when two different words swap (tensors under 32 GiB), and the
    length term separates, e.g., 3 zero bytes from 4; folding the two sums into 64 bits keeps
    those changes except with probability about 2^-64. Integer sums do not depend on the
    reduction order, so CPU and CUDA give the same value.

    Speed: two read passes over the data and no full-size temporary. The words are viewed as a
    [M, row_words] matrix; with row sums r and column sums c,
    s2 = row_words · Σ_m m · r_m + Σ_k (k + 1) · c_k, so only vectors of length M and row_words
    are weighted (about 4 GB/s on 2 CPU cores, where a memcpy moves about 10).

    Args:
      tensor: any strided tensor of a wire dtype (non-contiguous inputs are copied first).
      row_words: width of the matrix view, positive; it does not change the value.

    Returns:
      The checksum, an int in [0, 2^64).
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor_checksum: expected a torch.Tensor, got {type(tensor).__name__}")
    check_integer("tensor_checksum: row_words", row_words, 1)
    raw = _raw_bytes(tensor)
    length = raw.numel()
    device = raw.device
    full_words, tail = divmod(length, 8)
    body = raw[: 8 * full_words]
    try:
        words = body.view(torch.int64)
    except RuntimeError:  # storage offset not a multiple of 8: copy to realign
        words = body.clone().view(torch.int64)
    s1 = torch.zeros((), dtype=torch.int64, device=device)
    s2 = torch.zeros((), dtype=torch.int64, device=device)
    rows = full_words // row_words
    if rows:
        matrix = words[: rows * row_words].view(rows, row_words)
        row_sums, column_sums = matrix.sum(dim=1), matrix.sum(dim=0)
        s1 += row_sums.sum()
        s2 += (row_sums * torch.arange(rows, dtype=torch.int64, device=device)).sum() * row_words
        s2 += (column_sums * torch.arange(1, row_words + 1, dtype=torch.int64, device=device)).sum()
    start = rows * row_words
    if start < full_words:
        rest = words[start:]
        s1 += rest.sum()
        s2 += (rest * torch.arange(start + 1, full_words + 1, dtype=torch.int64, device=device)).sum()
    if tail:
        last = torch.zeros(8, dtype=torch.uint8, device=device)
        last[:tail] = raw[8 * full_words :]
        word = last.view(torch.int64)[0]
        s1 += word
        s2 += word * (full_words + 1)
    sums = torch.stack([s1, s2]).tolist()
    first, second = (value & _UINT64_MASK for value in sums)
    return _mix64((_mix64((first + _LENGTH_MULTIPLIER * length) & _UINT64_MASK) + second) & _UINT64_MASK)
