"""msgpack messages between processes: msgspec for the structure, `rl_data.tensors` for tensors.

Anything msgspec can encode (Structs such as `Trajectory`, dicts, lists, tuples, strings,
numbers, None) can be sent, plus `torch.Tensor` anywhere inside it: as a Struct field, a dict
value, a list item. A tensor becomes one msgpack extension value (code `TENSOR_EXT_CODE`) whose
payload is `rl_data.tensors.encode_tensor`'s header and raw bytes; numpy arrays use the same
payload under code `NDARRAY_EXT_CODE`. No pickle is involved anywhere: decoding a message can
only build msgspec-supported values, tensors and arrays.

Decoding against a type (`decode(data, list[Trajectory])`) runs msgspec's validation and each
Struct's `__post_init__`, so a message that decodes into an invalid record (lengths that differ,
an unknown finish reason) is rejected. Every failure to decode, whatever the input bytes, is a
`DataError` whose message is msgspec's (it names the path, e.g. `$[3].group_id`), raised from
the original error.

    data = encode(trajectories)
    trajectories = decode(data, list[Trajectory])
"""

from __future__ import annotations

import functools
from typing import Any

import msgspec
import numpy as np
import torch

from .errors import DataError
from .tensors import TENSOR_EXT_CODE, decode_tensor, encode_tensor

__all__ = ["NDARRAY_EXT_CODE", "TENSOR_EXT_CODE", "Decoder", "Encoder", "decode", "encode", "encode_into"]

NDARRAY_EXT_CODE = 2
"""msgpack extension type code for numpy arrays (same payload as tensors, decoded as `np.ndarray`)."""

# What msgspec (and our hooks) raise for bad input. msgspec.ValidationError is a DecodeError.
_DECODE_ERRORS = (msgspec.DecodeError, ValueError, TypeError, OverflowError, RecursionError)


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return encode_tensor(obj)
    if isinstance(obj, np.ndarray):
        if obj.dtype.hasobject or obj.dtype.byteorder == ">":
            raise TypeError(f"cannot serialize a numpy array of dtype {obj.dtype}")
        payload = encode_tensor(torch.from_numpy(np.ascontiguousarray(obj)))
        return msgspec.msgpack.Ext(NDARRAY_EXT_CODE, payload.data)
    raise TypeError(f"cannot serialize objects of type {type(obj).__name__}")


def _ext_hook(code: int, data: memoryview) -> Any:
    if code == TENSOR_EXT_CODE:
        return decode_tensor(data)
    if code == NDARRAY_EXT_CODE:
        return decode_tensor(data).numpy()
    # Unknown extensions stay opaque, as msgspec itself would leave them.
    return msgspec.msgpack.Ext(code, bytes(data))


def _dec_hook(expected: type, obj: Any) -> Any:
    # msgspec calls this for custom types, after `_ext_hook` has built `obj`. A TypeError here
    # becomes a msgspec.ValidationError that names the path.
    if expected is torch.Tensor:
        if isinstance(obj, torch.Tensor):
            return obj
        raise TypeError(f"Expected a tensor (msgpack ext {TENSOR_EXT_CODE}), got `{_wire_name(obj)}`")
    if expected is np.ndarray:
        if isinstance(obj, np.ndarray):
            return obj
        raise TypeError(f"Expected a numpy array (msgpack ext {NDARRAY_EXT_CODE}), got `{_wire_name(obj)}`")
    raise TypeError(f"rl_data.serialization cannot decode type {expected!r}")


def _wire_name(obj: Any) -> str:
    if isinstance(obj, msgspec.msgpack.Ext):
        return f"ext {obj.code}"
    if isinstance(obj, torch.Tensor):
        return "tensor"
    if isinstance(obj, np.ndarray):
        return "ndarray"
    return type(obj).__name__


class Encoder:
    """A reusable encoder: msgspec's msgpack Encoder with tensor and numpy support.

    Reusing one instance avoids setting msgspec's encoder up for every message; `encode_into`
    writes into a caller-owned bytearray so a sender can reuse one buffer for every message.
    """

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)

    def encode(self, obj: Any) -> bytes:
        """`obj` as one msgpack message. Raises TypeError for values that cannot be sent."""
        return self._encoder.encode(obj)

    def encode_into(self, obj: Any, buffer: bytearray, offset: int = 0) -> None:
        """Write `obj` into `buffer` from `offset` on (-1 appends); `buffer` ends where the message ends."""
        self._encoder.encode_into(obj, buffer, offset)


class Decoder:
    """A reusable decoder of messages into `type` (default `Any`: plain msgpack values and tensors).

    `type` is anything msgspec accepts (a Struct, `list[Trajectory]`, `dict[str, torch.Tensor]`,
    ...); fields annotated `torch.Tensor` or `np.ndarray` take the matching extension values.
    Under `Any`, tensors come back as tensors and numpy arrays as arrays.
    """

    def __init__(self, type: Any = Any) -> None:
        self.type = type
        self._decoder = msgspec.msgpack.Decoder(type, dec_hook=_dec_hook, ext_hook=_ext_hook)

    def decode(self, data: bytes | bytearray | memoryview) -> Any:
        """The value in `data`. Any malformed or invalid message raises `DataError`."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"decode: expected bytes, bytearray or memoryview, got {type(data).__name__}")
        try:
            return self._decoder.decode(data)
        except _DECODE_ERRORS as error:
            raise DataError(f"cannot decode message: {error}") from error


_ENCODER = Encoder()


@functools.lru_cache(maxsize=64)
def _cached_decoder(type: Any) -> Decoder:
    return Decoder(type)


def encode(obj: Any) -> bytes:
    """`obj` (msgspec-supported values, tensors and numpy arrays anywhere inside) as msgpack bytes."""
    return _ENCODER.encode(obj)


def encode_into(obj: Any, buffer: bytearray, offset: int = 0) -> None:
    """Like `encode`, but writes into `buffer` (msgspec's `encode_into`), which is resized to fit."""
    _ENCODER.encode_into(obj, buffer, offset)


def decode(data: bytes | bytearray | memoryview, type: Any = Any) -> Any:
    """Decode one message into `type` (default `Any`); every failure raises `DataError`."""
    try:
        hash(type)
    except TypeError:  # e.g. Annotated[...] with unhashable metadata: build one for this call
        return Decoder(type).decode(data)
    return _cached_decoder(type).decode(data)
