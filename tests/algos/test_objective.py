"""`policy_objective`: the whole loss a policy learner minimises, term by term."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_algos import POLICY_LOSSES, aggregate_loss, kl_penalty, loss_normalizer, policy_objective

LOGPROBS = torch.tensor([[-1.0, -2.0]])
REF = torch.tensor([[-1.5, -2.0]])
ENTROPY = torch.tensor([[0.5, 1.5]])
ADVANTAGES = torch.ones(1, 2)
MASK = torch.ones(1, 2)


def test_worked_value_of_the_three_terms():
    # ρ = 1: agg(l) = −1; k1 KL mean (0.5 + 0)/2 = 0.25; H mean 1 → J = −1 + 0.1·0.25 − 0.01·1
    total, metrics = policy_objective(
        LOGPROBS,
        LOGPROBS,
        ADVANTAGES,
        MASK,
        loss="ppo",
        ref_logprobs=REF,
        kl_coef=0.1,
        kl_estimator="k1",
        entropy=ENTROPY,
        entropy_coef=0.01,
    )
    assert total.item() == pytest.approx(-0.985)
    assert metrics["loss"].item() == pytest.approx(-0.985)
    assert metrics["loss_policy"].item() == pytest.approx(-1.0)
    assert metrics["loss_kl"].item() == pytest.approx(0.25)
    assert metrics["kl"].item() == pytest.approx(0.25)
    assert metrics["loss_entropy"].item() == pytest.approx(1.0)
    assert metrics["entropy"].item() == pytest.approx(1.0)
    assert {"ppo_kl", "clip_fraction"} <= metrics.keys()


def test_importance_weights_multiply_the_policy_term_only():
    # agg(l·w) = (−2 − 1)/2 = −1.5
    total, metrics = policy_objective(
        LOGPROBS, LOGPROBS, ADVANTAGES, MASK, importance_weights=torch.tensor([[2.0, 1.0]])
    )
    assert total.item() == pytest.approx(-1.5)
    assert not {"loss_kl", "loss_entropy", "entropy"} & metrics.keys()


def test_gradient_equals_the_hand_assembled_objective():
    gen = torch.Generator().manual_seed(0)
    logprobs = (-torch.rand(3, 5, generator=gen, dtype=torch.float64) * 2).requires_grad_()
    entropy = torch.rand(3, 5, generator=gen, dtype=torch.float64).requires_grad_()
    old = logprobs.detach() + 0.1 * torch.randn(3, 5, generator=gen, dtype=torch.float64)
    ref = logprobs.detach() + 0.2 * torch.randn(3, 5, generator=gen, dtype=torch.float64)
    advantages = torch.randn(3, 5, generator=gen, dtype=torch.float64)
    weights = torch.rand(3, 5, generator=gen, dtype=torch.float64) + 0.5
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 1, 1, 1, 0]])
    options = {"epsilon_low": 0.2, "epsilon_high": 0.28, "dual_clip": 3.0}
    total, _ = policy_objective(
        logprobs,
        old,
        advantages,
        mask,
        loss="ppo",
        loss_options=options,
        aggregation="seq-mean-token-mean",
        importance_weights=weights,
        ref_logprobs=ref,
        kl_coef=0.05,
        kl_estimator="k3+",
        entropy=entropy,
        entropy_coef=0.01,
    )
    per_token, _ = POLICY_LOSSES["ppo"](logprobs, old, advantages, mask, **options)
    mode = "seq-mean-token-mean"
    expected = (
        aggregate_loss(per_token * weights, mask, mode)
        + 0.05 * aggregate_loss(kl_penalty(logprobs, ref, "k3+"), mask, mode)
        - 0.01 * aggregate_loss(entropy, mask, mode)
    )
    torch.testing.assert_close(total, expected)
    grads = torch.autograd.grad(total, (logprobs, entropy))
    expected_grads = torch.autograd.grad(expected, (logprobs, entropy))
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want)


def test_unbiased_gradient_kl_option_uses_the_old_logprobs():
    logprobs = LOGPROBS.clone().requires_grad_()
    old = torch.tensor([[-1.2, -2.0]])
    total, _ = policy_objective(
        logprobs,
        old,
        torch.zeros(1, 2),
        MASK,
        loss="reinforce",
        ref_logprobs=REF,
        kl_coef=1.0,
        kl_estimator="k3",
        kl_options={"unbiased_gradient": True},
    )
    (grad,) = torch.autograd.grad(total, logprobs)
    # token-mean of the KL: gradient w·d/2 = [exp(0.2)·0.5/2, 0]
    torch.testing.assert_close(grad, torch.tensor([[1.221403 * 0.5 / 2, 0.0]]))


@pytest.mark.parametrize(
    "mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
)
@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**16), split=st.integers(1, 4))
def test_micro_batches_with_the_global_normaliser_sum_to_the_full_batch_objective(mode, seed, split):
    gen = torch.Generator().manual_seed(seed)
    logprobs = -torch.rand(5, 6, generator=gen, dtype=torch.float64)
    old = logprobs + 0.1 * torch.randn(5, 6, generator=gen, dtype=torch.float64)
    ref = logprobs + 0.1 * torch.randn(5, 6, generator=gen, dtype=torch.float64)
    entropy = torch.rand(5, 6, generator=gen, dtype=torch.float64)
    advantages = torch.randn(5, 6, generator=gen, dtype=torch.float64)
    mask = (torch.rand(5, 6, generator=gen) < 0.7).long()
    mask[:, 0] = 1
    common = {"aggregation": mode, "horizon": 6, "kl_coef": 0.1, "entropy_coef": 0.01}

    def objective(rows, normalizer):
        total, _ = policy_objective(
            logprobs[rows],
            old[rows],
            advantages[rows],
            mask[rows],
            normalizer=normalizer,
            ref_logprobs=ref[rows],
            entropy=entropy[rows],
            **common,
        )
        return total

    full = objective(slice(None), None)
    global_count = loss_normalizer(mask, mode)
    parts = sum(objective(slice(start, start + split), global_count) for start in range(0, 5, split))
    torch.testing.assert_close(parts, full)


def test_missing_inputs_are_named():
    with pytest.raises(ValueError, match="ref_logprobs is required when kl_coef > 0"):
        policy_objective(LOGPROBS, LOGPROBS, ADVANTAGES, MASK, kl_coef=0.1)
    with pytest.raises(ValueError, match="entropy is required when entropy_coef != 0"):
        policy_objective(LOGPROBS, LOGPROBS, ADVANTAGES, MASK, entropy_coef=0.1)
    with pytest.raises(ValueError, match="kl_coef must be >= 0"):
        policy_objective(LOGPROBS, LOGPROBS, ADVANTAGES, MASK, kl_coef=-0.1, ref_logprobs=REF)
    with pytest.raises(KeyError, match="unknown policy loss 'nope'"):
        policy_objective(LOGPROBS, LOGPROBS, ADVANTAGES, MASK, loss="nope")
    with pytest.raises(ValueError, match=r"importance_weights has shape \(1, 3\)"):
        policy_objective(LOGPROBS, LOGPROBS, ADVANTAGES, MASK, importance_weights=torch.ones(1, 3))
