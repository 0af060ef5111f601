"""Reward shaping and token-reward assembly."""

from __future__ import annotations

import pytest
import torch

from rl_algos import (
    clip_rewards,
    dynamic_filter_mask,
    overlong_penalty,
    stop_properly_penalty,
    token_level_rewards,
)


def test_token_level_rewards_put_reward_on_last_action_token_and_kl_on_every_action_token():
    rewards = torch.tensor([1.0, 20.0])
    mask = torch.tensor([[0, 1, 1, 0], [1, 0, 1, 1]])  # left pad + right pad; a hole in row 1
    kl = torch.tensor([[9.0, 1.0, 2.0, 9.0], [1.0, 9.0, 1.0, 3.0]])
    out = token_level_rewards(rewards, mask, kl=kl, kl_coef=0.1, reward_clip=10.0)
    expected = torch.tensor([[0.0, -0.1, -0.2 + 1.0, 0.0], [-0.1, 0.0, -0.1, -0.3 + 10.0]])
    torch.testing.assert_close(out, expected)


def test_token_level_rewards_without_clip_or_kl():
    out = token_level_rewards(torch.tensor([-30.0]), torch.tensor([[1, 1, 0]]), reward_clip=None)
    torch.testing.assert_close(out, torch.tensor([[0.0, -30.0, 0.0]]))


def test_kl_penalty_in_reward_carries_no_gradient():
    kl = torch.ones(1, 2, requires_grad=True)
    out = token_level_rewards(torch.tensor([1.0]), torch.ones(1, 2), kl=kl, kl_coef=0.5)
    assert not out.requires_grad


def test_clip_rewards_clamps_to_range():
    torch.testing.assert_close(
        clip_rewards(torch.tensor([-20.0, 3.0, 11.0])), torch.tensor([-10.0, 3.0, 10.0])
    )


def test_overlong_penalty_is_linear_over_the_buffer():
    rewards = torch.ones(5)
    lengths = torch.tensor([50, 80, 90, 100, 130])
    out = overlong_penalty(rewards, lengths, max_new_tokens=100, buffer_length=20, penalty_factor=1.0)
    # threshold 80: excess [0, 0, 10, 20, 20(capped)] / 20
    torch.testing.assert_close(out, torch.tensor([1.0, 1.0, 0.5, 0.0, 0.0]))


def test_stop_properly_penalty_scales_or_replaces_truncated_rewards():
    rewards = torch.tensor([1.0, 0.8, -0.5])
    truncated = torch.tensor([True, False, True])
    torch.testing.assert_close(
        stop_properly_penalty(rewards, truncated, 0.5), torch.tensor([0.5, 0.8, -0.25])
    )
    torch.testing.assert_close(
        stop_properly_penalty(rewards, truncated, -1.0), torch.tensor([-1.0, 0.8, -1.0])
    )


def test_dynamic_filter_keeps_only_groups_with_mixed_scores():
    scores = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 0.0])
    groups = torch.tensor([5, 5, 6, 6, 7, 7])
    keep = dynamic_filter_mask(scores, groups)
    assert keep.tolist() == [False, False, False, False, True, True]


def test_overlong_penalty_rejects_buffer_longer_than_limit():
    with pytest.raises(ValueError, match=r"buffer_length must be an int in \(0, max_new_tokens=10\]"):
        overlong_penalty(torch.ones(1), torch.tensor([5]), max_new_tokens=10, buffer_length=20)


def test_stop_properly_rejects_coefficient_above_one():
    with pytest.raises(ValueError, match="coefficient must be <= 1"):
        stop_properly_penalty(torch.ones(1), torch.tensor([True]), 1.5)


def test_dynamic_filter_rejects_inverted_range():
    with pytest.raises(ValueError, match="low must be < high"):
        dynamic_filter_mask(torch.ones(2), torch.zeros(2, dtype=torch.long), low=1.0, high=0.0)


def test_nan_reward_is_rejected_before_shaping():
    with pytest.raises(ValueError, match=r"rewards must be finite, got nan at index 0"):
        clip_rewards(torch.tensor([float("nan"), 1.0]))
