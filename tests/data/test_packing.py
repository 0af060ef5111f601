"""Tests of rl_data.packing: packing, cu_seqlens helpers, packed <-> padded, block-diagonal attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_data.packing import (
    PackedSequences,
    cu_seqlens_from_lengths,
    lengths_from_cu_seqlens,
    pack_sequences,
    packed_attention_mask,
    packed_to_padded,
    padded_to_packed,
    position_ids_from_cu_seqlens,
    segment_ids,
    unpack_sequences,
)

lengths_lists = st.lists(st.integers(min_value=0, max_value=7), min_size=1, max_size=6)


# --------------------------------------------------------------------------- pack / unpack


def test_pack_sequences_gives_flash_attention_cu_seqlens_and_restarting_positions():
    packed = pack_sequences([torch.tensor([5, 6, 7]), torch.tensor([8]), torch.tensor([9, 10])])
    assert isinstance(packed, PackedSequences)
    assert packed.values.tolist() == [5, 6, 7, 8, 9, 10]
    assert packed.cu_seqlens.tolist() == [0, 3, 4, 6]
    assert packed.cu_seqlens.dtype == torch.int32
    assert packed.position_ids.tolist() == [0, 1, 2, 0, 0, 1]
    assert packed.position_ids.dtype == torch.int64
    assert packed.max_seqlen == 3
    assert packed.num_sequences == 3
    assert packed.num_segments == 3
    assert packed.num_padding == 0


def test_pack_sequences_accepts_lists_of_ints_as_int64():
    packed = pack_sequences([[1, 2], [], [3]])
    assert packed.values.dtype == torch.int64
    assert packed.values.tolist() == [1, 2, 3]
    assert packed.cu_seqlens.tolist() == [0, 2, 2, 3]
    assert packed.position_ids.tolist() == [0, 1, 0]


def test_pack_then_unpack_returns_the_original_sequences():
    sequences = [torch.arange(4) * 3, torch.tensor([7]), torch.arange(2) + 100]
    packed = pack_sequences(sequences)
    unpacked = packed.unpack()
    assert len(unpacked) == 3
    for original, back in zip(sequences, unpacked):
        assert torch.equal(original, back)


def test_padding_to_a_multiple_forms_its_own_segment():
    packed = pack_sequences([[1, 2, 3], [4, 5]], pad_to_multiple_of=4, pad_value=-1)
    assert packed.values.tolist() == [1, 2, 3, 4, 5, -1, -1, -1]
    assert packed.cu_seqlens.tolist() == [0, 3, 5, 8]
    assert packed.position_ids.tolist() == [0, 1, 2, 0, 1, 0, 1, 2]
    assert packed.num_sequences == 2
    assert packed.num_segments == 3
    assert packed.num_padding == 3
    assert packed.max_seqlen == 3
    assert packed.sequence_cu_seqlens.tolist() == [0, 3, 5]
    assert [s.tolist() for s in packed.unpack()] == [[1, 2, 3], [4, 5]]
    # The padding segment never attends to a real token and no real token attends to it.
    mask = packed_attention_mask(packed.cu_seqlens, causal=False)
    assert not mask[5:, :5].any()
    assert not mask[:5, 5:].any()


def test_padding_segment_counts_in_max_seqlen():
    packed = pack_sequences([[1], [2]], pad_to_multiple_of=8)
    assert packed.cu_seqlens.tolist() == [0, 1, 2, 8]
    assert packed.max_seqlen == 6


def test_no_padding_segment_when_the_total_is_already_a_multiple():
    packed = pack_sequences([[1, 2], [3, 4]], pad_to_multiple_of=4)
    assert packed.cu_seqlens.tolist() == [0, 2, 4]
    assert packed.num_segments == packed.num_sequences == 2


def test_unpack_sequences_returns_views_and_accepts_a_batch_dimension():
    packed = torch.arange(12.0).reshape(1, 6, 2)
    pieces = unpack_sequences(packed, torch.tensor([0, 4, 6], dtype=torch.int32))
    assert [tuple(p.shape) for p in pieces] == [(4, 2), (2, 2)]
    pieces[1][0, 0] = -1.0
    assert packed[0, 4, 0] == -1.0


def test_pack_sequences_rejects_empty_input():
    with pytest.raises(ValueError, match="sequences is empty"):
        pack_sequences([])


def test_pack_sequences_rejects_a_sequence_that_is_not_1d_and_names_it():
    with pytest.raises(ValueError, match=r"sequences\[1\] must be 1-D, got shape \(2, 2\)"):
        pack_sequences([torch.tensor([1]), torch.ones(2, 2, dtype=torch.int64)])


def test_pack_sequences_rejects_mixed_dtypes_and_bad_multiple():
    with pytest.raises(ValueError, match=r"sequences\[1\] has dtype torch.float32"):
        pack_sequences([torch.tensor([1]), torch.tensor([1.0])])
    with pytest.raises(ValueError, match="pad_to_multiple_of: expected an integer >= 1, got 0"):
        pack_sequences([[1]], pad_to_multiple_of=0)


def test_unpack_rejects_lengths_that_do_not_add_up_to_the_tokens():
    with pytest.raises(ValueError, match=r"packed has 5 tokens .* add up to 6"):
        unpack_sequences(torch.arange(5), [0, 3, 6])


# --------------------------------------------------------------------------- cu_seqlens helpers


def test_cu_seqlens_helpers_on_a_hand_example():
    cu_seqlens = cu_seqlens_from_lengths([2, 0, 3])
    assert cu_seqlens.tolist() == [0, 2, 2, 5]
    assert cu_seqlens.dtype == torch.int32
    assert lengths_from_cu_seqlens(cu_seqlens).tolist() == [2, 0, 3]
    assert segment_ids(cu_seqlens).tolist() == [0, 0, 2, 2, 2]
    assert position_ids_from_cu_seqlens(cu_seqlens).tolist() == [0, 1, 0, 1, 2]


def test_cu_seqlens_of_no_sequences():
    assert cu_seqlens_from_lengths([]).tolist() == [0]
    assert segment_ids([0]).tolist() == []


@given(lengths_lists)
@settings(max_examples=50, deadline=None)
def test_lengths_round_trip_through_cu_seqlens(lengths):
    cu_seqlens = cu_seqlens_from_lengths(lengths)
    assert lengths_from_cu_seqlens(cu_seqlens).tolist() == lengths
    positions = position_ids_from_cu_seqlens(cu_seqlens).tolist()
    assert positions == [p for length in lengths for p in range(length)]
    assert segment_ids(cu_seqlens).tolist() == [i for i, length in enumerate(lengths) for _ in range(length)]


@pytest.mark.parametrize(
    ("cu_seqlens", "message"),
    [
        ([1, 3], r"cu_seqlens must start at 0, got cu_seqlens\[0\] = 1"),
        ([0, 3, 2], r"non-decreasing, got cu_seqlens\[1\] = 3 > cu_seqlens\[2\] = 2"),
        (torch.zeros(2, 2, dtype=torch.int64), r"shape \[S\+1\]"),
    ],
)
def test_bad_cu_seqlens_are_rejected_with_the_bad_value(cu_seqlens, message):
    with pytest.raises(ValueError, match=message):
        segment_ids(cu_seqlens)


def test_float_cu_seqlens_and_negative_lengths_are_rejected():
    with pytest.raises(TypeError, match=r"cu_seqlens must hold integers, got dtype torch\.float32"):
        position_ids_from_cu_seqlens(torch.tensor([0.0, 2.0]))
    with pytest.raises(ValueError, match=r"lengths must be >= 0, got lengths\[1\] = -2"):
        cu_seqlens_from_lengths([3, -2])


# --------------------------------------------------------------------------- packed <-> padded


def test_packed_to_padded_right_and_left_on_a_hand_example():
    packed = torch.tensor([1, 2, 3, 4, 5, 6])
    cu_seqlens = [0, 3, 4, 6]
    right = packed_to_padded(packed, cu_seqlens, pad_value=-1)
    assert right.tolist() == [[1, 2, 3], [4, -1, -1], [5, 6, -1]]
    left = packed_to_padded(packed, cu_seqlens, pad_value=-1, padding_side="left")
    assert left.tolist() == [[1, 2, 3], [-1, -1, 4], [-1, 5, 6]]
    assert padded_to_packed(right, [3, 1, 2]).tolist() == packed.tolist()
    assert padded_to_packed(left, [3, 1, 2], padding_side="left").tolist() == packed.tolist()


def test_packed_to_padded_keeps_trailing_dimensions_and_accepts_a_batch_dimension():
    packed = torch.arange(10.0).reshape(1, 5, 2)
    padded = packed_to_padded(packed, [0, 2, 5])
    assert padded.shape == (2, 3, 2)
    assert padded[0, 2].tolist() == [0.0, 0.0]
    assert padded[1, 0].tolist() == [4.0, 5.0]


@pytest.mark.parametrize("padding_side", ["right", "left"])
@given(lengths=lengths_lists, extra=st.integers(min_value=0, max_value=2))
@settings(max_examples=40, deadline=None)
def test_packed_padded_round_trips(padding_side, lengths, extra):
    total = sum(lengths)
    packed = torch.randn(total, 3, dtype=torch.float64)
    cu_seqlens = cu_seqlens_from_lengths(lengths)
    padded = packed_to_padded(packed, cu_seqlens, padding_side=padding_side)
    assert padded.shape == (len(lengths), max(lengths), 3)
    assert torch.equal(padded_to_packed(padded, lengths, padding_side=padding_side), packed)
    # A wider padded tensor (more padding) gives the same tokens back.
    wide = F.pad(padded, (0, 0, extra, 0) if padding_side == "left" else (0, 0, 0, extra))
    assert torch.equal(padded_to_packed(wide, lengths, padding_side=padding_side), packed)
    for row, piece in enumerate(unpack_sequences(packed, cu_seqlens)):
        kept = (
            padded[row, : lengths[row]]
            if padding_side == "right"
            else padded[row, max(lengths) - lengths[row] :]
        )
        assert torch.equal(kept, piece)


def test_gradients_flow_through_packed_to_padded_and_back():
    packed = torch.randn(6, dtype=torch.float64, requires_grad=True)
    weights = torch.randn(3, 3, dtype=torch.float64)
    padded = packed_to_padded(packed, [0, 3, 4, 6], pad_value=5.0)
    (padded * weights).sum().backward()
    expected = torch.cat([weights[0, :3], weights[1, :1], weights[2, :2]])
    assert torch.equal(packed.grad, expected)

    source = torch.randn(3, 3, dtype=torch.float64, requires_grad=True)
    out_weights = torch.randn(6, dtype=torch.float64)
    (padded_to_packed(source, [3, 1, 2]) * out_weights).sum().backward()
    expected_padded = torch.zeros(3, 3, dtype=torch.float64)
    expected_padded[0, :3], expected_padded[1, :1], expected_padded[2, :2] = (
        out_weights[:3],
        out_weights[3:4],
        out_weights[4:],
    )
    assert torch.equal(source.grad, expected_padded)


def test_bad_padding_side_names_the_allowed_values():
    with pytest.raises(ValueError, match=r"padding_side must be one of \('right', 'left'\), got 'middle'"):
        packed_to_padded(torch.arange(3), [0, 3], padding_side="middle")
    with pytest.raises(ValueError, match=r"padding_side must be one of"):
        padded_to_packed(torch.zeros(1, 3), [3], padding_side="top")


def test_padded_to_packed_rejects_inconsistent_lengths():
    with pytest.raises(ValueError, match=r"lengths\[1\] = 4 is longer than the padded width 3"):
        padded_to_packed(torch.zeros(2, 3), [1, 4])
    with pytest.raises(ValueError, match="lengths has 1 entries but padded has 2 rows"):
        padded_to_packed(torch.zeros(2, 3), [1])
    with pytest.raises(ValueError, match=r"packed has 4 tokens .* add up to 3"):
        packed_to_padded(torch.zeros(4), [0, 3])


# --------------------------------------------------------------------------- attention mask


def test_packed_attention_mask_is_block_diagonal_and_causal():
    mask = packed_attention_mask([0, 2, 3])
    assert mask.tolist() == [[True, False, False], [True, True, False], [False, False, True]]
    full = packed_attention_mask([0, 2, 3], causal=False)
    assert full.tolist() == [[True, True, False], [True, True, False], [False, False, True]]


@pytest.mark.parametrize("causal", [True, False])
def test_sdpa_over_a_packed_row_with_the_mask_equals_attention_per_sequence(causal):
    generator = torch.Generator().manual_seed(0)
    lengths = [5, 1, 3, 7]
    heads, dim = 2, 4
    total = sum(lengths)
    q, k, v = (torch.randn(heads, total, dim, dtype=torch.float64, generator=generator) for _ in range(3))
    cu_seqlens = cu_seqlens_from_lengths(lengths)
    mask = packed_attention_mask(cu_seqlens, causal=causal)
    packed_out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    pieces = []
    for start, end in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        pieces.append(
            F.scaled_dot_product_attention(
                q[:, start:end], k[:, start:end], v[:, start:end], is_causal=causal
            )
        )
    torch.testing.assert_close(packed_out, torch.cat(pieces, dim=1), rtol=1e-12, atol=1e-12)
