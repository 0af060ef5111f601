"""`PolicyLossConfig`: the correction vocabularies (ours, OpenRLHF's old names, OpenRLHF 0.11.2's
level / mode / gating), KL options, and checks that name the field. No DeepSpeed needed."""

from __future__ import annotations

import math
import os

import msgspec
import pytest
import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from rl_algos import rollout_correction
from rl_learner import PolicyLossConfig
from rl_learner.learner import CORRECTIONS

# learner − rollout log-prob per token: Δ = [log 2, log 0.25, 0 | log 8, 0, ·]; geometric means
# 0.794 (kept by (0.5, 2)) and 2.83 (dropped)
ROLLOUT = torch.zeros(2, 3)
OLD = torch.tensor([[math.log(2.0), math.log(0.25), 0.0], [math.log(8.0), 0.0, 5.0]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


def weights_of(**fields) -> torch.Tensor:
    config = PolicyLossConfig(**fields)
    weights, _ = rollout_correction(OLD, ROLLOUT, MASK, **config.correction_options())
    return weights


def test_constructor_keeps_every_field_rl_launch_passes():
    config = PolicyLossConfig(
        name="ppo",
        options={"epsilon_low": 0.2},
        aggregation="token-mean",
        horizon=None,
        kl_coef=0.01,
        kl_estimator="k3",
        entropy_coef=0.0,
        correction="tis",
        correction_level="token",
        correction_bounds=(0.5, 5.0),
        temperature=1.0,
    )
    assert msgspec.json.decode(msgspec.json.encode(config), type=PolicyLossConfig) == config


def test_seq_mask_keeps_sequences_at_weight_one_and_seq_mask_tis_keeps_token_weights():
    bounds = (0.5, 2.0)
    torch.testing.assert_close(
        weights_of(correction="seq-mask", correction_bounds=bounds),
        torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]),
    )
    torch.testing.assert_close(
        weights_of(correction="seq-mask-tis", correction_bounds=bounds),
        torch.tensor([[2.0, 0.25, 1.0], [0.0, 0.0, 0.0]]),
    )


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"correction": "tis"}, [[2.0, 0.5, 1.0], [5.0, 1.0, 0.0]]),
        ({"correction": "truncate"}, [[2.0, 0.5, 1.0], [5.0, 1.0, 0.0]]),
        ({"correction": "icepop"}, [[2.0, 0.0, 1.0], [0.0, 1.0, 0.0]]),
        ({"correction": "mask"}, [[2.0, 0.0, 1.0], [0.0, 1.0, 0.0]]),
        # sequence products 0.5 and 8
        ({"correction": "truncate", "correction_level": "sequence"}, [[0.5] * 3, [5.0, 5.0, 0.0]]),
        ({"correction": "mask", "correction_level": "sequence"}, [[2.0, 0.25, 1.0], [0.0, 0.0, 0.0]]),
        (
            {"correction": "mask", "correction_level": "geometric", "correction_bounds": (0.5, 2.0)},
            [[2.0, 0.25, 1.0], [0.0] * 3],
        ),
    ],
)
def test_both_vocabularies_give_the_documented_weights(fields, expected):
    torch.testing.assert_close(weights_of(**fields), torch.tensor(expected))


def test_divergence_gating_takes_zero_and_an_upper_bound():
    # probabilities clamped to [1e-6, 1 − 1e-6]: π_rollout ≈ 1 everywhere, π_old ≈ 1 but for the
    # token with Δ = log 0.25 (π_old = 0.25, TV 0.75 > 0.5); survivors keep w_t = exp(Δ_t)
    weights = weights_of(correction="mask", correction_gating="tv", correction_bounds=(0.0, 0.5))
    torch.testing.assert_close(weights, torch.tensor([[2.0, 0.0, 1.0], [8.0, 1.0, 0.0]]))
    with pytest.raises(ValueError, match=r"correction_gating='tv'.*upper bound only: pass low=0"):
        PolicyLossConfig(correction="mask", correction_gating="tv")
    with pytest.raises(ValueError, match=r"correction='truncate'.*needs mode='mask'"):
        PolicyLossConfig(correction="truncate", correction_gating="binary_kl", correction_bounds=(0.0, 0.1))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"correction": "seq_mask"}, r"PolicyLossConfig.correction: 'seq_mask' is not one of 'none', 'tis'"),
        (
            {"correction_level": "seq"},
            r"correction_level: 'seq' is not one of 'token', 'sequence', 'geometric'",
        ),
        ({"correction_gating": "kl"}, r"correction_gating: 'kl' is not one of 'ratio', 'binary_kl', 'tv'"),
        ({"correction": "tis", "correction_bounds": (0.0, 5.0)}, r"low\) must be > 0"),
        ({"correction_bounds": (2.0, 1.0)}, r"must satisfy 0 <= low < high"),
        ({"kl_options": {"value_clamp": -1.0}}, r"PolicyLossConfig.kl_options: .*value_clamp must be > 0"),
        ({"kl_options": {"clamp": 1.0}}, r"PolicyLossConfig.kl_options: .*clamp"),
        ({"name": "vanila"}, r"PolicyLossConfig.name: 'vanila' is not one of"),
        (
            {"correction": "seq-mask", "correction_gating": "tv", "correction_bounds": (0.0, 0.1)},
            r"correction_gating: 'tv' does not apply to correction='seq-mask'",
        ),
    ],
)
def test_bad_settings_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        PolicyLossConfig(**fields)


def test_every_correction_name_builds():
    for correction in CORRECTIONS:
        bounds = (0.5, 5.0)
        PolicyLossConfig(correction=correction, correction_bounds=bounds)


def test_unbiased_gradient_kl_option_is_accepted():
    config = PolicyLossConfig(kl_coef=0.01, kl_options={"unbiased_gradient": True})
    assert config.kl_options == {"unbiased_gradient": True}
