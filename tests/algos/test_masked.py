"""Masked statistics and whitening, including global statistics over real gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rl_algos import masked_mean, masked_mean_var, masked_whiten
from rl_data.sync.broadcast import free_port

VALUES = torch.tensor([[1.0, 2.0, 100.0], [3.0, 4.0, -50.0]])
MASK = torch.tensor([[1, 1, 0], [1, 1, 0]])


def test_masked_whiten_uses_population_variance_and_zeroes_masked_entries():
    out = masked_whiten(VALUES, MASK)
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])
    expected = (x - 2.5) / x.var(correction=0).sqrt()
    torch.testing.assert_close(out[MASK.bool()], expected)
    assert torch.all(out[~MASK.bool()] == 0)


def test_masked_whiten_unbiased_and_without_mean_shift():
    out = masked_whiten(VALUES, MASK, unbiased=True, shift_mean=False)
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])
    torch.testing.assert_close(out[MASK.bool()], (x - 2.5) / x.std() + 2.5)


def test_masked_whiten_of_constant_values_is_zero_not_nan():
    out = masked_whiten(torch.full((2, 3), 7.0), torch.ones(2, 3))
    assert torch.equal(out, torch.zeros(2, 3))


def test_masked_mean_var_is_stable_for_large_offsets():
    x = torch.tensor([[1e8 + 1.0, 1e8 + 2.0, 1e8 + 3.0]], dtype=torch.float64)
    _, var, count = masked_mean_var(x, torch.ones(1, 3))
    assert var.item() == pytest.approx(2 / 3)
    assert count.item() == 3


def test_masked_mean_of_empty_mask_is_zero():
    assert masked_mean(VALUES, torch.zeros(2, 3)).item() == 0


def _whiten_shard(rank: int, world: int, port: int, values, mask, results) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        rows = slice(rank * 2, rank * 2 + 2)
        out = masked_whiten(values[rows], mask[rows], all_reduce=dist.all_reduce)
        results[rank] = out
    finally:
        dist.destroy_process_group()


def test_whitening_with_all_reduce_over_two_gloo_ranks_equals_full_batch_whitening():
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(4, 6, generator=gen) * 3 + 1
    mask = (torch.rand(4, 6, generator=gen) < 0.6).int()
    mask[:, 0] = 1
    manager = mp.Manager()
    results = manager.dict()
    mp.spawn(_whiten_shard, args=(2, free_port(), values, mask, results), nprocs=2, join=True)
    sharded = torch.cat([results[0], results[1]])
    torch.testing.assert_close(sharded, masked_whiten(values, mask))
    # and the shards alone would have given something else
    assert not torch.allclose(masked_whiten(values[:2], mask[:2]), sharded[:2])


def test_masked_mean_ignores_non_finite_values_at_masked_positions():
    values = torch.tensor([[1.0, float("inf")], [3.0, float("nan")]])
    assert masked_mean(values, torch.tensor([[1, 0], [1, 0]])).item() == 2.0
