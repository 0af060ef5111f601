"""Tests of rl_data.weights: the bucket planner, pack / unpack, checksums and the metadata messages."""

from __future__ import annotations

import math

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_data.errors import DataError
from rl_data.serialization import decode, encode
from rl_data.tensors import dtype_from_name, tensor_checksum
from rl_data.weights import (
    BucketMeta,
    ParamMeta,
    WeightSyncMeta,
    WeightSyncReport,
    bucket_checksum,
    compare_checksums,
    pack_bucket,
    plan_buckets,
    unpack_bucket,
)

MIXED = [
    ("embed.weight", torch.bfloat16, (10, 4)),  # 80 bytes
    ("layer.0.scale", torch.float32, (3,)),  # 12 bytes
    ("layer.0.step", torch.int64, ()),  # 8 bytes
    ("layer.0.mask", torch.bool, (5,)),  # 5 bytes
    ("head.weight", torch.float32, (4, 10)),  # 160 bytes
]


def random_state(params, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name, dtype, shape in params:
        dtype = dtype_from_name(dtype) if isinstance(dtype, str) else dtype
        if dtype == torch.bool:
            state[name] = torch.randint(0, 2, shape, generator=generator).bool()
        elif dtype.is_floating_point:
            state[name] = torch.randn(shape, generator=generator).to(dtype)
        else:
            state[name] = torch.randint(-(2**40), 2**40, shape, generator=generator).to(dtype)
    return state


def raw(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


# --------------------------------------------------------------------------- planner


def test_plan_golden_layout() -> None:
    meta = plan_buckets(MIXED, bucket_bytes=128, alignment=16, version=3)
    layout = [[(p.name, p.offset, p.nbytes) for p in bucket.params] for bucket in meta.buckets]
    assert layout == [
        [
            ("embed.weight", 0, 80),
            ("layer.0.scale", 80, 12),
            ("layer.0.step", 96, 8),
            ("layer.0.mask", 112, 5),
        ],
        [("head.weight", 0, 160)],  # larger than bucket_bytes: a bucket of its own
    ]
    assert [bucket.nbytes for bucket in meta.buckets] == [128, 160]
    assert meta.total_bytes == 288
    assert meta.version == 3
    assert meta.num_params == 5
    assert meta.names() == tuple(name for name, _, _ in MIXED)
    assert meta.param("layer.0.step") == ParamMeta("layer.0.step", "int64", (), 96, 8)
    assert meta.locate("head.weight")[0] == 1
    assert meta.buckets[0].names()[0] == "embed.weight"
    assert meta.checksums == (None, None)


def test_plan_opens_a_new_bucket_when_the_aligned_end_would_not_fit() -> None:
    meta = plan_buckets([("a", "uint8", (100,)), ("b", "uint8", (20,))], bucket_bytes=128, alignment=16)
    # b would sit at 112 and end at 132 > 128.
    assert [bucket.names() for bucket in meta.buckets] == [("a",), ("b",)]
    assert [bucket.nbytes for bucket in meta.buckets] == [112, 32]


def test_plan_aligns_offsets_to_the_itemsize_when_it_exceeds_the_alignment() -> None:
    meta = plan_buckets([("flag", torch.bool, (3,)), ("w", torch.float64, (2,))], alignment=1)
    assert [p.offset for p in meta.buckets[0].params] == [0, 8]
    assert meta.buckets[0].nbytes == 24


def test_plan_of_nothing_has_no_buckets_and_zero_sized_params_take_no_room() -> None:
    assert plan_buckets([]) == WeightSyncMeta(buckets=(), total_bytes=0)
    meta = plan_buckets([("empty", "float32", (0, 7)), ("x", "float32", (2,))], alignment=64)
    assert [(p.offset, p.nbytes) for p in meta.buckets[0].params] == [(0, 0), (0, 8)]
    assert meta.total_bytes == 64


params_strategy = st.lists(
    st.tuples(
        st.sampled_from(["bool", "uint8", "int16", "bfloat16", "float32", "int64", "float64"]),
        st.lists(st.integers(0, 40), max_size=3),
    ),
    max_size=25,
)


@settings(max_examples=150, deadline=None)
@given(
    specs=params_strategy,
    bucket_bytes=st.integers(1, 600),
    alignment=st.sampled_from([1, 2, 4, 8, 64, 256]),
)
def test_plan_properties(specs, bucket_bytes: int, alignment: int) -> None:
    params = [(f"p{i}", dtype, shape) for i, (dtype, shape) in enumerate(specs)]
    meta = plan_buckets(params, bucket_bytes=bucket_bytes, alignment=alignment)
    # Every parameter exactly once, in the given order, with its dtype, shape and size.
    planned = [param for bucket in meta.buckets for param in bucket.params]
    assert [p.name for p in planned] == [name for name, _, _ in params]
    for param, (_, dtype, shape) in zip(planned, params):
        assert (param.dtype, param.shape) == (dtype, tuple(shape))
        assert param.nbytes == math.prod(shape) * dtype_from_name(dtype).itemsize
    assert [bucket.index for bucket in meta.buckets] == list(range(len(meta.buckets)))
    assert meta.total_bytes == sum(bucket.nbytes for bucket in meta.buckets)
    for bucket in meta.buckets:
        assert bucket.params, "no empty buckets"
        end = 0
        for param in bucket.params:
            assert param.offset >= end, "byte ranges do not overlap"
            assert param.offset % alignment == 0
            assert param.offset % dtype_from_name(param.dtype).itemsize == 0
            end = param.end
        assert end <= bucket.nbytes
        assert bucket.nbytes % alignment == 0
        assert bucket.nbytes - end < alignment, "the tail is padding to the alignment only"
        oversized = (
            len(bucket.params) == 1 and -(-bucket.params[0].nbytes // alignment) * alignment > bucket_bytes
        )
        assert bucket.nbytes <= bucket_bytes or oversized
    # Greedy: the first parameter of each later bucket would not have fit in the one before.
    for previous, bucket in zip(meta.buckets, meta.buckets[1:]):
        first = bucket.params[0]
        step = max(alignment, dtype_from_name(first.dtype).itemsize)
        offset = -(-previous.params[-1].end // step) * step
        assert -(-(offset + first.nbytes) // alignment) * alignment > bucket_bytes


@pytest.mark.parametrize(
    ("params", "kwargs", "match"),
    [
        ([("a", "float32", (1,)), ("a", "int64", (2,))], {}, "duplicate parameter name 'a'"),
        ([("w", "float32", (3, -1))], {}, r"parameter 'w': negative dimension in shape \(3, -1\)"),
        ([("w", "float128", (3,))], {}, "parameter 'w': unknown dtype name 'float128'"),
        ([("w", torch.complex64, (3,))], {}, r"parameter 'w': dtype torch\.complex64 is not supported"),
        ([("w", "float32", (2.5,))], {}, "parameter 'w': shape must be a sequence of ints"),
        ([("w", "float32")], {}, r"params\[0\] must be a \(name, dtype, shape\) triple"),
        ([(3, "float32", (1,))], {}, r"params\[0\] name must be a str, got int"),
        ([], {"bucket_bytes": 0}, "bucket_bytes: expected an integer >= 1, got 0"),
        ([], {"bucket_bytes": -5}, "bucket_bytes: expected an integer >= 1, got -5"),
        ([], {"alignment": 0}, "alignment must be a positive power of two, got 0"),
        ([], {"alignment": 48}, "alignment must be a positive power of two, got 48"),
        ([], {"alignment": -4}, "alignment must be a positive power of two, got -4"),
    ],
)
def test_plan_errors_name_the_parameter_or_argument(params, kwargs, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        plan_buckets(params, **kwargs)


# --------------------------------------------------------------------------- pack / unpack


def test_pack_then_unpack_returns_the_original_tensors_bit_exact() -> None:
    state = random_state(MIXED)
    state["layer.0.scale"][1] = float("nan")
    state["layer.0.scale"][2] = -0.0
    meta = plan_buckets(MIXED, bucket_bytes=128, alignment=16)
    for bucket in meta.buckets:
        buffer = pack_bucket(bucket, state)
        assert (buffer.dtype, tuple(buffer.shape)) == (torch.uint8, (bucket.nbytes,))
        views = unpack_bucket(bucket, buffer)
        assert list(views) == list(bucket.names())
        for name, view in views.items():
            assert view.dtype == state[name].dtype
            assert view.shape == state[name].shape
            assert raw(view) == raw(state[name])


def test_pack_zeroes_the_padding_even_in_a_dirty_out_buffer() -> None:
    meta = plan_buckets(MIXED[:4], alignment=16)
    bucket = meta.buckets[0]
    out = torch.full((bucket.nbytes,), 0xFF, dtype=torch.uint8)
    assert pack_bucket(bucket, random_state(MIXED), out=out) is out
    used = torch.zeros(bucket.nbytes, dtype=torch.bool)
    for param in bucket.params:
        used[param.offset : param.end] = True
    assert int(out[~used].count_nonzero()) == 0
    assert int((~used).sum()) > 0


def test_pack_casts_to_the_planned_dtype_and_ignores_extra_tensors() -> None:
    meta = plan_buckets([("w", torch.bfloat16, (4,)), ("m", torch.bool, (3,))])
    source = {
        "w": torch.tensor([1.0, 1 / 3, -2.5, 1e5]),
        "m": torch.tensor([0, 1, 2]),
        "other": torch.zeros(9),
    }
    views = unpack_bucket(meta.buckets[0], pack_bucket(meta.buckets[0], source))
    assert raw(views["w"]) == raw(source["w"].to(torch.bfloat16))
    assert views["m"].tolist() == [False, True, True]


def test_unpack_returns_views_that_share_the_buffer() -> None:
    meta = plan_buckets([("a", torch.float32, (2, 2)), ("b", torch.int64, (3,))], alignment=8)
    buffer = pack_bucket(
        meta.buckets[0], random_state([("a", torch.float32, (2, 2)), ("b", torch.int64, (3,))])
    )
    views = unpack_bucket(meta.buckets[0], buffer)
    views["b"].fill_(7)  # a receiver loads weights in place through the views
    assert unpack_bucket(meta.buckets[0], buffer)["b"].tolist() == [7, 7, 7]
    assert views["a"].untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()


def test_empty_bucket_packs_to_zero_bytes() -> None:
    bucket = BucketMeta(index=0, params=(), nbytes=0)
    buffer = pack_bucket(bucket, {})
    assert buffer.numel() == 0
    assert unpack_bucket(bucket, buffer) == {}


def test_pack_errors_name_the_parameter_or_the_bad_out() -> None:
    meta = plan_buckets(MIXED[:2], alignment=16)
    bucket = meta.buckets[0]
    state = random_state(MIXED[:2])
    with pytest.raises(KeyError, match=r"needs parameter 'layer\.0\.scale', missing from tensors"):
        pack_bucket(bucket, {"embed.weight": state["embed.weight"]})
    with pytest.raises(ValueError, match=r"parameter 'embed\.weight' has shape \(4, 10\), planned \(10, 4\)"):
        pack_bucket(bucket, {**state, "embed.weight": state["embed.weight"].T})
    with pytest.raises(TypeError, match=r"parameter 'layer\.0\.scale' must be a torch\.Tensor, got list"):
        pack_bucket(bucket, {**state, "layer.0.scale": [1.0, 2.0, 3.0]})
    with pytest.raises(ValueError, match=f"bucket 0 needs {bucket.nbytes} bytes, got 7"):
        pack_bucket(bucket, state, out=torch.empty(7, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"out: expected a 1-D torch\.uint8 tensor, got torch\.float32"):
        pack_bucket(bucket, state, out=torch.empty(bucket.nbytes, dtype=torch.float32))
    with pytest.raises(
        ValueError, match=r"expected a 1-D torch\.uint8 tensor, got torch\.uint8 of shape \(2, "
    ):
        pack_bucket(bucket, state, out=torch.empty(2, bucket.nbytes // 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="must be contiguous"):
        pack_bucket(bucket, state, out=torch.empty(2 * bucket.nbytes, dtype=torch.uint8)[::2])


def test_unpack_errors_on_a_buffer_of_the_wrong_size_dtype_or_alignment() -> None:
    meta = plan_buckets([("w", torch.float32, (4,))], alignment=16)
    bucket = meta.buckets[0]
    with pytest.raises(ValueError, match="bucket 0 needs 16 bytes, got 15"):
        unpack_bucket(bucket, torch.zeros(15, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"expected a 1-D torch\.uint8 tensor, got torch\.float32"):
        unpack_bucket(bucket, torch.zeros(4))
    with pytest.raises(TypeError, match=r"expected a torch\.Tensor, got bytes"):
        unpack_bucket(bucket, bytes(16))  # type: ignore[arg-type]
    misaligned = torch.zeros(17, dtype=torch.uint8)[1:]
    with pytest.raises(ValueError, match="cannot view parameter 'w' as float32"):
        unpack_bucket(bucket, misaligned)


# --------------------------------------------------------------------------- checksums


def test_bucket_checksums_match_after_a_faithful_transfer_and_flag_a_corrupted_bucket() -> None:
    meta = plan_buckets(MIXED, bucket_bytes=128, alignment=16)
    state = random_state(MIXED, seed=3)
    sent = [pack_bucket(bucket, state) for bucket in meta.buckets]
    received = [buffer.clone() for buffer in sent]
    sent_meta = meta.with_checksums([bucket_checksum(buffer) for buffer in sent])
    report = WeightSyncReport(
        version=1,
        num_bytes=sum(b.numel() for b in received),
        seconds=0.5,
        checksums=tuple(bucket_checksum(buffer) for buffer in received),
    )
    assert compare_checksums(sent_meta, report) == []
    received[1][5] ^= 0x10  # one flipped bit in bucket 1
    corrupted = [bucket_checksum(buffer) for buffer in received]
    assert compare_checksums(sent_meta, corrupted) == [1]
    assert compare_checksums(sent_meta.checksums, meta.with_checksums(corrupted)) == [1]
    assert bucket_checksum(sent[0]) == tensor_checksum(sent[0])
    assert report.bytes_per_second == pytest.approx(2 * meta.total_bytes)


def test_compare_checksums_errors_on_length_mismatch_or_missing_checksums() -> None:
    with pytest.raises(ValueError, match="sent has 2 bucket checksums, received has 3"):
        compare_checksums([1, 2], [1, 2, 3])
    layout = plan_buckets(MIXED, bucket_bytes=128, alignment=16)
    with pytest.raises(ValueError, match=r"sent has no checksum for buckets \[0, 1\]"):
        compare_checksums(layout, [1, 2])


def test_with_checksums_and_layout_only_keep_the_layout() -> None:
    meta = plan_buckets(MIXED, bucket_bytes=128, alignment=16, version=4)
    filled = meta.with_checksums([2**64 - 1, 0])
    assert filled.checksums == (2**64 - 1, 0)
    assert [b.params for b in filled.buckets] == [b.params for b in meta.buckets]
    assert filled.version == 4
    assert filled.layout_only() == meta
    with pytest.raises(ValueError, match="got 1 checksums for 2 buckets"):
        meta.with_checksums([1])
    with pytest.raises(ValueError, match=r"bucket 0: checksum 18446744073709551616 is outside \[0, 2\^64\)"):
        meta.with_checksums([2**64, 0])
    with pytest.raises(KeyError, match="parameter 'nope' is not in the weight-sync layout"):
        meta.param("nope")


# --------------------------------------------------------------------------- messages


def test_metadata_and_reports_round_trip_through_serialization() -> None:
    meta = plan_buckets(MIXED, bucket_bytes=128, alignment=16, version=9)
    filled = meta.with_checksums([12345, 2**64 - 1])
    report = WeightSyncReport(version=9, num_bytes=288, seconds=0.25, checksums=(1, 2**63))
    for value in (meta, filled, report):
        assert decode(encode(value), type(value)) == value
    assert decode(encode([filled, report]), tuple[WeightSyncMeta, WeightSyncReport]) == (filled, report)


def _tamper(meta: WeightSyncMeta, path: list, value) -> bytes:
    """The message of `meta` with the field at `path` (keys and list indices) replaced by `value`."""
    plain = msgspec.to_builtins(meta)
    target = plain
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return encode(plain)


@pytest.mark.parametrize(
    ("path", "value", "match"),
    [
        (["total_bytes"], 5, r"total_bytes 5 != sum of bucket sizes 288"),
        (["buckets", 1, "index"], 7, "bucket at position 1 has index 7"),
        (["buckets", 0, "nbytes"], 64, "parameters end at byte 117, past nbytes 64"),
        (["buckets", 0, "params", 1, "offset"], 70, "parameter 'layer.0.scale' at offset 70 overlaps"),
        (["buckets", 0, "params", 1, "nbytes"], 13, r"nbytes 13 != prod\(3,\) \* 4 = 12"),
        (["buckets", 0, "params", 1, "dtype"], "float128", "unknown dtype 'float128'"),
        (["buckets", 0, "params", 1, "shape"], [3, -1], "negative dimension"),
        (["buckets", 1, "params", 0, "name"], "embed.weight", "parameter 'embed.weight' appears twice"),
        (["buckets", 0, "checksum"], -1, "checksum -1 is outside"),
        (
            ["buckets", 0, "params", 0, "offset"],
            "zero",
            r"Expected `int`, got `str` - at `\$.buckets\[0\].params\[0\].offset`",
        ),
    ],
)
def test_decoding_inconsistent_metadata_raises_data_error(path: list, value, match: str) -> None:
    meta = plan_buckets(MIXED, bucket_bytes=128, alignment=16)
    with pytest.raises(DataError, match=match):
        decode(_tamper(meta, path, value), WeightSyncMeta)


@pytest.mark.gpu
def test_pack_on_cuda_matches_the_cpu_buffer_and_checksum() -> None:
    meta = plan_buckets(MIXED, bucket_bytes=128, alignment=16)
    state = random_state(MIXED, seed=4)
    on_gpu = {name: tensor.to("cuda") for name, tensor in state.items()}
    for bucket in meta.buckets:
        cpu_buffer = pack_bucket(bucket, state)
        gpu_buffer = pack_bucket(bucket, on_gpu)
        assert gpu_buffer.device.type == "cuda"
        assert torch.equal(gpu_buffer.cpu(), cpu_buffer)
        assert bucket_checksum(gpu_buffer) == bucket_checksum(cpu_buffer)
        views = unpack_bucket(bucket, gpu_buffer)
        assert all(view.device.type == "cuda" for view in views.values())
        # CPU tensors packed into a CUDA `out` buffer.
        out = torch.empty(bucket.nbytes, dtype=torch.uint8, device="cuda")
        assert torch.equal(pack_bucket(bucket, state, out=out).cpu(), cpu_buffer)
