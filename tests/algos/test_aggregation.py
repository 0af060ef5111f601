"""Loss aggregation: worked values and the micro-batch / rank invariance every mode must keep."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_algos import AGGREGATION_MODES, aggregate_loss, loss_normalizer

LOSS = torch.tensor([[1.0, 2.0, 7.0, 9.0], [1.0, 1.0, 1.0, 1.0]])
MASK = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 7 / 6),
        ("seq-mean-token-sum", 3.5),
        ("seq-mean-token-mean", 1.25),
        ("seq-mean-token-sum-norm", 0.875),
    ],
)
def test_aggregation_modes_reproduce_reference_values(mode, expected):
    assert aggregate_loss(LOSS, MASK, mode).item() == pytest.approx(expected)


def test_dr_grpo_norm_uses_the_given_horizon_not_the_padded_length():
    # Σ l·m = 7 over 2 sequences and T = 16 → 7/32, whatever the tensor's padded width
    assert aggregate_loss(LOSS, MASK, "seq-mean-token-sum-norm", horizon=16).item() == pytest.approx(7 / 32)


def test_local_normalizers_count_tokens_or_non_empty_sequences():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 1]])
    assert loss_normalizer(mask, "token-mean").item() == 4
    for mode in AGGREGATION_MODES[1:]:
        assert loss_normalizer(mask, mode).item() == 2


def split_points(draw, n):
    cuts = sorted(set(draw(st.lists(st.integers(1, max(1, n - 1)), max_size=4)))) if n > 1 else []
    return [0, *cuts, n]


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
@settings(max_examples=25, deadline=None)
@given(data=st.data(), batch=st.integers(1, 10), seq=st.integers(1, 12), seed=st.integers(0, 2**16))
def test_summed_micro_batch_losses_equal_the_full_batch_loss(mode, data, batch, seq, seed):
    gen = torch.Generator().manual_seed(seed)
    per_token = torch.randn(batch, seq, generator=gen, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(batch, seq, generator=gen) < 0.6
    full = aggregate_loss(per_token, mask, mode, horizon=seq)
    (full_grad,) = torch.autograd.grad(full, per_token)

    # Split rows into micro-batches (ragged on purpose), each trimmed to its own padded width
    # the way a packer would; the global normaliser is the sum of the local ones.
    cuts = split_points(data.draw, batch)
    pieces = [(per_token[a:b], mask[a:b]) for a, b in itertools.pairwise(cuts) if b > a]
    normalizer = sum(loss_normalizer(m, mode) for _, m in pieces).clamp(min=1)
    total = 0
    for loss_piece, mask_piece in pieces:
        width = int(mask_piece.any(0).nonzero().max()) + 1 if mask_piece.any() else 1
        total = total + aggregate_loss(
            loss_piece[:, :width], mask_piece[:, :width], mode, normalizer=normalizer, horizon=seq
        )
    (split_grad,) = torch.autograd.grad(total, per_token)
    torch.testing.assert_close(total, full)
    torch.testing.assert_close(split_grad, full_grad)


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_two_ranks_by_two_micro_batches_equal_one_rank_by_four(mode):
    gen = torch.Generator().manual_seed(3)
    per_token = torch.randn(8, 5, generator=gen, dtype=torch.float64)
    mask = torch.rand(8, 5, generator=gen) < 0.5
    mask[:, 0] = True
    normalizer = loss_normalizer(mask, mode)
    one_rank = sum(
        aggregate_loss(per_token[i : i + 2], mask[i : i + 2], mode, normalizer=normalizer)
        for i in range(0, 8, 2)
    )
    ranks = [(0, 1, 4, 5), (2, 3, 6, 7)]  # a different interleaving across ranks
    two_ranks = sum(
        aggregate_loss(per_token[list(pair)], mask[list(pair)], mode, normalizer=normalizer)
        for rank in ranks
        for pair in (rank[:2], rank[2:])
    )
    torch.testing.assert_close(two_ranks, one_rank)
    torch.testing.assert_close(one_rank, aggregate_loss(per_token, mask, mode))


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_masked_tokens_get_zero_gradient(mode):
    per_token = torch.randn(3, 4, requires_grad=True)
    mask = torch.tensor([[1, 0, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    (grad,) = torch.autograd.grad(aggregate_loss(per_token, mask, mode), per_token)
    assert torch.all(grad[mask == 0] == 0)
    assert torch.all(grad[mask == 1] != 0)


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_non_finite_values_at_masked_positions_do_not_leak(mode):
    per_token = torch.tensor([[1.0, float("inf")], [2.0, float("nan")]], requires_grad=True)
    mask = torch.tensor([[1, 0], [1, 0]])
    loss = aggregate_loss(per_token, mask, mode, horizon=2)
    (grad,) = torch.autograd.grad(loss, per_token)
    assert torch.isfinite(loss)
    assert torch.all(grad[:, 1] == 0)


def test_all_masked_batch_gives_zero_not_nan():
    for mode in AGGREGATION_MODES:
        assert aggregate_loss(torch.randn(2, 3), torch.zeros(2, 3), mode).item() == 0


def test_unknown_mode_lists_allowed_modes():
    with pytest.raises(ValueError, match=r"mode must be one of \['seq-mean-token-mean'"):
        aggregate_loss(LOSS, MASK, "mean")


@pytest.mark.parametrize(
    "normalizer", [0, -2.0, torch.tensor(0.0), torch.tensor([-3]), torch.tensor(float("nan"))]
)
def test_non_positive_normalizer_is_rejected(normalizer):
    with pytest.raises(ValueError, match="normalizer must be > 0"):
        aggregate_loss(LOSS, MASK, normalizer=normalizer)


def test_mask_shape_mismatch_names_both_arguments():
    with pytest.raises(
        ValueError, match=r"action_mask has shape \(2, 3\) but per_token_loss has shape \(2, 4\)"
    ):
        aggregate_loss(LOSS, MASK[:, :3])


def test_bad_horizon_is_rejected():
    with pytest.raises(ValueError, match="horizon must be a positive int"):
        aggregate_loss(LOSS, MASK, "seq-mean-token-sum-norm", horizon=0)


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_float64_losses_aggregate_in_float64_and_half_precision_in_float32(mode):
    per_token = torch.tensor([[1.0, 2.0, 0.0], [1.0 / 3.0, 1.0, 1.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    exact = aggregate_loss(per_token, mask, mode, normalizer=3)
    assert exact.dtype == torch.float64
    assert aggregate_loss(per_token.float(), mask, mode).dtype == torch.float32
    assert aggregate_loss(per_token.bfloat16(), mask, mode).dtype == torch.float32
    torch.testing.assert_close(exact.float(), aggregate_loss(per_token.float(), mask, mode, normalizer=3))
