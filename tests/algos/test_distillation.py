"""On-policy distillation: the reverse-KL token reward, the log-ratio metric and the loss-side term."""

from __future__ import annotations

import pytest
import torch

from rl_algos import (
    compute_advantages,
    policy_objective,
    reverse_kl_rewards,
    teacher_log_ratio,
    token_level_rewards,
)

LOGPROBS = torch.tensor([[-1.0, -2.0, 0.0]])
TEACHER = torch.tensor([[-1.5, -1.0, 0.0]])
MASK = torch.tensor([[1, 1, 0]], dtype=torch.bool)


def test_reverse_kl_rewards_worked_values():
    rewards = reverse_kl_rewards(LOGPROBS, TEACHER, MASK, coef=0.5)
    torch.testing.assert_close(rewards, torch.tensor([[-0.25, 0.5, 0.0]]))


def test_teacher_log_ratio_worked_values_and_mean_over_action_tokens_only():
    ratio, mean = teacher_log_ratio(LOGPROBS, TEACHER, MASK)
    torch.testing.assert_close(ratio, torch.tensor([[0.5, -1.0, 0.0]]))
    assert mean.item() == pytest.approx(-0.25)
    # a padding token with a large gap changes nothing
    _, mean_padded = teacher_log_ratio(LOGPROBS, torch.tensor([[-1.5, -1.0, -50.0]]), MASK)
    assert mean_padded.item() == pytest.approx(-0.25)


def test_reverse_kl_rewards_carry_no_gradient():
    student = LOGPROBS.clone().requires_grad_()
    assert not reverse_kl_rewards(student, TEACHER, MASK, coef=1.0).requires_grad


def test_a_student_equal_to_its_teacher_gets_zero_reward():
    assert reverse_kl_rewards(LOGPROBS, LOGPROBS, MASK, coef=2.0).abs().sum() == 0


def test_the_return_of_the_distillation_reward_is_minus_beta_times_the_sequence_log_ratio():
    # reinforce (γ = 1) over the distillation rewards alone: G_0 = −β Σ_t d_t
    rewards = reverse_kl_rewards(LOGPROBS, TEACHER, MASK, coef=0.5)
    token_rewards = token_level_rewards(torch.zeros(1), MASK, reward_clip=None) + rewards
    _, returns = compute_advantages("reinforce", token_rewards=token_rewards, action_mask=MASK)
    assert returns[0, 0].item() == pytest.approx(-0.5 * (0.5 - 1.0))
    assert returns[0, 1].item() == pytest.approx(0.5)


@pytest.mark.parametrize(
    ("name", "kwargs", "error"),
    [
        ("coef", {"coef": -0.1}, ValueError),
        ("teacher_logprobs", {"coef": 1.0, "teacher": torch.zeros(1, 2)}, ValueError),
        ("logprobs", {"coef": 1.0, "student": torch.zeros(3)}, ValueError),
    ],
)
def test_bad_arguments_are_named(name, kwargs, error):
    student = kwargs.pop("student", LOGPROBS)
    teacher = kwargs.pop("teacher", TEACHER)
    with pytest.raises(error, match=name):
        reverse_kl_rewards(student, teacher, MASK, **kwargs)


def test_loss_side_teacher_term_worked_value():
    # ρ = 1, A = 0: the policy term is 0; k2 of d = [0.5, −1] → [0.125, 0.5], token-mean 0.3125
    advantages = torch.zeros(1, 3)
    total, metrics = policy_objective(
        LOGPROBS, LOGPROBS, advantages, MASK, teacher_logprobs=TEACHER, distill_coef=0.2
    )
    assert total.item() == pytest.approx(0.2 * 0.3125)
    assert metrics["loss_distill"].item() == pytest.approx(0.3125)
    assert metrics["distill_kl"].item() == pytest.approx(0.3125)


def test_loss_side_k2_gradient_is_beta_times_log_ratio_over_tokens():
    student = LOGPROBS.clone().requires_grad_()
    total, _ = policy_objective(
        student, LOGPROBS, torch.zeros(1, 3), MASK, teacher_logprobs=TEACHER, distill_coef=0.2
    )
    total.backward()
    # ∂/∂logπ_t of β·Σ m_t d_t²/2 / N = β·d_t·m_t / N with N = 2
    torch.testing.assert_close(student.grad, torch.tensor([[0.2 * 0.5 / 2, 0.2 * -1.0 / 2, 0.0]]))


def test_loss_side_teacher_term_needs_teacher_logprobs():
    with pytest.raises(ValueError, match="teacher_logprobs is required"):
        policy_objective(LOGPROBS, LOGPROBS, torch.zeros(1, 3), MASK, distill_coef=0.1)
