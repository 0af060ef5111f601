"""`PolicyLossConfig`: the correction (a name in `rl_algos.CORRECTIONS`, its options verbatim),
KL options, and checks that name the field. No DeepSpeed needed."""

from __future__ import annotations

import math
import os

import msgspec
import pytest
import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from rl_algos import CORRECTIONS
from rl_learner import PolicyLossConfig

# learner − rollout log-prob per token: Δ = [log 2, log 0.25, 0 | log 8, 0, ·]; geometric means
# 0.794 (kept by (0.5, 2)) and 2.83 (dropped)
ROLLOUT = torch.zeros(2, 3)
OLD = torch.tensor([[math.log(2.0), math.log(0.25), 0.0], [math.log(8.0), 0.0, 5.0]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


def weights_of(**fields) -> torch.Tensor:
    config = PolicyLossConfig(**fields)
    weights, _ = CORRECTIONS[config.correction](OLD, ROLLOUT, MASK, **config.correction_options)
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
        correction_options={"level": "token", "low": 0.5, "high": 5.0},
        temperature=1.0,
    )
    assert msgspec.json.decode(msgspec.json.encode(config), type=PolicyLossConfig) == config


def test_seq_mask_keeps_sequences_at_weight_one_and_seq_mask_tis_keeps_token_weights():
    bounds = {"low": 0.5, "high": 2.0}
    torch.testing.assert_close(
        weights_of(correction="seq-mask", correction_options=bounds),
        torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]),
    )
    torch.testing.assert_close(
        weights_of(correction="seq-mask-tis", correction_options=bounds),
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
        (
            {"correction": "truncate", "correction_options": {"level": "sequence"}},
            [[0.5] * 3, [5.0, 5.0, 0.0]],
        ),
        (
            {"correction": "mask", "correction_options": {"level": "sequence"}},
            [[2.0, 0.25, 1.0], [0.0, 0.0, 0.0]],
        ),
        (
            {"correction": "mask", "correction_options": {"level": "geometric", "low": 0.5, "high": 2.0}},
            [[2.0, 0.25, 1.0], [0.0] * 3],
        ),
    ],
)
def test_named_corrections_give_the_documented_weights(fields, expected):
    torch.testing.assert_close(weights_of(**fields), torch.tensor(expected))


def test_divergence_gating_takes_zero_and_an_upper_bound():
    # probabilities clamped to [1e-6, 1 − 1e-6]: π_rollout ≈ 1 everywhere, π_old ≈ 1 but for the
    # token with Δ = log 0.25 (π_old = 0.25, TV 0.75 > 0.5); survivors keep w_t = exp(Δ_t)
    weights = weights_of(correction="mask", correction_options={"gating": "tv", "low": 0.0, "high": 0.5})
    torch.testing.assert_close(weights, torch.tensor([[2.0, 0.0, 1.0], [8.0, 1.0, 0.0]]))
    with pytest.raises(
        ValueError, match=r"correction_options: .*'mask'.*gating='tv'.*upper bound only: pass low=0"
    ):
        PolicyLossConfig(correction="mask", correction_options={"gating": "tv"})
    with pytest.raises(
        ValueError, match=r"correction_options: .*'truncate'.*unexpected keyword argument 'gating'"
    ):
        PolicyLossConfig(
            correction="truncate", correction_options={"gating": "binary_kl", "low": 0.0, "high": 0.1}
        )


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"correction": "seq_mask"},
            r"PolicyLossConfig.correction: 'seq_mask' is not 'none' nor one of icepop",
        ),
        (
            {"correction": "tis", "correction_options": {"level": "seq"}},
            r"correction_options: .*level must be one of \['geometric', 'sequence', 'token'\], got 'seq'",
        ),
        (
            {"correction": "mask", "correction_options": {"gating": "kl"}},
            r"correction_options: .*gating must be one of \['binary_kl', 'ratio', 'tv'\], got 'kl'",
        ),
        ({"correction": "tis", "correction_options": {"low": 0.0, "high": 5.0}}, r"low\) must be > 0"),
        (
            {"correction": "tis", "correction_options": {"low": 2.0, "high": 1.0}},
            r"must satisfy 0 < low < high",
        ),
        (
            {"correction_options": {"low": 0.5}},
            r"PolicyLossConfig.correction_options: .*correction is 'none'",
        ),
        ({"kl_options": {"value_clamp": -1.0}}, r"PolicyLossConfig.kl_options: .*value_clamp must be > 0"),
        ({"kl_options": {"clamp": 1.0}}, r"PolicyLossConfig.kl_options: .*clamp"),
        ({"name": "vanila"}, r"PolicyLossConfig.name: 'vanila' is not one of"),
        (
            {"correction": "seq-mask", "correction_options": {"gating": "tv", "low": 0.0, "high": 0.1}},
            r"correction_options: .*'seq-mask'.*unexpected keyword argument 'gating'",
        ),
    ],
)
def test_bad_settings_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        PolicyLossConfig(**fields)


def test_every_correction_name_builds():
    for correction in ["none", *CORRECTIONS]:
        PolicyLossConfig(correction=correction)
    for correction in CORRECTIONS:
        PolicyLossConfig(correction=correction, correction_options={"low": 0.5, "high": 5.0})


def test_plus_kl_estimators_are_registry_names():
    assert PolicyLossConfig(kl_coef=0.01, kl_estimator="k3+").kl_estimator == "k3+"
    with pytest.raises(ValueError, match=r"PolicyLossConfig.kl_estimator: 'k4\+' is not one of"):
        PolicyLossConfig(kl_estimator="k4+")


def test_unbiased_gradient_kl_option_is_accepted():
    config = PolicyLossConfig(kl_coef=0.01, kl_options={"unbiased_gradient": True})
    assert config.kl_options == {"unbiased_gradient": True}


def test_the_options_are_dry_run_once_per_option_set_not_per_construction(monkeypatch):
    # The launcher builds the config every step (β from the KL controller) and every rank
    # unpickles it: the correction's and the KL's options are dry-run once, not each time.
    import pickle

    import rl_learner.learner as learner

    calls: list[str] = []
    real_kl, real_tis = learner.kl_penalty, CORRECTIONS["tis"]
    monkeypatch.setattr(learner, "_CHECKED_OPTIONS", {})
    monkeypatch.setattr(learner, "kl_penalty", lambda *a, **k: calls.append("kl") or real_kl(*a, **k))
    monkeypatch.setitem(CORRECTIONS, "tis", lambda *a, **k: calls.append("tis") or real_tis(*a, **k))
    options = {"kl_options": {"value_clamp": 5.0}, "correction": "tis", "correction_options": {"high": 2.0}}
    for step in range(5):
        pickle.loads(pickle.dumps(PolicyLossConfig(kl_coef=0.01 * step, **options)))
    assert calls == ["tis", "kl"]
    PolicyLossConfig(kl_coef=0.01, **{**options, "kl_options": {"value_clamp": 4.0}})  # another set
    assert calls == ["tis", "kl", "tis", "kl"]
    with pytest.raises(ValueError, match=r"PolicyLossConfig.kl_options: .*value_clamp must be > 0"):
        PolicyLossConfig(kl_options={"value_clamp": -1.0})  # a refused set is never remembered
    with pytest.raises(ValueError, match=r"PolicyLossConfig.kl_options: .*value_clamp must be > 0"):
        PolicyLossConfig(kl_options={"value_clamp": -1.0})
