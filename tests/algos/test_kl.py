"""KL estimators and controllers."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_algos import KL_ESTIMATORS, AdaptiveKLController, FixedKLController, kl_penalty

LOGP = torch.tensor([[-1.0]])
REF = torch.tensor([[-1.5]])


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("k1", 0.5),
        ("kl", 0.5),
        ("k2", 0.125),
        ("mse", 0.125),
        ("k3", 0.106531),
        ("low_var_kl", 0.106531),
        ("abs", 0.5),
    ],
)
def test_kl_estimators_reproduce_reference_values(name, expected):
    assert kl_penalty(LOGP, REF, name).item() == pytest.approx(expected, abs=1e-6)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-30, 30, allow_nan=False), min_size=1, max_size=20))
def test_k2_and_k3_are_non_negative(log_ratios):
    d = torch.tensor([log_ratios])
    zeros = torch.zeros_like(d)
    for name in ("k2", "k3"):
        assert torch.all(kl_penalty(d, zeros, name, value_clamp=None) >= 0)


def test_k3_is_accurate_for_tiny_log_ratios():
    d = torch.tensor([[1e-4]], dtype=torch.float64)
    # exp(−d) − 1 + d = d²/2 − d³/6 + ... ≈ 4.99983e-9
    assert kl_penalty(d, torch.zeros_like(d), "k3").item() == pytest.approx(1e-8 / 2 - 1e-12 / 6, rel=1e-6)


@pytest.mark.parametrize("name", ["k1", "k3", "abs", "k2"])
def test_straight_through_variant_has_named_value_and_k2_gradient(name):
    logprobs = torch.tensor([[-1.0, -0.2, -3.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -0.1, -1.0]])
    plain = kl_penalty(logprobs, ref, name)
    plus = kl_penalty(logprobs, ref, name + "+")
    torch.testing.assert_close(plus, plain)
    (grad_plus,) = torch.autograd.grad(plus.sum(), logprobs)
    (grad_k2,) = torch.autograd.grad(kl_penalty(logprobs, ref, "k2").sum(), logprobs)
    torch.testing.assert_close(grad_plus, grad_k2)


def test_value_clamp_and_log_ratio_clamp():
    logp = torch.tensor([[0.0]])
    ref = torch.tensor([[-40.0]])
    assert kl_penalty(logp, ref, "k1").item() == 10.0  # OpenRLHF: result clamped to ±10
    assert kl_penalty(logp, ref, "k1", value_clamp=None).item() == 40.0  # TRL: no clamp
    assert (
        kl_penalty(logp, ref, "k1", log_ratio_clamp=20.0, value_clamp=None).item() == 20.0
    )  # verl: d to ±20


def test_kl_output_is_float32_for_bf16_input():
    out = kl_penalty(LOGP.bfloat16(), REF.bfloat16(), "k3")
    assert out.dtype == torch.float32


def test_unknown_kl_estimator_lists_names_with_plus_variants():
    with pytest.raises(ValueError, match=r"unknown KL estimator 'k4'; known names: .*k3.*k3\+"):
        kl_penalty(LOGP, REF, "k4")


def test_kl_shape_mismatch_names_both_arguments():
    with pytest.raises(ValueError, match=r"ref_logprobs has shape \(1, 2\) but logprobs has shape \(1, 1\)"):
        kl_penalty(LOGP, torch.zeros(1, 2))


def test_kl_registry_accepts_user_estimators():
    KL_ESTIMATORS.register("test_half_k1", lambda d: 0.5 * d)
    try:
        assert kl_penalty(LOGP, REF, "test_half_k1").item() == pytest.approx(0.25)
    finally:
        del KL_ESTIMATORS["test_half_k1"]


def test_fixed_controller_never_moves():
    controller = FixedKLController(0.01)
    assert controller.update(current_kl=100.0, n_steps=1000) == 0.01


def test_adaptive_controller_follows_the_proportional_rule():
    controller = AdaptiveKLController(init_kl_coef=0.1, target=6.0, horizon=10000)
    # KL 12 → error clip(1, ±0.2) = 0.2 → β = 0.1·(1 + 0.2·100/10000) = 0.1002
    assert controller.update(12.0, 100) == pytest.approx(0.1002)
    # KL 5.4 → error −0.1 → β = 0.1002·(1 − 0.1·0.01) = 0.1000998
    assert controller.update(5.4, 100) == pytest.approx(0.1002 * (1 - 0.001))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"init_kl_coef": 0.0, "target": 1.0, "horizon": 1.0}, "init_kl_coef must be > 0"),
        ({"init_kl_coef": 0.1, "target": -1.0, "horizon": 1.0}, "target must be > 0"),
        ({"init_kl_coef": 0.1, "target": 1.0, "horizon": 0}, "horizon must be > 0"),
    ],
)
def test_adaptive_controller_rejects_non_positive_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AdaptiveKLController(**kwargs)


def test_plus_variants_are_plain_registry_names():
    from rl_algos import StraightThroughKL

    for name, base in [("k1", "kl"), ("k2", "mse"), ("k3", "low_var_kl"), ("abs", None)]:
        entry = KL_ESTIMATORS[f"{name}+"]
        assert isinstance(entry, StraightThroughKL)
        assert entry.estimator is KL_ESTIMATORS[name]
        if base is not None:
            assert KL_ESTIMATORS[f"{base}+"] is entry
    assert not isinstance(KL_ESTIMATORS["k3"], StraightThroughKL)


def test_straight_through_entry_called_alone_has_k3_value_and_k2_gradient():
    d = torch.tensor([0.5, -1.0], requires_grad=True)
    value = KL_ESTIMATORS["k3+"](d)
    torch.testing.assert_close(value, KL_ESTIMATORS["k3"](d.detach()))
    value.sum().backward()
    torch.testing.assert_close(d.grad, d.detach())
