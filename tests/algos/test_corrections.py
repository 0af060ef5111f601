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
        ({"level": "batch"}, r"level must be one of \['geometric', 'sequence', 'token'\]"),
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


# ------------------------------------------------- OpenRLHF 0.11.2: level × mode × gating

WORKED_OLD = torch.tensor([[math.log(2.0), math.log(8.0), math.log(0.25)]])
WORKED_ROLLOUT = torch.zeros(1, 3)


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"mode": "truncate"}, [2.0, 5.0, 0.5]),
        ({"mode": "mask"}, [2.0, 0.0, 0.0]),
        # geometric mean (2·8·0.25)^(1/3) = 1.587 is inside: survivors keep w_t (OpenRLHF) ...
        ({"mode": "mask", "level": "geometric"}, [2.0, 8.0, 0.25]),
        # ... the geometric mean itself (verl) ... or 1 (Geo-Mask, a pure filter)
        ({"mode": "mask", "level": "geometric", "mask_weight": "level"}, [1.587401] * 3),
        ({"mode": "mask", "level": "geometric", "mask_weight": "one"}, [1.0, 1.0, 1.0]),
        # the product 4 is inside [0.5, 5]
        ({"mode": "truncate", "level": "sequence"}, [4.0, 4.0, 4.0]),
        ({"mode": "truncate", "level": "geometric"}, [1.587401] * 3),
        ({"mode": "mask", "level": "sequence", "high": 3.0}, [0.0, 0.0, 0.0]),
        ({"mode": "none"}, [1.0, 1.0, 1.0]),
    ],
)
def test_level_mode_and_mask_weight_worked_values(kwargs, expected):
    options = {"low": 0.5, "high": 5.0, **kwargs}
    weights, _ = rollout_correction(WORKED_OLD, WORKED_ROLLOUT, torch.ones(1, 3), **options)
    torch.testing.assert_close(weights, torch.tensor([expected]))


def test_sequence_mask_keeping_unit_weight_or_token_weight():
    # row 0 geometric mean 0.794 is inside (0.5, 2), row 1 (2.83) is not
    options = {"mode": "mask", "level": "geometric", "low": 0.5, "high": 2.0}
    ones, metrics = rollout_correction(OLD, ROLLOUT, MASK, mask_weight="one", **options)
    torch.testing.assert_close(ones, torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))
    assert metrics["correction_mask_fraction"].item() == pytest.approx(2 / 5)
    token, _ = rollout_correction(OLD, ROLLOUT, MASK, mask_weight="token", **options)
    torch.testing.assert_close(token, torch.tensor([[2.0, 0.25, 1.0], [0.0, 0.0, 0.0]]))
    # the legacy spelling of the pure filter gives the same weights
    legacy, _ = rollout_correction(OLD, ROLLOUT, MASK, method="none", sequence_mask_range=(0.5, 2.0))
    torch.testing.assert_close(legacy, ones)


# p = π_rollout, q = π_old: token 0 p = 0.2, q = 0.3; token 1 p = 0.2, q = 0.5
GATE_ROLLOUT = torch.tensor([[math.log(0.2), math.log(0.2)]])
GATE_OLD = torch.tensor([[math.log(0.3), math.log(0.5)]])


def test_binary_kl_gating_masks_tokens_beyond_the_divergence_bound():
    # binary KL: 0.2·ln(2/3) + 0.8·ln(8/7) = 0.025732;  0.2·ln(0.4) + 0.8·ln(1.6) = 0.192745
    weights, metrics = rollout_correction(
        GATE_OLD, GATE_ROLLOUT, torch.ones(1, 2), mode="mask", gating="binary_kl", low=0.0, high=0.05
    )
    torch.testing.assert_close(weights, torch.tensor([[1.5, 0.0]]))  # survivors keep w = q/p
    assert metrics["mismatch_binary_kl"].item() == pytest.approx((0.025732 + 0.192745) / 2, abs=1e-6)
    assert metrics["correction_mask_fraction"].item() == pytest.approx(0.5)


def test_tv_gating_per_token_and_per_sequence_mean():
    # |p − q| = [0.1, 0.3]; sequence mean 0.2
    options = {"mode": "mask", "gating": "tv", "low": 0.0}
    token, _ = rollout_correction(GATE_OLD, GATE_ROLLOUT, torch.ones(1, 2), high=0.2, **options)
    torch.testing.assert_close(token, torch.tensor([[1.5, 0.0]]))
    kept, _ = rollout_correction(
        GATE_OLD, GATE_ROLLOUT, torch.ones(1, 2), level="sequence", high=0.25, **options
    )
    torch.testing.assert_close(kept, torch.tensor([[1.5, 2.5]]))
    dropped, _ = rollout_correction(
        GATE_OLD, GATE_ROLLOUT, torch.ones(1, 2), level="sequence", high=0.15, **options
    )
    torch.testing.assert_close(dropped, torch.zeros(1, 2))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"method": "tis", "mode": "mask"}, "give method .legacy. or mode, not both"),
        ({"mode": "clip"}, r"mode must be one of \['mask', 'none', 'truncate'\]"),
        ({"gating": "kl"}, r"gating must be one of \['binary_kl', 'ratio', 'tv'\]"),
        ({"mode": "mask", "mask_weight": "w"}, r"mask_weight must be one of \['level', 'one', 'token'\]"),
        ({"mode": "truncate", "gating": "tv", "low": 0.0, "high": 0.1}, "needs mode='mask'"),
        ({"mode": "mask", "gating": "tv", "low": 0.5, "high": 1.0}, "upper bound only: pass low=0"),
        (
            {"mode": "mask", "gating": "binary_kl", "level": "geometric", "low": 0.0, "high": 0.1},
            "ratio level",
        ),
    ],
)
def test_bad_level_mode_gating_combinations_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        rollout_correction(OLD, ROLLOUT, MASK, **kwargs)
