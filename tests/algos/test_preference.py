"""Tests for rl_algos.preference: DPO / cDPO / IPO, KTO and the Bradley–Terry reward-model loss."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_algos.preference import dpo_loss, kto_loss, reward_model_loss

FAST = settings(max_examples=30, deadline=None)


def t(*values: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


def dpo_inputs(batch: int = 4, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [-10 * torch.rand(batch, generator=generator) for _ in range(4)]


# ----------------------------------------------------------------------------------------- DPO


def test_dpo_loss_golden_value_and_reward_metrics() -> None:
    # z = (-1 - -2) - (-1.5 - -1.5) = 1; β·z = 0.5
    # loss = -log σ(0.5) = log(1 + e^-0.5) = log(1.6065306597) = 0.4740769842
    # chosen reward = 0.5·(-1 - -1.5) = 0.25, rejected = 0.5·(-2 - -1.5) = -0.25, margin 0.5
    losses, metrics = dpo_loss(t(-1.0), t(-2.0), t(-1.5), t(-1.5), beta=0.5)
    assert losses.shape == (1,)
    assert losses.dtype == torch.float32
    torch.testing.assert_close(losses, t(0.4740769842))
    torch.testing.assert_close(metrics["chosen_rewards"], torch.tensor(0.25))
    torch.testing.assert_close(metrics["rejected_rewards"], torch.tensor(-0.25))
    torch.testing.assert_close(metrics["reward_margin"], torch.tensor(0.5))
    torch.testing.assert_close(metrics["reward_accuracy"], torch.tensor(1.0))


def test_dpo_loss_reward_accuracy_counts_only_strict_wins() -> None:
    # pair 0: z = 1 (win); pair 1: z = -1 (loss); pair 2: z = 0 (tie, not a win) -> 1/3
    losses, metrics = dpo_loss(t(0.0, 0.0, 0.0), t(-1.0, 1.0, 0.0), t(0.0, 0.0, 0.0), t(0.0, 0.0, 0.0))
    torch.testing.assert_close(metrics["reward_accuracy"], torch.tensor(1 / 3))
    assert losses[0] < losses[2] < losses[1]


@FAST
@given(
    beta=st.floats(1e-3, 100.0),
    chosen=st.floats(-500.0, 0.0),
    rejected=st.floats(-500.0, 0.0),
)
def test_dpo_loss_at_zero_margin_is_log_two(beta: float, chosen: float, rejected: float) -> None:
    # Reference equal to the policy makes z = 0 exactly whatever the log-probs: -log σ(0) = log 2.
    policy = t(chosen, rejected, dtype=torch.float64)
    losses, _ = dpo_loss(policy[:1], policy[1:], policy[:1].clone(), policy[1:].clone(), beta=beta)
    torch.testing.assert_close(losses, t(math.log(2.0)))


def test_cdpo_with_zero_label_smoothing_equals_dpo() -> None:
    inputs = dpo_inputs(batch=8)
    plain, _ = dpo_loss(*inputs, beta=0.3)
    smoothed, _ = dpo_loss(*inputs, beta=0.3, label_smoothing=0.0)
    torch.testing.assert_close(smoothed, plain, rtol=0, atol=0)
    # and continuously so: the smoothed formula itself tends to DPO as ε -> 0
    nearly, _ = dpo_loss(*inputs, beta=0.3, label_smoothing=1e-7)
    torch.testing.assert_close(nearly, plain, rtol=1e-5, atol=1e-5)


def test_cdpo_golden_value() -> None:
    # β·z = 0.5 as in the DPO golden test, ε = 0.1:
    # 0.9·(-log σ(0.5)) + 0.1·(-log σ(-0.5)) = 0.9·0.4740769842 + 0.1·0.9740769842
    #   = 0.4266692858 + 0.0974076984 = 0.5240769842
    losses, _ = dpo_loss(t(-1.0), t(-2.0), t(-1.5), t(-1.5), beta=0.5, label_smoothing=0.1)
    torch.testing.assert_close(losses, t(0.5240769842))


def test_cdpo_gradient_vanishes_at_the_smoothed_optimum() -> None:
    # d/dz of the cDPO loss is β·(σ(βz) - (1 - ε)), zero at σ(βz) = 1 - ε, i.e. βz = logit(1 - ε);
    # plain DPO still pushes there.
    beta, eps = 0.5, 0.2
    z = math.log((1 - eps) / eps) / beta
    chosen = torch.tensor([z], requires_grad=True)
    losses, _ = dpo_loss(chosen, t(0.0), t(0.0), t(0.0), beta=beta, label_smoothing=eps)
    losses.sum().backward()
    torch.testing.assert_close(chosen.grad, t(0.0), atol=1e-6, rtol=0)
    chosen.grad = None
    dpo_loss(chosen, t(0.0), t(0.0), t(0.0), beta=beta)[0].sum().backward()
    assert chosen.grad.item() < -1e-3


def test_ipo_loss_golden_value() -> None:
    # z = (-1 - -4) - (-2 - -2) = 3, β = 0.5 -> 1/(2β) = 1; (3 - 1)² = 4
    # second pair: z = 0 -> (0 - 1)² = 1
    losses, metrics = dpo_loss(
        t(-1.0, -3.0), t(-4.0, -3.0), t(-2.0, -2.0), t(-2.0, -2.0), beta=0.5, loss_type="ipo"
    )
    torch.testing.assert_close(losses, t(4.0, 1.0))
    # chosen rewards 0.5·(1, -1) -> mean 0; rejected 0.5·(-2, -1) -> mean -0.75
    torch.testing.assert_close(metrics["chosen_rewards"], torch.tensor(0.0))
    torch.testing.assert_close(metrics["rejected_rewards"], torch.tensor(-0.75))


def test_dpo_loss_is_finite_for_extreme_margins() -> None:
    # log(sigmoid(-1000)) is -inf in float32; logsigmoid keeps the loss finite (= 1000).
    losses, _ = dpo_loss(t(-1000.0), t(0.0), t(0.0), t(0.0), beta=1.0)
    torch.testing.assert_close(losses, t(1000.0))


def test_dpo_loss_gradient_sign_raises_chosen_and_lowers_rejected() -> None:
    chosen, rejected = t(-3.0).requires_grad_(), t(-3.0).requires_grad_()
    losses, _ = dpo_loss(chosen, rejected, t(-3.0), t(-3.0), beta=0.1)
    losses.sum().backward()
    # at z = 0 the gradient is ∓β·σ(0) = ∓0.05
    torch.testing.assert_close(chosen.grad, t(-0.05))
    torch.testing.assert_close(rejected.grad, t(0.05))


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_dpo_loss_bf16_inputs_give_float32_close_to_fp32(loss_type: str) -> None:
    inputs = dpo_inputs(batch=16, seed=1)
    low = [x.bfloat16() for x in inputs]
    losses_bf16, metrics = dpo_loss(*low, loss_type=loss_type)
    assert losses_bf16.dtype == torch.float32
    assert torch.isfinite(losses_bf16).all()
    # Computed in float32, so bf16 inputs give exactly the float32 result of the rounded values.
    reference, _ = dpo_loss(*[x.float() for x in low], loss_type=loss_type)
    torch.testing.assert_close(losses_bf16, reference)
    assert all(v.dtype == torch.float32 for v in metrics.values())


def test_dpo_metrics_are_detached() -> None:
    inputs = [x.requires_grad_() for x in dpo_inputs()]
    _, metrics = dpo_loss(*inputs)
    assert not any(v.requires_grad for v in metrics.values())


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"beta": 0.0}, ValueError, r"beta must be > 0"),
        ({"beta": -1.0}, ValueError, r"beta must be > 0"),
        (
            {"label_smoothing": 0.5},
            ValueError,
            r"label_smoothing must be in \[0, 0.5\).*prefers the rejected",
        ),
        ({"label_smoothing": -0.1}, ValueError, r"label_smoothing must be in \[0, 0.5\)"),
        ({"label_smoothing": float("nan")}, ValueError, r"label_smoothing"),
        ({"label_smoothing": "0.1"}, TypeError, r"label_smoothing must be a number"),
        ({"loss_type": "hinge"}, ValueError, r"loss_type must be one of \['ipo', 'sigmoid'\]"),
        (
            {"loss_type": "ipo", "label_smoothing": 0.1},
            ValueError,
            r"label_smoothing must be 0 with loss_type='ipo'",
        ),
    ],
)
def test_dpo_loss_rejects_bad_options(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        dpo_loss(*dpo_inputs(), **kwargs)


@pytest.mark.parametrize("bad", [0, 1, 2, 3])
def test_dpo_loss_rejects_mismatched_shapes_naming_both(bad: int) -> None:
    names = [
        "policy_chosen_logps",
        "policy_rejected_logps",
        "reference_chosen_logps",
        "reference_rejected_logps",
    ]
    inputs = dpo_inputs(batch=4)
    inputs[bad] = torch.zeros(3)
    if bad == 0:
        match = r"policy_rejected_logps has shape \(4,\) but policy_chosen_logps has shape \(3,\)"
    else:
        match = rf"{names[bad]} has shape \(3,\) but policy_chosen_logps has shape \(4,\)"
    with pytest.raises(ValueError, match=match):
        dpo_loss(*inputs)


def test_dpo_loss_rejects_per_token_and_integer_inputs() -> None:
    inputs = dpo_inputs()
    with pytest.raises(ValueError, match=r"policy_chosen_logps must have shape \[batch\]"):
        dpo_loss(torch.zeros(4, 3), *inputs[1:])
    with pytest.raises(TypeError, match=r"reference_rejected_logps must be a floating-point tensor"):
        dpo_loss(*inputs[:3], torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"policy_chosen_logps is empty"):
        dpo_loss(*[torch.zeros(0)] * 4)


# ----------------------------------------------------------------------------------------- KTO


def test_kto_loss_golden_value_with_negative_kl_clamped_to_zero() -> None:
    # KL pairs: policy - reference = (-3 - -2, -2 - -2.5) = (-1, 0.5), mean -0.25 -> clamped to 0.
    # log-ratios ρ = (-1 - -1.5, -2 - -1) = (0.5, -1), β = 0.5
    # desirable:   1 - σ(0.5·(0.5 - 0)) = 1 - σ(0.25) = 1 - 0.5621765009 = 0.4378234991
    # undesirable: 2·(1 - σ(0.5·(0 - -1))) = 2·(1 - σ(0.5)) = 2·(1 - 0.6224593312) = 0.7550813376
    losses, metrics = kto_loss(
        t(-1.0, -2.0),
        t(-1.5, -1.0),
        torch.tensor([True, False]),
        t(-3.0, -2.0),
        t(-2.0, -2.5),
        beta=0.5,
        undesirable_weight=2.0,
    )
    torch.testing.assert_close(losses, t(0.4378234991, 0.7550813376))
    torch.testing.assert_close(metrics["kl"], torch.tensor(0.0))
    # rewards β·ρ: desirable 0.25, undesirable -0.5
    torch.testing.assert_close(metrics["desirable_rewards"], torch.tensor(0.25))
    torch.testing.assert_close(metrics["undesirable_rewards"], torch.tensor(-0.5))
    torch.testing.assert_close(metrics["num_desirable"], torch.tensor(1.0))
    torch.testing.assert_close(metrics["num_undesirable"], torch.tensor(1.0))


def test_kto_loss_golden_value_with_positive_kl() -> None:
    # KL pairs: (1 - 0, 0 - 0) -> mean 0.5 = z_ref; ρ = (0.5, 0.5), β = 1, λ_D = 0.5
    # desirable:   0.5·(1 - σ(0.5 - 0.5)) = 0.5·0.5 = 0.25
    # undesirable: 1 - σ(0.5 - 0.5) = 0.5
    losses, metrics = kto_loss(
        t(0.5, 0.5), t(0.0, 0.0), torch.tensor([True, False]), t(1.0, 0.0), t(0.0, 0.0),
        beta=1.0, desirable_weight=0.5,
    )  # fmt: skip
    torch.testing.assert_close(losses, t(0.25, 0.5))
    torch.testing.assert_close(metrics["kl"], torch.tensor(0.5))


def test_kto_reference_point_receives_no_gradient() -> None:
    policy = t(-1.0, -2.0).requires_grad_()
    policy_kl = t(2.0, 1.0).requires_grad_()  # KL estimate 1.5 - 0 = 1.5 > 0, so not clamped
    reference_kl = t(0.0, 0.0).requires_grad_()
    losses, metrics = kto_loss(
        policy, t(-1.0, -1.0), torch.tensor([True, False]), policy_kl, reference_kl, beta=1.0
    )
    losses.sum().backward()
    assert policy_kl.grad is None
    assert reference_kl.grad is None
    assert not metrics["kl"].requires_grad

    # With z_ref a constant: d/dρ (1 - σ(ρ - z)) = -σ'(ρ - z); d/dρ (1 - σ(z - ρ)) = σ'(z - ρ)
    # ρ = (0, -1), z = 1.5 -> (-σ'(-1.5), σ'(2.5)) with σ'(x) = σ(x)(1 - σ(x))
    def dsigmoid(x: float) -> float:
        s = 1 / (1 + math.exp(-x))
        return s * (1 - s)

    torch.testing.assert_close(policy.grad, t(-dsigmoid(-1.5), dsigmoid(2.5)))


def test_kto_all_reduce_averages_kl_over_ranks_by_count() -> None:
    # This rank: KL pairs (1, 1) -> sum 2, count 2. Another rank: sum 7, count 1 (simulated).
    # Pooled mean (2 + 7) / (2 + 1) = 3, not the mean of per-rank means (1 + 7) / 2 = 4.
    other_rank = torch.tensor([7.0, 1.0])
    calls = []

    def all_reduce(tensor: torch.Tensor) -> None:
        calls.append(tensor.clone())
        tensor += other_rank

    _, metrics = kto_loss(
        t(0.0), t(0.0), torch.tensor([True]), t(1.0, 1.0), t(0.0, 0.0), all_reduce=all_reduce
    )
    assert len(calls) == 1
    torch.testing.assert_close(calls[0], torch.tensor([2.0, 2.0]))
    torch.testing.assert_close(metrics["kl"], torch.tensor(3.0))


def test_kto_metrics_of_an_empty_subset_are_zero_not_nan() -> None:
    _, metrics = kto_loss(t(-1.0, -2.0), t(-1.0, -1.0), torch.tensor([True, True]), t(0.0), t(0.0), beta=1.0)
    assert metrics["undesirable_rewards"].item() == 0.0
    torch.testing.assert_close(metrics["desirable_rewards"], torch.tensor(-0.5))


def test_kto_loss_bf16_inputs_give_float32_close_to_fp32() -> None:
    inputs = dpo_inputs(batch=8, seed=3)
    desirable = torch.tensor([True, False] * 4)
    args = (inputs[0], inputs[1], desirable, inputs[2], inputs[3])
    reference, _ = kto_loss(*[x.bfloat16().float() if x.is_floating_point() else x for x in args], beta=0.1)
    losses, _ = kto_loss(*[x.bfloat16() if x.is_floating_point() else x for x in args], beta=0.1)
    assert losses.dtype == torch.float32
    assert torch.isfinite(losses).all()
    torch.testing.assert_close(losses, reference)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"beta": 0.0}, ValueError, r"beta must be > 0"),
        ({"desirable_weight": -1.0}, ValueError, r"desirable_weight must be >= 0"),
        ({"undesirable_weight": -0.5}, ValueError, r"undesirable_weight must be >= 0"),
        ({"desirable": torch.tensor([1, 0])}, TypeError, r"desirable must be a bool tensor"),
        ({"desirable": torch.tensor([True])}, ValueError, r"desirable has shape \(1,\) but policy_logps"),
        ({"reference_logps": t(0.0)}, ValueError, r"reference_logps has shape \(1,\) but policy_logps"),
        (
            {"reference_kl_logps": t(0.0, 0.0, 0.0)},
            ValueError,
            r"reference_kl_logps has shape \(3,\) but policy_kl_logps",
        ),
        ({"policy_kl_logps": torch.zeros(2, 2)}, ValueError, r"policy_kl_logps must have shape \[kl_batch\]"),
    ],
)
def test_kto_loss_rejects_bad_inputs(change: dict, error: type, match: str) -> None:
    args = {
        "policy_logps": t(-1.0, -2.0),
        "reference_logps": t(-1.0, -2.0),
        "desirable": torch.tensor([True, False]),
        "policy_kl_logps": t(-1.0, -2.0),
        "reference_kl_logps": t(-1.0, -2.0),
    }
    args.update(change)
    with pytest.raises(error, match=match):
        kto_loss(**args)


# ---------------------------------------------------------------------------------- reward model


def test_reward_model_loss_golden_value_with_margin() -> None:
    # -log σ(2 - 1 - 0.5) = -log σ(0.5) = log(1 + e^-0.5) = 0.4740769842
    # second pair, no win: -log σ(0 - 1 - 0.5) = log(1 + e^1.5) = log(5.4816890703) = 1.7014132779
    losses, metrics = reward_model_loss(t(2.0, 0.0), t(1.0, 1.0), margin=0.5)
    torch.testing.assert_close(losses, t(0.4740769842, 1.7014132779))
    torch.testing.assert_close(metrics["accuracy"], torch.tensor(0.5))
    torch.testing.assert_close(metrics["chosen_reward"], torch.tensor(1.0))
    torch.testing.assert_close(metrics["rejected_reward"], torch.tensor(1.0))
    # margin metric is r_w - r_l without m: (1 + -1) / 2 = 0
    torch.testing.assert_close(metrics["reward_margin"], torch.tensor(0.0))


def test_reward_model_loss_without_margin_is_bradley_terry_nll() -> None:
    # -log σ(0) = log 2; -log σ(log 3) = -log(3/4) = 0.2876820725
    losses, _ = reward_model_loss(t(1.0, math.log(3.0)), t(1.0, 0.0))
    torch.testing.assert_close(losses, t(math.log(2.0), 0.2876820725))


def test_reward_model_loss_accepts_per_pair_margin_tensor() -> None:
    chosen, rejected = t(2.0, 3.0), t(1.0, 0.0)
    per_pair, _ = reward_model_loss(chosen, rejected, margin=t(0.5, 2.0))
    torch.testing.assert_close(per_pair[0], reward_model_loss(chosen, rejected, margin=0.5)[0][0])
    torch.testing.assert_close(per_pair[1], reward_model_loss(chosen, rejected, margin=2.0)[0][1])


@FAST
@given(
    difference=st.floats(-20.0, 20.0),
    small=st.floats(-5.0, 5.0),
    extra=st.floats(0.01, 5.0),
)
def test_reward_model_loss_larger_margin_gives_larger_loss(
    difference: float, small: float, extra: float
) -> None:
    chosen, rejected = t(difference), t(0.0)
    low, _ = reward_model_loss(chosen, rejected, margin=small)
    high, _ = reward_model_loss(chosen, rejected, margin=small + extra)
    assert high.item() > low.item()


def test_reward_model_loss_gradient_pushes_rewards_apart() -> None:
    chosen, rejected = t(0.0).requires_grad_(), t(0.0).requires_grad_()
    reward_model_loss(chosen, rejected)[0].sum().backward()
    # d/dr_w [-log σ(r_w - r_l)] = -(1 - σ(0)) = -0.5
    torch.testing.assert_close(chosen.grad, t(-0.5))
    torch.testing.assert_close(rejected.grad, t(0.5))


def test_reward_model_loss_bf16_inputs_give_float32() -> None:
    chosen, rejected = torch.randn(8, generator=torch.Generator().manual_seed(0)), torch.zeros(8)
    losses, _ = reward_model_loss(chosen.bfloat16(), rejected.bfloat16(), margin=0.25)
    assert losses.dtype == torch.float32
    reference, _ = reward_model_loss(chosen.bfloat16().float(), rejected, margin=0.25)
    torch.testing.assert_close(losses, reference)
    torch.testing.assert_close(
        losses, reward_model_loss(chosen, rejected, margin=0.25)[0], atol=1e-2, rtol=1e-2
    )


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        (
            (t(1.0, 2.0), t(1.0)),
            {},
            ValueError,
            r"rejected_rewards has shape \(1,\) but chosen_rewards has shape \(2,\)",
        ),
        ((torch.zeros(2, 1), t(1.0, 2.0)), {}, ValueError, r"chosen_rewards must have shape \[batch\]"),
        (
            (t(1.0, 2.0), t(1.0, 2.0)),
            {"margin": t(1.0)},
            ValueError,
            r"margin has shape \(1,\) but chosen_rewards",
        ),
        ((t(1.0, 2.0), t(1.0, 2.0)), {"margin": "big"}, TypeError, r"margin must be None, a number or"),
        ((t(1.0, 2.0), t(1.0, 2.0)), {"margin": float("inf")}, ValueError, r"margin must be finite"),
        ((t(1.0, 2.0), t(1.0, 2.0)), {"margin": t(1.0, float("nan"))}, ValueError, r"margin must be finite"),
    ],
)
def test_reward_model_loss_rejects_bad_inputs(args: tuple, kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        reward_model_loss(*args, **kwargs)


@pytest.mark.gpu
def test_preference_losses_run_on_cuda() -> None:
    inputs = [x.cuda().bfloat16() for x in dpo_inputs(batch=8)]
    losses, _ = dpo_loss(*inputs)
    assert losses.is_cuda
    assert losses.dtype == torch.float32
    reference, _ = dpo_loss(*[x.float().cpu() for x in inputs])
    torch.testing.assert_close(losses.cpu(), reference)
    desirable = torch.tensor([True, False] * 4, device="cuda")
    kto, _ = kto_loss(inputs[0], inputs[1], desirable, inputs[2], inputs[3])
    assert kto.is_cuda
    assert torch.isfinite(kto).all()
    rm, _ = reward_model_loss(inputs[0], inputs[1], margin=inputs[2].float())
    assert rm.is_cuda
