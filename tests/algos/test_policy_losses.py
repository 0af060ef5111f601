"""Policy and value losses: worked values, on-policy gradients, masking, bad input."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_algos import POLICY_LOSSES, aggregate_loss, value_loss

ALL_LOSSES = [
    "ppo",
    "vanilla",
    "gspo",
    "gspo_sequence",
    "gmpo",
    "cispo",
    "sapo",
    "reinforce",
    "kl_cov",
    "clip_cov",
]
# Clip-Cov cuts the gradient of a few high-covariance tokens, so it is not the plain policy
# gradient on-policy; every other loss is.
ON_POLICY_PG_LOSSES = [name for name in ALL_LOSSES if name != "clip_cov"]


def ppo_worked_inputs():
    advantages = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
    ratio = torch.tensor([[1.5, 1.5, 0.5, 5.0]])
    old = torch.full((1, 4), -2.0)
    return old + ratio.log(), old, advantages, torch.ones(1, 4)


def test_ppo_clip_higher_dual_clip_reproduces_reference_values():
    logprobs, old, advantages, mask = ppo_worked_inputs()
    loss, metrics = POLICY_LOSSES["ppo"](
        logprobs, old, advantages, mask, epsilon_low=0.2, epsilon_high=0.28, dual_clip=3.0
    )
    torch.testing.assert_close(loss, torch.tensor([[-1.28, 1.5, -0.5, 3.0]]))
    # only token 0 takes the clipped branch; only token 3 hits the dual clip
    assert metrics["clip_fraction"].item() == pytest.approx(0.25)
    assert metrics["clip_fraction_high"].item() == pytest.approx(0.25)
    assert metrics["dual_clip_fraction"].item() == pytest.approx(0.25)
    expected_kl = -sum(math.log(r) for r in [1.5, 1.5, 0.5, 5.0]) / 4
    assert metrics["ppo_kl"].item() == pytest.approx(expected_kl, abs=1e-6)


def test_ppo_without_dual_clip_leaves_large_negative_advantage_loss_unbounded():
    logprobs, old, advantages, mask = ppo_worked_inputs()
    loss, metrics = POLICY_LOSSES["ppo"](logprobs, old, advantages, mask, epsilon_low=0.2)
    # ε_high defaults to ε_low: token 0 → −1.2; token 3 → 5.0 (no cap)
    torch.testing.assert_close(loss, torch.tensor([[-1.2, 1.5, -0.5, 5.0]]))
    assert "dual_clip_fraction" not in metrics


def test_gspo_clips_the_length_normalised_sequence_ratio():
    # d = [0.1, 0.3] → s = exp(0.2) = 1.221403, beyond 1 + 4e-4
    old = torch.zeros(2, 2)
    logprobs = torch.tensor([[0.1, 0.3], [0.1, 0.3]])
    advantages = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    loss, _ = POLICY_LOSSES["gspo"](logprobs, old, advantages, torch.ones(2, 2))
    # A > 0: −min(s, 1.0004) = −1.0004; A < 0: max(s, 1 − 3e-4)·1 = 1.221403
    torch.testing.assert_close(loss, torch.tensor([[-1.0004, -1.0004], [1.221403, 1.221403]]))


def test_gmpo_takes_the_geometric_mean_of_sign_aware_clipped_ratios():
    old = torch.zeros(2, 3)
    logprobs = torch.tensor([[0.1, 0.5, 9.0], [0.1, 0.5, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    advantages = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    loss, _ = POLICY_LOSSES["gmpo"](logprobs, old, advantages, mask)
    # A > 0: d̃ = min(d, clip(d, −0.4, 0.4)) = [0.1, 0.4] → −exp(0.25) = −1.284025
    # A < 0: d̃ = max(d, clip(d)) = [0.1, 0.5] → +exp(0.3) = 1.349859
    torch.testing.assert_close(loss, torch.tensor([[-1.284025, -1.284025, 0.0], [1.349859, 1.349859, 0.0]]))


def test_cispo_caps_the_detached_weight_and_keeps_every_gradient():
    old = torch.zeros(1, 2)
    logprobs = torch.tensor([[math.log(6.0), math.log(0.1)]], requires_grad=True)
    advantages = torch.tensor([[2.0, 2.0]])
    loss, metrics = POLICY_LOSSES["cispo"](logprobs, old, advantages, torch.ones(1, 2))
    # weights: min(6, 5) = 5 and 0.1 (no lower clip by default)
    expected = torch.tensor([[-5.0 * 2 * math.log(6.0), -0.1 * 2 * math.log(0.1)]])
    torch.testing.assert_close(loss, expected)
    (grad,) = torch.autograd.grad(loss.sum(), logprobs)
    torch.testing.assert_close(grad, torch.tensor([[-10.0, -0.2]]))
    assert metrics["clip_fraction"].item() == pytest.approx(0.5)


def test_cispo_with_epsilon_low_clips_both_sides():
    old = torch.zeros(1, 1)
    logprobs = torch.tensor([[math.log(0.1)]])
    loss, _ = POLICY_LOSSES["cispo"](logprobs, old, torch.ones(1, 1), torch.ones(1, 1), epsilon_low=0.2)
    torch.testing.assert_close(loss, torch.tensor([[-0.8 * math.log(0.1)]]))


def test_sapo_soft_gate_values():
    old = torch.zeros(1, 3)
    logprobs = torch.tensor([[0.0, math.log(1.5), math.log(1.5)]])
    advantages = torch.tensor([[1.0, 1.0, -1.0]])
    loss, _ = POLICY_LOSSES["sapo"](
        logprobs, old, advantages, torch.ones(1, 3), tau_positive=1.0, tau_negative=2.0
    )
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    # ρ = 1: −σ(0)·4·A = −2;  ρ = 1.5, τ = 1: −σ(0.5)·4;  A < 0, τ = 2: +σ(1.0)·2
    expected = torch.tensor([[-2.0, -4 * sig(0.5), 2 * sig(1.0)]])
    torch.testing.assert_close(loss, expected)


def test_reinforce_loss_is_minus_advantage_times_logprob():
    logprobs = torch.tensor([[-0.5, -2.0]])
    loss, _ = POLICY_LOSSES["reinforce"](
        logprobs, torch.zeros(1, 2), torch.tensor([[2.0, -1.0]]), torch.ones(1, 2)
    )
    torch.testing.assert_close(loss, torch.tensor([[1.0, -2.0]]))


# Covariance inputs: A = [2, 1, 0, −3] (mean 0), log π = [−1, −2, −3, −4] (mean −2.5), so the
# centred covariance (A − Ā)·(log π − mean) = [3, 0.5, 0, 4.5].
COV_LOGPROBS = torch.tensor([[-1.0, -2.0, -3.0, -4.0]])
COV_ADVANTAGES = torch.tensor([[2.0, 1.0, 0.0, -3.0]])


def test_kl_cov_penalises_the_tokens_of_largest_covariance():
    old = COV_LOGPROBS - 0.1  # ρ = e^0.1 = 1.105171, |log π − log π_old| = 0.1
    rho = math.exp(0.1)
    base = [-2.0 * rho, -1.0 * rho, 0.0, 3.0 * rho]
    # r = 0.25 of 4 tokens → 1 token: the covariance 4.5 one (index 3); coefficient 1
    loss, metrics = POLICY_LOSSES["kl_cov"](
        COV_LOGPROBS, old, COV_ADVANTAGES, torch.ones(1, 4), kl_cov_ratio=0.25, ppo_kl_coef=1.0
    )
    torch.testing.assert_close(loss, torch.tensor([[base[0], base[1], 0.0, base[3] + 0.1]]))
    assert metrics["kl_cov_fraction"].item() == pytest.approx(0.25)
    # r = 0.5 → 2 tokens: indices 3 and 0; coefficient 2
    loss, _ = POLICY_LOSSES["kl_cov"](
        COV_LOGPROBS, old, COV_ADVANTAGES, torch.ones(1, 4), kl_cov_ratio=0.5, ppo_kl_coef=2.0
    )
    torch.testing.assert_close(loss, torch.tensor([[base[0] + 0.2, base[1], 0.0, base[3] + 0.2]]))


def test_kl_cov_default_ratio_penalises_at_least_one_token():
    _, metrics = POLICY_LOSSES["kl_cov"](COV_LOGPROBS, COV_LOGPROBS - 0.1, COV_ADVANTAGES, torch.ones(1, 4))
    assert metrics["kl_cov_fraction"].item() == pytest.approx(0.25)  # max(1, ⌊2e-4·4⌋) = 1


def test_clip_cov_cuts_the_gradient_of_tokens_in_the_covariance_window():
    logprobs = COV_LOGPROBS.clone().requires_grad_()
    # π = π_old: l = −A = [−2, −1, 0, 3]; eligible (1 < c < 5): tokens 0 and 3; r = 0.5 → budget 2
    loss, metrics = POLICY_LOSSES["clip_cov"](
        logprobs, COV_LOGPROBS, COV_ADVANTAGES, torch.ones(1, 4), clip_cov_ratio=0.5
    )
    torch.testing.assert_close(loss, torch.tensor([[0.0, -1.0, 0.0, 0.0]]))
    (grad,) = torch.autograd.grad(loss.sum(), logprobs)
    torch.testing.assert_close(grad, torch.tensor([[0.0, -1.0, 0.0, 0.0]]))
    assert metrics["cov_clip_fraction"].item() == pytest.approx(0.5)
    # a window (1, 4) leaves only token 0 (c = 3)
    loss, _ = POLICY_LOSSES["clip_cov"](
        COV_LOGPROBS, COV_LOGPROBS, COV_ADVANTAGES, torch.ones(1, 4), clip_cov_ratio=0.5, clip_cov_ub=4.0
    )
    torch.testing.assert_close(loss, torch.tensor([[0.0, -1.0, 0.0, 3.0]]))


def test_clip_cov_picks_a_random_subset_when_more_tokens_qualify_than_the_budget():
    def cut(seed):
        loss, _ = POLICY_LOSSES["clip_cov"](
            COV_LOGPROBS,
            COV_LOGPROBS,
            COV_ADVANTAGES,
            torch.ones(1, 4),
            clip_cov_ratio=0.25,
            generator=torch.Generator().manual_seed(seed),
        )
        return tuple(((loss == 0) & (COV_ADVANTAGES != 0)).flatten().tolist())

    assert {cut(seed) for seed in range(20)} == {(True, False, False, False), (False, False, False, True)}
    assert cut(3) == cut(3)


def test_clip_cov_skips_tokens_already_clipped_by_ppo():
    # token 0 has ρ = 1.5 > 1.2 with A > 0: PPO already clips it, so Clip-Cov may not pick it
    old = COV_LOGPROBS.clone()
    old[0, 0] -= math.log(1.5)
    loss, metrics = POLICY_LOSSES["clip_cov"](
        COV_LOGPROBS, old, COV_ADVANTAGES, torch.ones(1, 4), clip_cov_ratio=0.5
    )
    torch.testing.assert_close(loss, torch.tensor([[-2.4, -1.0, 0.0, 0.0]]))
    assert metrics["clip_fraction"].item() == pytest.approx(0.25)


@pytest.mark.parametrize(
    ("name", "kwargs", "match"),
    [
        ("clip_cov", {"clip_cov_ratio": 0.0}, "clip_cov_ratio must be > 0"),
        ("clip_cov", {"clip_cov_ratio": 2.0}, r"clip_cov_ratio must be a fraction"),
        ("clip_cov", {"clip_cov_lb": 5.0, "clip_cov_ub": 1.0}, "clip_cov_lb must be < clip_cov_ub"),
        ("kl_cov", {"kl_cov_ratio": 1.5}, r"kl_cov_ratio must be a fraction"),
        ("kl_cov", {"ppo_kl_coef": -1.0}, "ppo_kl_coef must be >= 0"),
        ("gspo_sequence", {"dual_clip": 0.5}, "dual_clip must be > 1"),
    ],
)
def test_new_loss_options_are_checked_by_name(name, kwargs, match):
    with pytest.raises(ValueError, match=match):
        POLICY_LOSSES[name](COV_LOGPROBS, COV_LOGPROBS, COV_ADVANTAGES, torch.ones(1, 4), **kwargs)


@pytest.mark.parametrize("name", ON_POLICY_PG_LOSSES)
@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**16), batch=st.integers(1, 5), seq=st.integers(1, 9))
def test_on_policy_gradient_equals_vanilla_policy_gradient(name, seed, batch, seq):
    """With π_old = π (one update), every loss has the policy-gradient gradient −A·∇log π."""
    gen = torch.Generator().manual_seed(seed)
    logprobs = (-torch.rand(batch, seq, generator=gen, dtype=torch.float64) * 3).requires_grad_()
    mask = (torch.rand(batch, seq, generator=gen) < 0.7).double()
    mask[:, 0] = 1
    # sequence-level advantages (the outcome estimators' shape), which GMPO assumes
    advantages = torch.randn(batch, 1, generator=gen, dtype=torch.float64).expand(batch, seq) * mask
    old = logprobs.detach().clone()

    loss, _ = POLICY_LOSSES[name](logprobs, old, advantages, mask)
    (grad,) = torch.autograd.grad(aggregate_loss(loss, mask, "seq-mean-token-mean"), logprobs)
    reference = aggregate_loss(-(advantages * logprobs) * mask, mask, "seq-mean-token-mean")
    (expected,) = torch.autograd.grad(reference, logprobs)
    torch.testing.assert_close(grad.double(), expected, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("name", ALL_LOSSES)
def test_masked_tokens_get_zero_gradient_and_zero_loss(name):
    gen = torch.Generator().manual_seed(0)
    logprobs = (-torch.rand(3, 6, generator=gen) * 3).requires_grad_()
    old = logprobs.detach() + 0.3 * torch.randn(3, 6, generator=gen)
    advantages = torch.randn(3, 6, generator=gen)
    mask = torch.tensor([[1, 1, 1, 0, 0, 0], [0, 1, 0, 1, 0, 1], [1, 1, 1, 1, 1, 0]])
    loss, metrics = POLICY_LOSSES[name](logprobs, old, advantages, mask)
    (grad,) = torch.autograd.grad(aggregate_loss(loss, mask), logprobs)
    assert torch.all(loss[mask == 0] == 0)
    assert torch.all(grad[mask == 0] == 0)
    assert torch.any(grad[mask == 1] != 0)
    assert all(torch.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("name", ALL_LOSSES)
def test_bf16_inputs_give_finite_float32_losses(name):
    logprobs = -torch.rand(2, 4).bfloat16()
    loss, _ = POLICY_LOSSES[name](logprobs, logprobs - 0.1, torch.randn(2, 4).bfloat16(), torch.ones(2, 4))
    assert loss.dtype == torch.float32
    assert torch.isfinite(loss).all()


def test_extreme_log_ratios_are_clamped_not_overflowed():
    loss, _ = POLICY_LOSSES["ppo"](
        torch.tensor([[500.0]]), torch.tensor([[0.0]]), torch.tensor([[-1.0]]), torch.ones(1, 1)
    )
    assert torch.isfinite(loss).all()
    assert loss.item() == pytest.approx(math.exp(20.0), rel=1e-6)


# --------------------------------------------------------------------------------- value loss


def test_clipped_value_loss_takes_the_larger_of_clipped_and_unclipped():
    values = torch.tensor([[1.0, 1.0, 0.2]], requires_grad=True)
    old = torch.tensor([[0.0, 0.0, 0.0]])
    returns = torch.tensor([[2.0, 0.0, 0.3]])
    loss, metrics = value_loss(values, old, returns, torch.ones(1, 3), clip_range=0.5)
    # token 0: (1 − 2)² = 1 vs (0.5 − 2)² = 2.25 → 1.125; token 1: 1 vs 0.25 → 0.5; token 2 inside: 0.005
    torch.testing.assert_close(loss, torch.tensor([[1.125, 0.5, 0.005]]))
    assert metrics["value_clip_fraction"].item() == pytest.approx(1 / 3)
    (grad,) = torch.autograd.grad(loss.sum(), values)
    # token 0's clipped branch is flat in V: no gradient; token 1: V − R = 1
    torch.testing.assert_close(grad, torch.tensor([[0.0, 1.0, -0.1]]))


def test_a_value_inside_the_clip_range_is_never_counted_as_clipped():
    # V_old + (V − V_old) is V only up to round-off: ~3 % of in-range float32 values come back a
    # unit in the last place off, and where that side of the max was larger the token counted as
    # clipped (0.3 % of these tokens; 154 of them). Inside the range the loss is exactly ½(V − R)².
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(1, 100_000, generator=generator)
    old = values + 0.3 * torch.randn(1, 100_000, generator=generator)
    returns = torch.randn(1, 100_000, generator=generator)
    inside = (values - old).abs() <= 0.2
    loss, metrics = value_loss(values, old, returns, torch.ones_like(values), clip_range=0.2)
    assert torch.equal(loss[inside], 0.5 * (values - returns).square()[inside])
    outside = ~inside & ((old + (values - old).clamp(-0.2, 0.2) - returns).abs() > (values - returns).abs())
    assert metrics["value_clip_fraction"].item() == pytest.approx(outside.float().mean().item(), abs=1e-7)


def test_unclipped_value_loss_is_half_squared_error():
    loss, _ = value_loss(
        torch.tensor([[3.0]]), torch.tensor([[0.0]]), torch.tensor([[1.0]]), torch.ones(1, 1), clip_range=None
    )
    assert loss.item() == 2.0


# ---------------------------------------------------------------------------------- bad input


def test_unknown_policy_loss_lists_known_names():
    with pytest.raises(
        KeyError,
        match=r"unknown policy loss 'ppo2'; known names: cispo, clip_cov, gmpo, gpg, gspo, gspo_sequence, kl_cov, ppo",
    ):
        POLICY_LOSSES["ppo2"]


@pytest.mark.parametrize("c", [1.0, 0.5, -3.0])
def test_dual_clip_at_most_one_is_rejected(c):
    with pytest.raises(ValueError, match=rf"dual_clip must be > 1.*got {c}"):
        POLICY_LOSSES["ppo"](*ppo_worked_inputs(), dual_clip=c)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"epsilon_low": 0.0}, "epsilon_low must be > 0"),
    ({"epsilon_low": -0.1}, "epsilon_low must be > 0"),
    ({"epsilon_low": 1.5}, r"epsilon_low must be in \(0, 1\)"),
    ({"epsilon_high": 0.0}, "epsilon_high must be > 0"),
])  # fmt: skip
def test_non_positive_clip_epsilons_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        POLICY_LOSSES["ppo"](*ppo_worked_inputs(), **kwargs)


def test_shape_mismatch_names_both_arguments_and_shapes():
    logprobs, old, advantages, mask = ppo_worked_inputs()
    with pytest.raises(ValueError, match=r"advantages has shape \(1, 3\) but logprobs has shape \(1, 4\)"):
        POLICY_LOSSES["ppo"](logprobs, old, advantages[:, :3], mask)


def test_one_dimensional_logprobs_are_rejected_with_layout():
    with pytest.raises(
        ValueError, match=r"logprobs must have shape \[batch, seq\] \(2 dims\), got shape \(4,\)"
    ):
        POLICY_LOSSES["ppo"](torch.zeros(4), torch.zeros(4), torch.zeros(4), torch.ones(4))


@pytest.mark.gpu
@pytest.mark.parametrize("name", ALL_LOSSES)
def test_policy_losses_on_cuda_match_cpu(name):
    logprobs, old, advantages, mask = ppo_worked_inputs()
    cpu, _ = POLICY_LOSSES[name](logprobs, old, advantages, mask)
    gpu, _ = POLICY_LOSSES[name](logprobs.cuda(), old.cuda(), advantages.cuda(), mask.cuda())
    torch.testing.assert_close(gpu.cpu(), cpu)
