"""Rollout-vs-learner mismatch corrections and metrics."""

from __future__ import annotations

import math

import pytest
import torch

from rl_algos import mismatch_metrics, rollout_correction

# learner − rollout log-prob per token: Δ = [log 2, log 0.25, 0 | log 8, 0, ·]
ROLLOUT = torch.zeros(2, 3)
OLD = torch.tensor([[math.log(2.0), math.log(0.25), 0.0], [math.log(8.0), 0.0, 5.0]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


def test_token_tis_truncates_weights_into_the_range():
    weights, metrics = rollout_correction(OLD, ROLLOUT, MASK, method="tis", low=0.5, high=5.0)
    torch.testing.assert_close(weights, torch.tensor([[2.0, 0.5, 1.0], [5.0, 1.0, 0.0]]))
    assert metrics["correction_clip_fraction"].item() == pytest.approx(2 / 5)


def test_token_icepop_zeroes_weights_outside_the_range():
    weights, metrics = rollout_correction(OLD, ROLLOUT, MASK, method="icepop", low=0.5, high=5.0)
    torch.testing.assert_close(weights, torch.tensor([[2.0, 0.0, 1.0], [0.0, 1.0, 0.0]]))
    assert metrics["correction_mask_fraction"].item() == pytest.approx(2 / 5)


def test_sequence_level_uses_the_product_of_token_ratios():
    # row 0: 2·0.25·1 = 0.5; row 1: 8·1 = 8 → TIS clamps to 5
    weights, _ = rollout_correction(OLD, ROLLOUT, MASK, method="tis", level="sequence", low=0.5, high=5.0)
    torch.testing.assert_close(weights, torch.tensor([[0.5, 0.5, 0.5], [5.0, 5.0, 0.0]]))
    weights, _ = rollout_correction(OLD, ROLLOUT, MASK, method="icepop", level="sequence", low=0.6, high=5.0)
    torch.testing.assert_close(weights, torch.zeros(2, 3))


def test_sequence_mask_drops_sequences_by_geometric_mean_ratio():
    # geometric means: row 0 (0.5)^(1/3) = 0.7937; row 1 sqrt(8) = 2.83
    weights, metrics = rollout_correction(OLD, ROLLOUT, MASK, method="none", sequence_mask_range=(0.5, 2.0))
    torch.testing.assert_close(weights, torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))
    assert metrics["sequence_mask_fraction"].item() == pytest.approx(0.5)


def test_mismatch_metrics_values():
    metrics = mismatch_metrics(OLD, ROLLOUT, MASK)
    deltas = torch.tensor([math.log(2.0), math.log(0.25), 0.0, math.log(8.0), 0.0])
    assert metrics["mismatch_abs_mean"].item() == pytest.approx(deltas.abs().mean().item())
    assert metrics["mismatch_abs_max"].item() == pytest.approx(math.log(8.0))
    k3 = (deltas.exp() - 1 - deltas).mean()
    assert metrics["mismatch_k3"].item() == pytest.approx(k3.item())
    w = deltas.exp()
    assert metrics["mismatch_ess"].item() == pytest.approx((w.sum() ** 2 / (5 * (w**2).sum())).item())


def test_no_mismatch_gives_unit_weights_and_perfect_ess():
    logprobs = -torch.rand(3, 4)
    weights, metrics = rollout_correction(logprobs, logprobs.clone(), torch.ones(3, 4))
    assert torch.equal(weights, torch.ones(3, 4))
    assert metrics["mismatch_ess"].item() == pytest.approx(1.0)
    assert metrics["mismatch_k3"].item() == 0


def test_weights_carry_no_gradient():
    old = OLD.clone().requires_grad_()
    weights, _ = rollout_correction(old, ROLLOUT, MASK)
    assert not weights.requires_grad


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"method": "is"}, r"method must be one of \['icepop', 'none', 'tis'\]"),
        ({"level": "batch"}, r"level must be one of \['sequence', 'token'\]"),
        ({"low": 2.0, "high": 1.0}, r"must satisfy 0 < low < high"),
        ({"low": 0.0}, r"low\) must be > 0"),
        ({"sequence_mask_range": (1.5, 1.2)}, r"sequence_mask_range must satisfy 0 < low < high"),
    ],
)
def test_bad_correction_settings_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        rollout_correction(OLD, ROLLOUT, MASK, **kwargs)


def test_rollout_shape_mismatch_names_both_arguments():
    with pytest.raises(
        ValueError, match=r"rollout_logprobs has shape \(2, 2\) but old_logprobs has shape \(2, 3\)"
    ):
        rollout_correction(OLD, ROLLOUT[:, :2], MASK)
