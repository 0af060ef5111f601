"""Tests of rl_data.tensors (dtype table, tensor codec, checksum) and rl_data.serialization.

Round trips are checked bit for bit (raw bytes, so NaN payloads and -0.0 count), the checksum
against a pure-Python reference written here, and decoding against arbitrary bytes: the only
error a bad message may raise is DataError.
"""

from __future__ import annotations

import contextlib
import struct
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rl_data.errors import DataError
from rl_data.records import PromptSample, Trajectory
from rl_data.serialization import (
    NDARRAY_EXT_CODE,
    TENSOR_EXT_CODE,
    Decoder,
    Encoder,
    decode,
    encode,
    encode_into,
)
from rl_data.tensors import (
    DTYPE_CODES,
    decode_tensor,
    dtype_from_name,
    dtype_itemsize,
    dtype_name,
    encode_tensor,
    supported_dtype_names,
    tensor_checksum,
)

ALL_DTYPES = [dtype_from_name(name) for name in supported_dtype_names()]
FLOAT_DTYPES = [dtype for dtype in ALL_DTYPES if dtype.is_floating_point]


# --------------------------------------------------------------------------- helpers


def raw_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_same_tensor(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert isinstance(actual, torch.Tensor)
    assert actual.dtype == expected.dtype
    assert tuple(actual.shape) == tuple(expected.shape)
    assert raw_bytes(actual) == raw_bytes(expected)


def assert_same(actual: Any, expected: Any) -> None:
    """Structural equality where tensors and arrays must match bit for bit."""
    if isinstance(expected, torch.Tensor):
        assert_same_tensor(actual, expected)
    elif isinstance(expected, np.ndarray):
        assert isinstance(actual, np.ndarray)
        assert actual.dtype == expected.dtype
        assert actual.shape == expected.shape
        assert actual.tobytes() == expected.tobytes()
    elif isinstance(expected, msgspec.Struct):
        assert type(actual) is type(expected)
        for field in expected.__struct_fields__:
            assert_same(getattr(actual, field), getattr(expected, field))
    elif isinstance(expected, dict):
        assert isinstance(actual, dict)
        assert actual.keys() == expected.keys()
        for key in expected:
            assert_same(actual[key], expected[key])
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected)
        assert len(actual) == len(expected)
        for a, b in zip(actual, expected):
            assert_same(a, b)
    else:
        assert type(actual) is type(expected)
        assert actual == expected


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Uniformly random bytes viewed as `dtype` (floats then include NaNs, infs and -0.0)."""
    generator = torch.Generator().manual_seed(seed)
    numel = 1
    for dim in shape:
        numel *= dim
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=generator)
    return raw.view(dtype).reshape(shape)


MASK64 = (1 << 64) - 1


def reference_checksum(data: bytes) -> int:
    """The checksum of rl_data.tensors.tensor_checksum, in Python integers, read from its docstring."""
    length = len(data)
    padded = data + b"\x00" * (-length % 8)
    words = struct.unpack(f"<{len(padded) // 8}Q", padded)
    s1 = sum(words) & MASK64
    s2 = sum((i + 1) * w for i, w in enumerate(words)) & MASK64
    return mix64((mix64((s1 + 0x9E3779B97F4A7C15 * length) & MASK64) + s2) & MASK64)


def mix64(value: int) -> int:
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & MASK64
    return value ^ (value >> 31)


def full_trajectory() -> Trajectory:
    return Trajectory(
        prompt_ids=torch.tensor([101, 7592, 2088]),
        response_ids=torch.tensor([5, 6, 7, 8]),
        rollout_logprobs=torch.tensor([-0.5, -0.0, float("nan"), -12.25]),
        action_mask=torch.tensor([True, False, True, True]),
        reward=1.5,
        score=0.25,
        group_id=42,
        policy_version=7,
        finish_reason="length",
        label={"answer": "42", "choices": [1, 2, 3], "nested": {"ok": True}},
        extra={
            "turns": [{"role": "tool", "tokens": 3}, {"role": "assistant", "tokens": 5}],
            "environment": {"seed": 3, "log": None, "scores": [0.5, 1.0]},
            "hidden": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
        },
    )


# --------------------------------------------------------------------------- dtype table


def test_dtype_wire_codes_are_pinned() -> None:
    expected = {
        "bool": 1,
        "uint8": 2,
        "int8": 3,
        "int16": 4,
        "int32": 5,
        "int64": 6,
        "float16": 7,
        "bfloat16": 8,
        "float32": 9,
        "float64": 10,
    }
    assert {name: DTYPE_CODES[name] for name in expected} == expected
    optional = {"uint16": 11, "uint32": 12, "uint64": 13, "float8_e4m3fn": 14, "float8_e5m2": 15}
    for name, code in optional.items():
        assert DTYPE_CODES.get(name, code) == code
        assert (name in DTYPE_CODES) == hasattr(torch, name)
    assert len(set(DTYPE_CODES.values())) == len(DTYPE_CODES)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_dtype_names_round_trip(dtype: torch.dtype) -> None:
    name = dtype_name(dtype)
    assert dtype_from_name(name) is dtype
    assert str(dtype) == f"torch.{name}"
    assert dtype_itemsize(name) == dtype_itemsize(dtype) == dtype.itemsize


def test_unknown_dtype_name_lists_the_allowed_names() -> None:
    with pytest.raises(ValueError, match=r"unknown dtype name 'float128'.*bfloat16.*float32"):
        dtype_from_name("float128")
    with pytest.raises(ValueError, match=r"unknown dtype name 'torch\.float32'"):
        dtype_from_name("torch.float32")


def test_unsupported_torch_dtype_raises_with_the_supported_names() -> None:
    with pytest.raises(ValueError, match=r"torch\.complex64 is not supported.*supported: bool, uint8"):
        dtype_name(torch.complex64)
    with pytest.raises(ValueError, match="not supported"):
        encode_tensor(torch.zeros(2, dtype=torch.complex64))


# --------------------------------------------------------------------------- tensor codec


def test_encode_tensor_golden_bytes() -> None:
    ext = encode_tensor(torch.tensor([[1, -2]], dtype=torch.int16))
    assert ext.code == TENSOR_EXT_CODE
    header = bytes([4, 2]) + (1).to_bytes(8, "little") + (2).to_bytes(8, "little")
    assert bytes(ext.data) == header + b"\x01\x00\xfe\xff"
    # The bfloat16 1.0 is 0x3F80, little-endian.
    assert bytes(encode_tensor(torch.tensor(1.0, dtype=torch.bfloat16)).data) == bytes([8, 0, 0x80, 0x3F])


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (5,), (2, 3, 4)], ids=str)
def test_every_dtype_and_shape_round_trips_bit_exact(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    tensor = random_tensor(dtype, shape, seed=len(shape))
    decoded = decode_tensor(encode_tensor(tensor).data)
    assert_same_tensor(decoded, tensor)
    assert_same_tensor(decode(encode(tensor)), tensor)


# NaNs with non-default payloads, with and without the sign bit, as raw bit patterns.
NAN_BITS = {
    torch.float16: (torch.int16, [0xFE01, 0x7D23]),
    torch.bfloat16: (torch.int16, [0xFFC1, 0x7F81]),
    torch.float32: (torch.int32, [0xFFC12345, 0x7F800001]),
    torch.float64: (torch.int64, [0xFFF8000000000123, 0x7FF0000000000001]),
}


def from_bits(dtype: torch.dtype, bits: list[int]) -> torch.Tensor:
    int_dtype, _ = NAN_BITS[dtype]
    width = 8 * dtype.itemsize
    signed = [b - (1 << width) if b >= 1 << (width - 1) else b for b in bits]
    return torch.tensor(signed, dtype=int_dtype).view(dtype)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_float_round_trip_keeps_nan_payloads_signed_zero_and_infinities(dtype: torch.dtype) -> None:
    values = torch.tensor([-0.0, 0.0, float("inf"), float("-inf"), float("nan"), 1.0]).to(dtype)
    if dtype in NAN_BITS:
        values = torch.cat([values, from_bits(dtype, NAN_BITS[dtype][1])])
    decoded = decode(encode({"x": values}))["x"]
    assert_same_tensor(decoded, values)
    # -0.0 keeps its sign bit (the top bit of the last, most significant byte).
    assert raw_bytes(decoded[0])[-1] & 0x80
    assert not raw_bytes(decoded[1])[-1] & 0x80


def test_non_contiguous_tensors_round_trip_as_their_values() -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    for view in (base.T, base[:, ::2], base[1:3, 1:5], base[:1].expand(3, 6), base[::2].T):
        assert not view.is_contiguous()
        assert_same_tensor(decode_tensor(encode_tensor(view).data), view.contiguous())


def test_tensor_that_requires_grad_is_sent_detached() -> None:
    tensor = torch.randn(3, requires_grad=True)
    decoded = decode(encode(tensor * 2))
    assert not decoded.requires_grad
    assert_same_tensor(decoded, (tensor * 2).detach())


def test_decoded_tensor_owns_writable_memory() -> None:
    message = bytearray(encode(torch.arange(4, dtype=torch.int32)))
    decoded = decode(message)
    message[-4:] = b"\xff\xff\xff\xff"  # the message buffer changing does not reach the tensor
    decoded[0] = 100  # and the tensor is writable
    assert decoded.tolist() == [100, 1, 2, 3]


@pytest.mark.parametrize(
    ("payload", "match"),
    [
        (b"", "header needs at least 2 bytes, got 0"),
        (b"\x09", "header needs at least 2 bytes, got 1"),
        (b"\x63\x00", "unknown dtype code 99"),
        (b"\x00\x00", "unknown dtype code 0"),
        (b"\x09\x02" + (3).to_bytes(8, "little"), "ndim=2 needs 18 bytes, the payload has only 10"),
        (b"\x09\x01" + (-1).to_bytes(8, "little", signed=True), r"negative dimension in shape \(-1,\)"),
        (
            b"\x09\x01" + (2).to_bytes(8, "little") + b"\x00" * 7,
            r"shape \(2,\) of float32 needs 8 data bytes, got 7",
        ),
        (b"\x09\x00" + b"\x00" * 5, r"shape \(\) of float32 needs 4 data bytes, got 5"),
        (b"\x01\x01" + (2).to_bytes(8, "little") + b"\x01\x02", "bool tensor holds bytes other than 0 and 1"),
    ],
)
def test_decode_tensor_rejects_malformed_payloads(payload: bytes, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        decode_tensor(payload)
    with pytest.raises(DataError, match=match):
        decode(msgspec.msgpack.encode(msgspec.msgpack.Ext(TENSOR_EXT_CODE, payload)))


def test_decode_tensor_rejects_a_shape_whose_size_overflows() -> None:
    payload = b"\x09\x03" + (0).to_bytes(8, "little") + ((1 << 62).to_bytes(8, "little")) * 2
    with pytest.raises(ValueError, match="tensor payload"):
        decode_tensor(payload)


# --------------------------------------------------------------------------- checksum


@settings(max_examples=60, deadline=None)
@given(data=st.binary(max_size=67), row_words=st.integers(1, 5))
def test_checksum_matches_the_python_reference_on_random_bytes(data: bytes, row_words: int) -> None:
    tensor = torch.tensor(list(data), dtype=torch.uint8)
    expected = reference_checksum(data)
    assert tensor_checksum(tensor) == expected
    assert tensor_checksum(tensor, row_words=row_words) == expected


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int64, torch.bool, torch.float16])
@pytest.mark.parametrize("numel", [0, 1, 3, 7, 33])
def test_checksum_of_typed_tensors_matches_the_reference_on_their_bytes(
    dtype: torch.dtype, numel: int
) -> None:
    tensor = random_tensor(dtype, (numel,), seed=numel)
    expected = reference_checksum(raw_bytes(tensor))
    assert tensor_checksum(tensor) == expected
    assert tensor_checksum(tensor, row_words=2) == expected
    assert 0 <= expected < 2**64


def test_checksum_wraps_modulo_2_pow_64_like_the_reference() -> None:
    # 20k random 64-bit words (plus a tail): both sums wrap modulo 2^64 many times.
    tensor = random_tensor(torch.uint8, (8 * 20_000 + 3,), seed=5)
    data = raw_bytes(tensor)
    words = struct.unpack(f"<{len(data) // 8}Q", data[: len(data) // 8 * 8])
    assert sum(words) > 2**70
    expected = reference_checksum(data)
    assert tensor_checksum(tensor) == expected
    assert tensor_checksum(tensor, row_words=1 << 12) == expected
    assert tensor_checksum(tensor, row_words=1000) == expected
    assert tensor_checksum(tensor, row_words=7) == expected


def test_checksum_detects_every_single_bit_flip() -> None:
    data = bytearray(random_tensor(torch.uint8, (21,), seed=1).numpy().tobytes())
    original = tensor_checksum(torch.tensor(list(data), dtype=torch.uint8))
    seen = {original}
    for byte in range(len(data)):
        for bit in range(8):
            flipped = bytearray(data)
            flipped[byte] ^= 1 << bit
            seen.add(tensor_checksum(torch.tensor(list(flipped), dtype=torch.uint8)))
    assert len(seen) == 1 + 8 * len(data)


def test_checksum_detects_swapped_words_and_depends_on_length() -> None:
    words = torch.tensor([1, 2, 3, 0xDEADBEEF - 2**32], dtype=torch.int32)
    swapped = words[[3, 1, 2, 0]]
    assert tensor_checksum(words) != tensor_checksum(swapped)
    assert tensor_checksum(torch.zeros(3, dtype=torch.uint8)) != tensor_checksum(
        torch.zeros(4, dtype=torch.uint8)
    )
    assert tensor_checksum(torch.zeros(0)) != tensor_checksum(torch.zeros(1))


def test_checksum_depends_only_on_the_bytes_not_on_layout_or_dtype() -> None:
    base = torch.randn(6, 8, generator=torch.Generator().manual_seed(0))
    assert tensor_checksum(base.T) == tensor_checksum(base.T.contiguous())
    assert (
        tensor_checksum(base)
        == tensor_checksum(base.view(torch.uint8))
        == tensor_checksum(base.view(torch.int16))
    )
    # A view that starts at an odd byte offset of its storage (not 8-byte aligned).
    buffer = torch.randint(0, 256, (40,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    assert tensor_checksum(buffer[1:30], row_words=2) == reference_checksum(raw_bytes(buffer[1:30]))


def test_checksum_rejects_a_bad_row_width() -> None:
    with pytest.raises(ValueError, match="row_words: expected an integer >= 1, got 0"):
        tensor_checksum(torch.zeros(3), row_words=0)
    with pytest.raises(TypeError, match=r"expected a torch\.Tensor, got list"):
        tensor_checksum([1, 2])  # type: ignore[arg-type]


# --------------------------------------------------------------------------- records


def test_trajectory_with_every_field_set_round_trips() -> None:
    trajectory = full_trajectory()
    assert_same(decode(encode(trajectory), Trajectory), trajectory)


def test_trajectory_with_defaults_round_trips() -> None:
    trajectory = Trajectory(prompt_ids=[1, 2], response_ids=[3])
    decoded = decode(encode(trajectory), Trajectory)
    assert_same(decoded, trajectory)
    assert decoded.rollout_logprobs is None
    assert decoded.label is None
    assert decoded.extra == {}


def test_prompt_samples_round_trip_with_every_field_and_with_defaults() -> None:
    full = PromptSample(
        prompt_ids=torch.tensor([1, 2, 3]),
        prompt="<|user|>What is 6*7?",
        label={"answer": 42, "units": None},
        index=17,
        source="gsm8k.jsonl",
        extra={"difficulty": [1, 2], "meta": {"split": "train"}},
    )
    bare = PromptSample(prompt_ids=[5])
    assert_same(decode(encode([full, bare]), list[PromptSample]), [full, bare])


def test_a_list_of_records_decodes_without_a_type_into_plain_values() -> None:
    records = [full_trajectory(), Trajectory(prompt_ids=[1], response_ids=[2, 3], group_id=3)]
    decoded = decode(encode(records), list[Trajectory])
    assert_same(decoded, records)
    plain = decode(encode(records))
    assert plain[1]["group_id"] == 3
    assert_same(plain[0]["response_ids"], records[0].response_ids)


def test_tensors_and_arrays_anywhere_in_plain_values_round_trip() -> None:
    value = {
        "weights": {"a.b": torch.randn(2, 2), "c": torch.ones(3, dtype=torch.float16)},
        "list": [torch.tensor(True), 3, "x", [torch.zeros(0, 4, dtype=torch.int8)]],
        "array": np.arange(6, dtype=np.uint16).reshape(2, 3)[:, ::2],
    }
    expected = {**value, "array": np.ascontiguousarray(value["array"])}
    assert_same(decode(encode(value)), expected)
    assert_same(decode(encode(value["weights"]), dict[str, torch.Tensor]), value["weights"])
    assert_same(decode(encode(expected["array"]), np.ndarray), expected["array"])


def test_encoder_and_decoder_classes_are_reusable_and_encode_into_reuses_a_buffer() -> None:
    encoder, decoder = Encoder(), Decoder(Trajectory)
    buffer = bytearray()
    trajectories = [full_trajectory(), Trajectory(prompt_ids=[9], response_ids=[8])]
    for trajectory in trajectories:
        encoder.encode_into(trajectory, buffer)
        assert bytes(buffer) == encoder.encode(trajectory) == encode(trajectory)
        assert_same(decoder.decode(buffer), trajectory)
    encode_into(trajectories[1], buffer)
    assert_same(decode(memoryview(buffer), Trajectory), trajectories[1])


def test_unknown_extension_codes_stay_opaque() -> None:
    message = msgspec.msgpack.encode([msgspec.msgpack.Ext(42, b"abc")])
    (value,) = decode(message)
    assert isinstance(value, msgspec.msgpack.Ext)
    assert (value.code, bytes(value.data)) == (42, b"abc")


def test_unsupported_values_fail_to_encode() -> None:
    with pytest.raises(TypeError, match="cannot serialize objects of type object"):
        encode({"x": object()})
    with pytest.raises(TypeError, match="numpy array of dtype object"):
        encode(np.array([None, 1], dtype=object))


# --------------------------------------------------------------------------- decode errors


def test_decoding_into_an_invalid_trajectory_raises_data_error_from_the_validation_error() -> None:
    message = encode(
        {
            "prompt_ids": torch.tensor([1]),
            "response_ids": torch.tensor([1, 2]),
            "action_mask": torch.tensor([True]),
        }
    )
    with pytest.raises(DataError, match="action_mask: length 1 does not match response_ids length 2") as info:
        decode(message, Trajectory)
    assert isinstance(info.value.__cause__, msgspec.ValidationError)


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"finish_reason": "timeout"}, r"Invalid enum value 'timeout' - at `\$.finish_reason`"),
        ({"group_id": "seven"}, r"Expected `int`, got `str` - at `\$.group_id`"),
        ({"prompt_ids": [1, 2]}, r"Expected a tensor \(msgpack ext 1\), got `list` - at `\$.prompt_ids`"),
        ({"prompt_ids": torch.tensor([0.5])}, "prompt_ids: expected integers"),
        ({"rollout_logprobs": torch.zeros(3)}, "rollout_logprobs: length 3 does not match"),
        (
            {"response_ids": None},
            r"Expected a tensor \(msgpack ext 1\), got `NoneType` - at `\$.response_ids`",
        ),
    ],
)
def test_decode_errors_name_the_field(fields: dict[str, Any], match: str) -> None:
    record = {"prompt_ids": torch.tensor([1]), "response_ids": torch.tensor([2, 3]), **fields}
    with pytest.raises(DataError, match=match):
        decode(encode(record), Trajectory)


def test_decode_errors_inside_a_list_give_the_index_in_the_path() -> None:
    good = Trajectory(prompt_ids=[1], response_ids=[2])
    message = encode(
        [good, {"prompt_ids": torch.tensor([1]), "response_ids": torch.tensor([2]), "reward": "high"}]
    )
    with pytest.raises(DataError, match=r"Expected `float`, got `str` - at `\$\[1\].reward`"):
        decode(message, list[Trajectory])


def test_every_truncation_of_a_valid_message_raises_data_error() -> None:
    message = encode([full_trajectory()])
    for end in range(len(message)):
        with pytest.raises(DataError):
            decode(message[:end], list[Trajectory])
        with pytest.raises(DataError):
            decode(message[:end])


def test_decode_refuses_non_bytes_input() -> None:
    with pytest.raises(TypeError, match="expected bytes, bytearray or memoryview, got str"):
        decode("not bytes")  # type: ignore[arg-type]


def _decode_or_data_error(data: bytes, type: Any) -> None:
    with contextlib.suppress(DataError):
        decode(data, type)


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=200))
def test_arbitrary_bytes_only_ever_raise_data_error(data: bytes) -> None:
    for type in (Any, Trajectory, list[Trajectory], dict[str, torch.Tensor]):
        _decode_or_data_error(data, type)


@settings(max_examples=200, deadline=None)
@given(
    code=st.sampled_from([TENSOR_EXT_CODE, NDARRAY_EXT_CODE]),
    payload=st.binary(max_size=40),
    key=st.sampled_from(["prompt_ids", "extra", "reward"]),
)
def test_arbitrary_extension_payloads_only_ever_raise_data_error(code: int, payload: bytes, key: str) -> None:
    message = msgspec.msgpack.encode(
        {
            "prompt_ids": msgspec.msgpack.Ext(code, payload),
            "response_ids": [],
            key: msgspec.msgpack.Ext(code, payload),
        }
    )
    for type in (Any, Trajectory):
        _decode_or_data_error(message, type)


@settings(max_examples=300, deadline=None)
@given(position=st.integers(0, 10**6), value=st.integers(0, 255))
def test_a_valid_message_with_one_byte_changed_decodes_or_raises_data_error(
    position: int, value: int
) -> None:
    message = bytearray(encode([full_trajectory(), PromptSample(prompt_ids=[1, 2], label=[3])]))
    message[position % len(message)] = value
    _decode_or_data_error(bytes(message), list[Trajectory])
    _decode_or_data_error(bytes(message), Any)


# --------------------------------------------------------------------------- property round trip

json_leaves = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=8)
)
json_values = st.recursive(
    json_leaves,
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3)
    ),
    max_leaves=8,
)


@st.composite
def trajectories(draw: st.DrawFn) -> Trajectory:
    prompt = draw(st.lists(st.integers(-(2**63), 2**63 - 1), max_size=6))
    length = draw(st.integers(0, 6))
    response = draw(st.lists(st.integers(0, 2**40), min_size=length, max_size=length))
    logprobs = draw(
        st.none() | st.lists(st.floats(width=32, allow_nan=True), min_size=length, max_size=length)
    )
    mask = draw(st.none() | st.lists(st.booleans(), min_size=length, max_size=length))
    return Trajectory(
        prompt_ids=prompt,
        response_ids=response,
        rollout_logprobs=logprobs,
        action_mask=mask,
        reward=draw(st.floats(allow_nan=False)),
        score=draw(st.none() | st.floats(allow_nan=False)),
        group_id=draw(st.integers(-(2**63), 2**63 - 1)),
        policy_version=draw(st.integers(0, 2**31)),
        finish_reason=draw(st.sampled_from(["stop", "length", "abort"])),
        label=draw(json_values),
        extra=draw(st.dictionaries(st.text(max_size=5), json_values, max_size=3)),
    )


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(records=st.lists(trajectories(), max_size=3))
def test_random_trajectories_round_trip_bit_exact(records: list[Trajectory]) -> None:
    assert_same(decode(encode(records), list[Trajectory]), records)


# --------------------------------------------------------------------------- CUDA


@pytest.mark.gpu
def test_cuda_tensors_encode_like_their_cpu_copies_and_checksum_the_same() -> None:
    tensor = random_tensor(torch.bfloat16, (1000, 7), seed=2)
    on_gpu = tensor.to("cuda")
    assert bytes(encode_tensor(on_gpu).data) == bytes(encode_tensor(tensor).data)
    assert_same_tensor(decode(encode(on_gpu.T)), tensor.T.contiguous())
    raw = random_tensor(torch.uint8, (4 * 5000 + 3,), seed=3)
    expected = reference_checksum(raw_bytes(raw))
    assert tensor_checksum(raw.to("cuda")) == expected
    assert tensor_checksum(raw.to("cuda"), row_words=333) == expected
    assert tensor_checksum(on_gpu) == tensor_checksum(tensor)
