"""Tests of rl_algos.returns against a plain reverse loop written here in Python floats (float64)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_algos.returns import (
    BLOCK_SIZE,
    compute_discounted_returns,
    compute_gae,
    discounted_reverse_cumsum,
)

K = BLOCK_SIZE


# --------------------------------------------------------------------------- reference loops


def reference_gae(rewards, values, mask, gamma, lam):
    """Textbook GAE, one row at a time, t from T − 1 down to 0, carrying over mask-0 positions."""
    advantages, returns = [], []
    for r_row, v_row, m_row in zip(rewards, values, mask):
        length = len(r_row)
        adv_row, ret_row = [0.0] * length, [0.0] * length
        next_value, last_advantage = 0.0, 0.0
        for t in range(length - 1, -1, -1):
            if not m_row[t]:
                continue  # both carries pass over this position unchanged
            delta = r_row[t] + gamma * next_value - v_row[t]
            last_advantage = delta + gamma * lam * last_advantage
            next_value = v_row[t]
            adv_row[t] = last_advantage
            ret_row[t] = last_advantage + v_row[t]
        advantages.append(adv_row)
        returns.append(ret_row)
    return advantages, returns


def reference_returns(rewards, mask, gamma):
    out = []
    for r_row, m_row in zip(rewards, mask):
        row = [0.0] * len(r_row)
        running = 0.0
        for t in range(len(r_row) - 1, -1, -1):
            if m_row[t]:
                running = r_row[t] + gamma * running
                row[t] = running
        out.append(row)
    return out


def reference_cumsum(x, gamma):
    out = []
    for row in x:
        y = [0.0] * len(row)
        running = 0.0
        for t in range(len(row) - 1, -1, -1):
            running = row[t] + gamma * running
            y[t] = running
        out.append(y)
    return out


def as_lists(t: torch.Tensor):
    return t.double().tolist()


def assert_close_to(actual: torch.Tensor, expected, *, rtol=1e-9, atol=1e-9):
    expected = torch.tensor(expected, dtype=torch.float64).reshape(actual.shape)
    torch.testing.assert_close(actual.double(), expected, rtol=rtol, atol=atol)


# --------------------------------------------------------------------------- input strategies

unit = st.one_of(st.sampled_from([0.0, 1.0]), st.floats(0.0, 1.0))
MASK_KINDS = ["holes", "right_pad", "left_pad", "all_ones", "with_empty_rows", "sparse"]


def make_mask(kind: str, batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
    if kind == "holes":
        return torch.rand(batch, length, generator=gen) < 0.7
    if kind == "sparse":
        return torch.rand(batch, length, generator=gen) < 0.1
    if kind == "all_ones":
        return torch.ones(batch, length, dtype=torch.bool)
    lengths = torch.randint(0, length + 1, (batch,), generator=gen)
    positions = torch.arange(length)
    if kind == "right_pad":
        return positions[None, :] < lengths[:, None]
    if kind == "left_pad":
        return positions[None, :] >= (length - lengths)[:, None]
    mask = torch.rand(batch, length, generator=gen) < 0.6
    mask[::2] = False  # "with_empty_rows": every other row has no action token at all
    return mask


@st.composite
def problems(draw):
    batch = draw(st.integers(1, 6))
    length = draw(st.integers(1, 300))
    kind = draw(st.sampled_from(MASK_KINDS))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    rewards = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    values = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    return rewards, values, make_mask(kind, batch, length, gen)


# --------------------------------------------------------------------------- discounted_reverse_cumsum


@pytest.mark.parametrize("length", [1, K - 1, K, K + 1, 3 * K + 5, K * K + 7])
@pytest.mark.parametrize("gamma", [0.0, 0.5, 0.99, 1.0])
def test_reverse_cumsum_equals_loop_across_block_boundaries(length, gamma):
    x = torch.randn(3, length, generator=torch.Generator().manual_seed(length), dtype=torch.float64)
    assert_close_to(discounted_reverse_cumsum(x, gamma), reference_cumsum(as_lists(x), gamma))


@settings(max_examples=40, deadline=None)
@given(length=st.integers(1, 5 * K), gamma=unit, seed=st.integers(0, 2**31 - 1))
def test_reverse_cumsum_equals_loop_for_random_lengths_and_discounts(length, gamma, seed):
    x = torch.randn(2, length, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    assert_close_to(discounted_reverse_cumsum(x, gamma), reference_cumsum(as_lists(x), gamma))


def test_reverse_cumsum_with_zero_discount_is_identity_and_with_unit_discount_is_suffix_sum():
    x = torch.randn(4, 3 * K + 1, dtype=torch.float64)
    torch.testing.assert_close(discounted_reverse_cumsum(x, 0.0), x)
    suffix_sums = x.flip(-1).cumsum(-1).flip(-1)
    torch.testing.assert_close(discounted_reverse_cumsum(x, 1.0), suffix_sums)


def test_reverse_cumsum_keeps_dtype_and_accepts_leading_dims():
    x = torch.randn(2, 3, 2 * K + 3)
    y = discounted_reverse_cumsum(x, 0.9)
    assert y.dtype == torch.float32
    assert y.shape == x.shape
    torch.testing.assert_close(y[1], discounted_reverse_cumsum(x[1], 0.9))


def test_reverse_cumsum_of_empty_input_is_empty():
    assert discounted_reverse_cumsum(torch.zeros(3, 0), 0.9).shape == (3, 0)
    assert discounted_reverse_cumsum(torch.zeros(0, 5), 0.9).shape == (0, 5)


# --------------------------------------------------------------------------- GAE


@settings(max_examples=120, deadline=None)
@given(problem=problems(), gamma=unit, lam=unit)
def test_gae_equals_reference_loop_for_any_mask(problem, gamma, lam):
    rewards, values, mask = problem
    advantages, returns = compute_gae(rewards, values, mask, gamma=gamma, lam=lam)
    expected_adv, expected_ret = reference_gae(as_lists(rewards), as_lists(values), mask.tolist(), gamma, lam)
    assert_close_to(advantages, expected_adv)
    assert_close_to(returns, expected_ret)


def test_gae_golden_values_by_hand():
    # T = 3, γ = 0.9, λ = 0.8 (so γλ = 0.72), r = [0, 0, 1], V = [0.5, 0.6, 0.7], all actions:
    #   δ_2 = 1 + 0.9·0   − 0.7 = 0.3             A_2 = 0.3
    #   δ_1 = 0 + 0.9·0.7 − 0.6 = 0.03            A_1 = 0.03 + 0.72·0.3   = 0.246
    #   δ_0 = 0 + 0.9·0.6 − 0.5 = 0.04            A_0 = 0.04 + 0.72·0.246 = 0.21712
    # returns R = A + V = [0.71712, 0.846, 1.0].
    rewards = torch.tensor([[0.0, 0.0, 1.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 0.6, 0.7]], dtype=torch.float64)
    advantages, returns = compute_gae(rewards, values, torch.ones(1, 3), gamma=0.9, lam=0.8)
    assert_close_to(advantages, [0.21712, 0.246, 0.3], atol=1e-12)
    assert_close_to(returns, [0.71712, 0.846, 1.0], atol=1e-12)


def test_gae_skips_observation_tokens_as_if_they_were_absent():
    # The golden case above with two observation tokens inserted (their reward and value are
    # junk and must be ignored): the action tokens get the same numbers, the others get 0.
    rewards = torch.tensor([[0.0, 5.0, 0.0, 5.0, 1.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 9.0, 0.6, 9.0, 0.7]], dtype=torch.float64)
    mask = torch.tensor([[1, 0, 1, 0, 1]])
    advantages, returns = compute_gae(rewards, values, mask, gamma=0.9, lam=0.8)
    assert_close_to(advantages, [0.21712, 0.0, 0.246, 0.0, 0.3], atol=1e-12)
    assert_close_to(returns, [0.71712, 0.0, 0.846, 0.0, 1.0], atol=1e-12)


@settings(max_examples=30, deadline=None)
@given(problem=problems())
def test_gae_with_unit_discount_and_zero_values_is_reward_to_go(problem):
    rewards, _, mask = problem
    advantages, returns = compute_gae(rewards, torch.zeros_like(rewards), mask)
    kept = rewards * mask
    reward_to_go = kept.flip(-1).cumsum(-1).flip(-1) * mask
    torch.testing.assert_close(advantages, reward_to_go)
    torch.testing.assert_close(returns, reward_to_go)


def test_gae_with_zero_lambda_is_one_step_td_error():
    rewards, values = (
        torch.randn(2, 2 * K + 9, dtype=torch.float64),
        torch.randn(2, 2 * K + 9, dtype=torch.float64),
    )
    advantages, _ = compute_gae(rewards, values, torch.ones_like(rewards), gamma=0.95, lam=0.0)
    next_values = torch.cat([values[:, 1:], torch.zeros(2, 1, dtype=torch.float64)], dim=1)
    torch.testing.assert_close(advantages, rewards + 0.95 * next_values - values)


def test_gae_ignores_non_finite_rewards_and_values_at_masked_positions():
    rewards, values = torch.randn(2, 10), torch.randn(2, 10)
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[:, 3] = mask[:, -1] = False
    clean = compute_gae(rewards, values, mask, gamma=0.9, lam=0.9)
    rewards[:, 3], values[:, -1] = float("nan"), float("inf")
    dirty = compute_gae(rewards, values, mask, gamma=0.9, lam=0.9)
    for a, b in zip(clean, dirty):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("dtype", [torch.bool, torch.int64, torch.int32, torch.float32, torch.float64])
def test_gae_accepts_bool_integer_and_float_masks_alike(dtype):
    gen = torch.Generator().manual_seed(1)
    rewards, values = torch.randn(3, 40, generator=gen), torch.randn(3, 40, generator=gen)
    mask = torch.rand(3, 40, generator=gen) < 0.5
    expected = compute_gae(rewards, values, mask, gamma=0.99, lam=0.95)
    actual = compute_gae(rewards, values, mask.to(dtype), gamma=0.99, lam=0.95)
    for a, b in zip(actual, expected):
        torch.testing.assert_close(a, b)


def test_gae_on_32k_tokens_is_finite_and_matches_the_loop():
    length = 32768
    gen = torch.Generator().manual_seed(7)
    rewards = 0.01 * torch.randn(2, length, generator=gen)
    rewards[:, -100] += 1.0
    values = torch.randn(2, length, generator=gen)
    mask = torch.ones(2, length, dtype=torch.bool)
    mask[:, -99:] = False  # right padding
    mask[1, 1000:1500] = False  # one observation span
    for gamma, lam in [(1.0, 1.0), (0.999, 0.95)]:
        advantages, returns = compute_gae(rewards, values, mask, gamma=gamma, lam=lam)
        assert torch.isfinite(advantages).all()
        assert torch.isfinite(returns).all()
        expected_adv, expected_ret = reference_gae(
            as_lists(rewards[1:]), as_lists(values[1:]), mask[1:].tolist(), gamma, lam
        )
        for t in [0, 999, 1500, 20000, length - 100, length - 1]:
            assert math.isclose(float(advantages[1, t]), expected_adv[0][t], rel_tol=1e-4, abs_tol=1e-3)
            assert math.isclose(float(returns[1, t]), expected_ret[0][t], rel_tol=1e-4, abs_tol=1e-3)


def test_gae_of_bf16_inputs_is_bf16_and_close_to_float32():
    gen = torch.Generator().manual_seed(3)
    rewards, values = torch.randn(4, 500, generator=gen), torch.randn(4, 500, generator=gen)
    mask = torch.rand(4, 500, generator=gen) < 0.8
    expected = compute_gae(rewards.bfloat16().float(), values.bfloat16().float(), mask, gamma=0.99, lam=0.95)
    actual = compute_gae(rewards.bfloat16(), values.bfloat16(), mask, gamma=0.99, lam=0.95)
    for a, b in zip(actual, expected):
        assert a.dtype == torch.bfloat16
        # Only the final rounding to bf16 (8 bits of mantissa) separates the two.
        torch.testing.assert_close(a.float(), b, rtol=1e-2, atol=1e-2)


def test_gae_outputs_carry_no_gradient():
    rewards = torch.randn(2, 8, requires_grad=True)
    values = torch.randn(2, 8, requires_grad=True)
    advantages, returns = compute_gae(rewards, values, torch.ones(2, 8))
    assert not advantages.requires_grad
    assert not returns.requires_grad


@pytest.mark.parametrize("shape", [(0, 5), (3, 0), (0, 0)])
def test_gae_of_empty_batch_or_sequence_is_empty(shape):
    advantages, returns = compute_gae(torch.zeros(shape), torch.zeros(shape), torch.zeros(shape))
    assert advantages.shape == returns.shape == shape


# --------------------------------------------------------------------------- discounted returns


@settings(max_examples=100, deadline=None)
@given(problem=problems(), gamma=unit)
def test_discounted_returns_equal_reference_loop_for_any_mask(problem, gamma):
    rewards, _, mask = problem
    returns = compute_discounted_returns(rewards, mask, gamma=gamma)
    assert_close_to(returns, reference_returns(as_lists(rewards), mask.tolist(), gamma))


def test_discounted_returns_golden_values_with_a_hole():
    # γ = 0.5, r = [1, 7, 2, 4] with position 1 an observation token (its 7 is ignored):
    #   G_3 = 4,  G_2 = 2 + 0.5·4 = 4,  G_0 = 1 + 0.5·4 = 3,  G_1 = 0 (masked).
    rewards = torch.tensor([[1.0, 7.0, 2.0, 4.0]], dtype=torch.float64)
    returns = compute_discounted_returns(rewards, torch.tensor([[True, False, True, True]]), gamma=0.5)
    assert_close_to(returns, [3.0, 0.0, 4.0, 4.0], atol=1e-12)


def test_discounted_returns_on_32k_tokens_are_finite_and_match_the_loop():
    length = 32768
    rewards = torch.randn(1, length, generator=torch.Generator().manual_seed(5))
    mask = torch.ones(1, length, dtype=torch.bool)
    mask[0, :50] = False  # left padding
    returns = compute_discounted_returns(rewards, mask, gamma=1.0)
    assert torch.isfinite(returns).all()
    expected = reference_returns(as_lists(rewards), mask.tolist(), 1.0)[0]
    for t in [0, 50, 10000, length - 1]:
        assert math.isclose(float(returns[0, t]), expected[t], rel_tol=1e-4, abs_tol=1e-2)


def test_discounted_returns_of_bf16_inputs_are_bf16_and_close_to_float32():
    rewards = torch.randn(3, 300, generator=torch.Generator().manual_seed(2)).bfloat16()
    mask = torch.ones(3, 300)
    actual = compute_discounted_returns(rewards, mask, gamma=0.9)
    assert actual.dtype == torch.bfloat16
    expected = compute_discounted_returns(rewards.float(), mask, gamma=0.9)
    torch.testing.assert_close(actual.float(), expected, rtol=1e-2, atol=1e-2)


def test_discounted_returns_of_empty_sequence_are_empty():
    assert compute_discounted_returns(torch.zeros(4, 0), torch.zeros(4, 0)).shape == (4, 0)


# --------------------------------------------------------------------------- argument checks


def test_bad_arguments_raise_naming_the_argument():
    r, v, m = torch.zeros(2, 5), torch.zeros(2, 5), torch.ones(2, 5)
    with pytest.raises(ValueError, match=r"token_rewards must have shape \[batch, seq\].*\(5,\)"):
        compute_gae(torch.zeros(5), v, m)
    with pytest.raises(ValueError, match=r"values must have shape \[batch, seq\].*\(2, 5, 1\)"):
        compute_gae(r, torch.zeros(2, 5, 1), m)
    with pytest.raises(ValueError, match=r"values has shape \(2, 4\) but token_rewards has shape \(2, 5\)"):
        compute_gae(r, torch.zeros(2, 4), m)
    with pytest.raises(
        ValueError, match=r"action_mask has shape \(2, 4\) but token_rewards has shape \(2, 5\)"
    ):
        compute_gae(r, v, torch.ones(2, 4))
    with pytest.raises(TypeError, match="token_rewards must be a floating-point tensor"):
        compute_gae(torch.zeros(2, 5, dtype=torch.long), v, m)
    with pytest.raises(TypeError, match="values must be a floating-point tensor"):
        compute_gae(r, torch.zeros(2, 5, dtype=torch.long), m)
    with pytest.raises(TypeError, match=r"token_rewards must be a torch\.Tensor"):
        compute_gae([[0.0]], v, m)
    with pytest.raises(ValueError, match="action_mask must hold only 0 and 1"):
        compute_gae(r, v, torch.full((2, 5), 2))
    with pytest.raises(ValueError, match="action_mask must hold only 0 and 1"):
        compute_discounted_returns(r, torch.full((2, 5), 0.5))
    with pytest.raises(ValueError, match=r"gamma must be in \[0, 1\]"):
        compute_gae(r, v, m, gamma=1.01)
    with pytest.raises(ValueError, match=r"lam must be in \[0, 1\]"):
        compute_gae(r, v, m, lam=-0.1)
    with pytest.raises(TypeError, match="lam must be a number"):
        compute_gae(r, v, m, lam=float("nan"))
    with pytest.raises(ValueError, match=r"gamma must be in \[0, 1\]"):
        compute_discounted_returns(r, m, gamma=2.0)
    with pytest.raises(ValueError, match=r"token_rewards must have shape \[batch, seq\]"):
        compute_discounted_returns(torch.zeros(2, 5, 1), m)
    with pytest.raises(ValueError, match=r"gamma must be in \[0, 1\]"):
        discounted_reverse_cumsum(r, -0.5)
    with pytest.raises(TypeError, match="x must be a floating-point tensor"):
        discounted_reverse_cumsum(torch.zeros(2, 5, dtype=torch.long), 0.5)


# --------------------------------------------------------------------------- device


@pytest.mark.gpu
def test_cuda_results_match_cpu():
    gen = torch.Generator().manual_seed(11)
    rewards, values = torch.randn(8, 5000, generator=gen), torch.randn(8, 5000, generator=gen)
    mask = torch.rand(8, 5000, generator=gen) < 0.9
    cpu_adv, cpu_ret = compute_gae(rewards, values, mask, gamma=0.999, lam=0.95)
    gpu_adv, gpu_ret = compute_gae(rewards.cuda(), values.cuda(), mask.cuda(), gamma=0.999, lam=0.95)
    torch.testing.assert_close(gpu_adv.cpu(), cpu_adv, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(gpu_ret.cpu(), cpu_ret, rtol=1e-4, atol=1e-4)
    cpu_g = compute_discounted_returns(rewards, mask, gamma=0.99)
    gpu_g = compute_discounted_returns(rewards.cuda(), mask.cuda(), gamma=0.99)
    assert gpu_g.device.type == "cuda"
    torch.testing.assert_close(gpu_g.cpu(), cpu_g, rtol=1e-4, atol=1e-4)
    x = rewards.cuda().bfloat16()
    assert discounted_reverse_cumsum(x, 0.5).dtype == torch.bfloat16
