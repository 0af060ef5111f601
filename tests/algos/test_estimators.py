"""Advantage estimators: REFERENCE.md worked values, hand-computed cases, group properties."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rl_algos
from rl_algos import ADVANTAGE_ESTIMATORS, GROUP_NORM_PRESETS, compute_advantages, group_normalize

R = torch.tensor([1.0, 0.0, 0.5, 0.0])
ONE_GROUP = torch.zeros(4, dtype=torch.long)
FULL_MASK = torch.ones(4, 3)


def scalar_advantages(name: str, **inputs) -> torch.Tensor:
    advantages, _ = compute_advantages(name, **inputs)
    return advantages[:, 0]


# ------------------------------------------------------------------------ REFERENCE.md values


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("grpo", [1.305580, -0.783348, 0.261116, -0.783348]),
        ("group_norm", [1.305580, -0.783348, 0.261116, -0.783348]),
        ("dr_grpo", [0.625, -0.375, 0.125, -0.375]),
        ("rloo", [0.833333, -0.5, 0.166667, -0.5]),
    ],
)
def test_group_estimators_reproduce_reference_worked_values(name, expected):
    got = scalar_advantages(name, rewards=R, group_ids=ONE_GROUP, action_mask=FULL_MASK)
    torch.testing.assert_close(got, torch.tensor(expected), atol=1e-6, rtol=0)


def test_opo_uses_length_weighted_baseline_reference_values():
    lengths = torch.tensor([2, 4, 3, 1])
    mask = (torch.arange(4)[None] < lengths[:, None]).float()
    advantages, returns = compute_advantages("opo", rewards=R, group_ids=ONE_GROUP, action_mask=mask)
    expected = torch.tensor([0.65, -0.35, 0.15, -0.35])
    torch.testing.assert_close(advantages[:, 0], expected, atol=1e-6, rtol=0)
    # broadcast over exactly the action tokens
    torch.testing.assert_close(advantages, expected[:, None] * mask)
    torch.testing.assert_close(returns, advantages)


def test_grpo_presets_follow_each_frameworks_epsilon_and_std():
    mean, std = 0.375, 0.478714
    for preset, epsilon in [("verl", 1e-6), ("trl", 1e-4), ("openrlhf", 1e-9)]:
        got = scalar_advantages("grpo", rewards=R, group_ids=ONE_GROUP, action_mask=FULL_MASK, preset=preset)
        torch.testing.assert_close(got, (R - mean) / (std + epsilon), atol=2e-6, rtol=0)


def test_nemo_rl_preset_uses_leave_one_out_mean_and_std():
    # i = 0: others [0, 0.5, 0] → mean 1/6, population std sqrt(1/18); (1 − 1/6)/sqrt(1/18) = 3.535534
    # i = 1: others [1, 0.5, 0] → mean 0.5, std sqrt(1/6); (0 − 0.5)/0.408248 = −1.224745
    # i = 2: others [1, 0, 0] → mean 1/3, std sqrt(2/9); (0.5 − 1/3)/0.471405 = 0.353553
    got = group_normalize(R, ONE_GROUP, **GROUP_NORM_PRESETS["nemo_rl"])
    centred = torch.tensor([5 / 6, -0.5, 1 / 6, -0.5])
    spread = torch.tensor([math.sqrt(1 / 18), math.sqrt(1 / 6), math.sqrt(2 / 9), math.sqrt(1 / 6)])
    torch.testing.assert_close(got, centred / (spread + 1e-6), atol=1e-6, rtol=0)
    torch.testing.assert_close(
        got, torch.tensor([3.535534, -1.224745, 0.353553, -1.224745]), atol=2e-5, rtol=0
    )


def test_leave_one_out_zero_spread_keeps_centred_value_finite():
    # K = 2: the "others" set has one member, so its std is 0; the centred value passes unscaled.
    got = group_normalize(
        torch.tensor([1.0, 0.0]), torch.tensor([3, 3]), centre="leave_one_out", scale="leave_one_out_std"
    )
    torch.testing.assert_close(got, torch.tensor([1.0, -1.0]))


# -------------------------------------------------------------------------- hand-computed cases


def test_gpg_scales_centred_rewards_by_batch_over_nonzero_count():
    # groups {0,1}: r = [1, 0] mean 0.5 → [0.5, −0.5]; {2,3}: r = [2, 0] mean 1 → [1, −1]
    # B = 4, nonzero rewards = 2 → α = 2
    rewards = torch.tensor([1.0, 0.0, 2.0, 0.0])
    got = scalar_advantages(
        "gpg", rewards=rewards, group_ids=torch.tensor([0, 0, 1, 1]), action_mask=FULL_MASK
    )
    torch.testing.assert_close(got, torch.tensor([1.0, -1.0, 2.0, -2.0]))


def test_remax_subtracts_the_greedy_reward():
    got = scalar_advantages(
        "remax", rewards=R, baseline_rewards=torch.tensor([0.5, 0.5, 1.0, 0.0]), action_mask=FULL_MASK
    )
    torch.testing.assert_close(got, torch.tensor([0.5, -0.5, -0.5, 0.0]))


def test_grpo_passk_credits_only_the_best_member_with_best_minus_second():
    rewards = torch.tensor([0.2, 1.0, 0.7, 3.0, 5.0, 5.0, 9.0])
    groups = torch.tensor([0, 0, 0, 1, 2, 2, 3])
    got = scalar_advantages("grpo_passk", rewards=rewards, group_ids=groups, action_mask=torch.ones(7, 2))
    # group 0: best 1.0, second 0.7 → 0.3 on index 1; group 1 alone → 0; group 2 tie → 0; group 3 alone → 0
    torch.testing.assert_close(got, torch.tensor([0.0, 0.3, 0.0, 0.0, 0.0, 0.0, 0.0]), atol=1e-6, rtol=0)


def test_grpo_passk_normalised_by_group_std():
    rewards = torch.tensor([0.0, 1.0])
    got = scalar_advantages(
        "grpo_passk", rewards=rewards, group_ids=torch.tensor([0, 0]), action_mask=torch.ones(2, 1),
        normalize_by_std=True, epsilon=1e-6,
    )  # fmt: skip
    std = math.sqrt(0.5)  # unbiased std of [0, 1]
    torch.testing.assert_close(got, torch.tensor([0.0, 1.0 / (std + 1e-6)]))


def test_reinforce_discounts_then_whitens_over_all_action_tokens():
    # one sample, tokens r = [0, 0, 1], γ = 0.5 → G = [0.25, 0.5, 1]
    # population mean 7/12, var = ((−1/3)² + (−1/12)² + (5/12)²)/3 = 0.0972222
    token_rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    advantages, returns = compute_advantages(
        "reinforce", token_rewards=token_rewards, action_mask=mask, gamma=0.5
    )
    torch.testing.assert_close(returns, torch.tensor([[0.25, 0.5, 1.0, 0.0]]))
    g = torch.tensor([0.25, 0.5, 1.0])
    expected = (g - g.mean()) / torch.sqrt(((g - g.mean()) ** 2).mean())
    torch.testing.assert_close(advantages[0, :3], expected)
    assert advantages[0, 3] == 0


def test_reinforce_baseline_subtracts_group_mean_at_the_last_action_token():
    rewards = torch.tensor([1.0, 0.0, 3.0, 1.0])
    groups = torch.tensor([0, 0, 1, 1])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]])
    token_rewards = rl_algos.token_level_rewards(rewards, mask)
    _, returns = compute_advantages(
        "reinforce_baseline", token_rewards=token_rewards, rewards=rewards, group_ids=groups, action_mask=mask
    )
    # γ = 1: every action token's return is the centred reward: [0.5, −0.5, 1, −1]
    expected = torch.tensor([[0.5, 0.5, 0], [-0.5, 0, 0], [1, 1, 1], [-1, -1, 0]])
    torch.testing.assert_close(returns, expected)


def test_gae_estimator_returns_advantages_plus_values():
    # T = 2, γ = λ = 1: δ1 = 1 − 0.5 = 0.5, δ0 = 0 + 0.5 − 0.2 = 0.3; A = [0.8, 0.5]
    advantages, returns = compute_advantages(
        "gae",
        token_rewards=torch.tensor([[0.0, 1.0]]),
        values=torch.tensor([[0.2, 0.5]]),
        action_mask=torch.ones(1, 2),
    )
    torch.testing.assert_close(advantages, torch.tensor([[0.8, 0.5]]))
    torch.testing.assert_close(returns, torch.tensor([[1.0, 1.0]]))


def test_gae_whitened_advantages_keep_the_unwhitened_returns():
    # A = [0.8, 0.5] (above) and 0.3 on a second row, one environment token masked out:
    # μ = 1.6/3, population σ² = (0.0711 + 0.0011 + 0.0544)/3 → (A − μ)/σ
    token_rewards = torch.tensor([[0.0, 1.0], [0.3, 5.0]])
    values = torch.tensor([[0.2, 0.5], [0.0, 0.0]])
    mask = torch.tensor([[True, True], [True, False]])
    plain, plain_returns = compute_advantages(
        "gae", token_rewards=token_rewards, values=values, action_mask=mask
    )
    whitened, returns = compute_advantages(
        "gae", token_rewards=token_rewards, values=values, action_mask=mask, whiten=True
    )
    torch.testing.assert_close(returns, plain_returns)
    on = plain[mask].double()
    expected = (on - on.mean()) / on.var(unbiased=False).sqrt()
    torch.testing.assert_close(whitened[mask].double(), expected, rtol=1e-6, atol=1e-6)
    assert whitened[1, 1] == 0
    assert abs(float(whitened[mask].mean())) < 1e-6


# ---------------------------------------------------------------------------------- properties


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "gpg", "opo", "grpo_passk"])
def test_zero_variance_group_gives_zero_advantage_never_nan(name):
    rewards = torch.tensor([0.7, 0.7, 0.7, 1.0, 0.0])
    groups = torch.tensor([4, 4, 4, 9, 9])
    got = scalar_advantages(name, rewards=rewards, group_ids=groups, action_mask=torch.ones(5, 2))
    assert torch.isfinite(got).all()
    assert torch.equal(got[:3], torch.zeros(3))


@pytest.mark.parametrize(("singleton", "expected"), [("zero", 0.0), ("raw", 2.5)])
def test_group_of_one_is_handled_as_documented(singleton, expected):
    got = group_normalize(torch.tensor([2.5, 1.0, 0.0]), torch.tensor([7, 8, 8]), singleton=singleton)
    assert got[0].item() == expected
    assert torch.isfinite(got).all()


def test_group_of_one_raises_when_asked_and_names_the_group():
    with pytest.raises(ValueError, match=r"group_ids.*group\(s\) of one.*\[7\]"):
        group_normalize(torch.tensor([2.5, 1.0, 0.0]), torch.tensor([7, 8, 8]), singleton="error")


@settings(max_examples=40, deadline=None)
@given(
    data=st.data(),
    sizes=st.lists(st.integers(min_value=2, max_value=6), min_size=1, max_size=5),
    name=st.sampled_from(["grpo", "dr_grpo", "rloo", "opo", "gpg", "grpo_passk"]),
)
def test_group_estimators_depend_on_group_ids_not_row_order(data, sizes, name):
    group_ids = torch.cat([torch.full((k,), g * 11, dtype=torch.long) for g, k in enumerate(sizes)])
    batch = group_ids.numel()
    rewards = torch.tensor(
        data.draw(st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0]), min_size=batch, max_size=batch))
    )
    lengths = torch.tensor(data.draw(st.lists(st.integers(1, 5), min_size=batch, max_size=batch)))
    mask = (torch.arange(5)[None] < lengths[:, None]).float()
    perm = torch.tensor(data.draw(st.permutations(list(range(batch)))))
    base, _ = compute_advantages(name, rewards=rewards, group_ids=group_ids, action_mask=mask)
    shuffled, _ = compute_advantages(
        name, rewards=rewards[perm], group_ids=group_ids[perm], action_mask=mask[perm]
    )
    if name == "grpo_passk":  # ties pick the first member: compare only tie-free batches exactly
        distinct = all(
            len(set(rewards[group_ids == g].tolist())) == int((group_ids == g).sum()) for g in group_ids
        )
        if not distinct:
            return
    torch.testing.assert_close(shuffled, base[perm], atol=1e-6, rtol=0)


@settings(max_examples=40, deadline=None)
@given(
    rewards=st.lists(st.floats(-5, 5, allow_nan=False), min_size=2, max_size=12),
)
def test_rloo_equals_k_over_k_minus_one_times_dr_grpo(rewards):
    r = torch.tensor(rewards, dtype=torch.float64)
    g = torch.zeros(len(rewards), dtype=torch.long)
    k = len(rewards)
    rloo = group_normalize(r, g, centre="leave_one_out", scale="none")
    dr = group_normalize(r, g, centre="group", scale="none")
    torch.testing.assert_close(rloo, k / (k - 1) * dr)


@settings(max_examples=30, deadline=None)
@given(rewards=st.lists(st.floats(-100, 100, allow_nan=False), min_size=2, max_size=16))
def test_grpo_advantages_have_zero_mean_and_unit_unbiased_std_per_group(rewards):
    r = torch.tensor(rewards, dtype=torch.float64)
    a = group_normalize(r, torch.zeros(len(rewards), dtype=torch.long), epsilon=1e-12)
    if r.std() > 1e-6:
        assert abs(a.mean().item()) < 1e-9
        assert abs(a.std().item() - 1) < 1e-6


def test_batch_centre_and_scale_need_no_group_ids():
    got = group_normalize(R, None, centre="batch", scale="batch_std", epsilon=1e-12)
    torch.testing.assert_close(got, (R - R.mean()) / R.std())


def test_bf16_rewards_give_float32_advantages():
    got = scalar_advantages(
        "grpo", rewards=R.bfloat16(), group_ids=ONE_GROUP, action_mask=FULL_MASK.bfloat16()
    )
    assert got.dtype == torch.float32
    torch.testing.assert_close(
        got, torch.tensor([1.305580, -0.783348, 0.261116, -0.783348]), atol=1e-5, rtol=0
    )


# ------------------------------------------------------------------------------- registry use


def test_user_registered_estimator_is_found_by_name_and_receives_declared_inputs():
    seen = {}

    def constant(*, rewards, action_mask, value: float = 1.0):
        seen["keys"] = True
        return action_mask.float() * value, action_mask.float() * value

    ADVANTAGE_ESTIMATORS.register("test_constant", constant)
    try:
        advantages, _ = compute_advantages(
            "test_constant", rewards=R, action_mask=FULL_MASK, group_ids=ONE_GROUP, value=2.0
        )
        assert torch.equal(advantages, FULL_MASK * 2)
    finally:
        del ADVANTAGE_ESTIMATORS["test_constant"]


def test_every_issue_estimator_is_registered():
    expected = {
        "gae", "reinforce", "reinforce_baseline", "rloo", "grpo", "group_norm",
        "dr_grpo", "opo", "gpg", "remax", "grpo_passk", "group_reward_to_go", "flash_reinforce",
    }  # fmt: skip
    assert expected <= set(ADVANTAGE_ESTIMATORS)


# ---------------------------------------------------------------------------------- bad input


def test_unknown_estimator_error_lists_known_names():
    with pytest.raises(KeyError, match=r"unknown advantage estimator 'grpoo'; known names: .*grpo.*rloo"):
        compute_advantages("grpoo", rewards=R)


def test_unknown_option_names_the_option_and_the_estimators_options():
    with pytest.raises(TypeError, match=r"'rloo' has no option 'epsilon'"):
        compute_advantages("rloo", rewards=R, group_ids=ONE_GROUP, action_mask=FULL_MASK, epsilon=1e-6)


def test_missing_input_is_named():
    with pytest.raises(ValueError, match=r"'gae' needs \['values'\]"):
        compute_advantages("gae", token_rewards=FULL_MASK, action_mask=FULL_MASK)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_reward_is_rejected_with_its_index(bad):
    rewards = torch.tensor([1.0, bad, 0.0, 0.0])
    with pytest.raises(ValueError, match=r"rewards must be finite, got .* at index 1"):
        compute_advantages("grpo", rewards=rewards, group_ids=ONE_GROUP, action_mask=FULL_MASK)


def test_empty_batch_is_rejected():
    with pytest.raises(ValueError, match="rewards is empty"):
        group_normalize(torch.zeros(0), torch.zeros(0, dtype=torch.long))


def test_group_ids_shape_mismatch_names_both_arguments():
    with pytest.raises(ValueError, match=r"group_ids has shape \(3,\) but rewards has shape \(4,\)"):
        group_normalize(R, torch.zeros(3, dtype=torch.long))


def test_float_group_ids_are_rejected():
    with pytest.raises(TypeError, match="group_ids must be an integer tensor"):
        group_normalize(R, torch.zeros(4))


def test_mask_rows_must_match_rewards():
    with pytest.raises(ValueError, match=r"action_mask has 3 rows .* rewards has 4"):
        compute_advantages("grpo", rewards=R, group_ids=ONE_GROUP, action_mask=torch.ones(3, 2))


@pytest.mark.parametrize("epsilon", [0.0, -1e-6])
def test_non_positive_epsilon_is_rejected(epsilon):
    with pytest.raises(ValueError, match=r"epsilon must be > 0"):
        group_normalize(R, ONE_GROUP, epsilon=epsilon)


def test_unknown_centre_lists_allowed_values():
    with pytest.raises(
        ValueError, match=r"centre must be one of \['batch', 'group', 'leave_one_out', 'none'\]"
    ):
        group_normalize(R, ONE_GROUP, centre="median")


def test_unknown_preset_lists_presets():
    with pytest.raises(ValueError, match=r"preset must be one of \['nemo_rl', 'openrlhf', 'trl', 'verl'\]"):
        compute_advantages("grpo", rewards=R, group_ids=ONE_GROUP, action_mask=FULL_MASK, preset="x")


def test_reward_without_action_token_is_rejected_with_its_row():
    mask = torch.tensor([[1, 1], [0, 0]])
    with pytest.raises(ValueError, match=r"action_mask has rows with no action token \(rows \[1\]\)"):
        rl_algos.token_level_rewards(torch.tensor([1.0, 0.0]), mask)


@pytest.mark.gpu
def test_estimators_run_on_cuda_and_match_cpu():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]])
    for name in ["grpo", "rloo", "opo", "gpg", "grpo_passk"]:
        cpu, _ = compute_advantages(name, rewards=R, group_ids=ONE_GROUP, action_mask=mask)
        gpu, _ = compute_advantages(
            name, rewards=R.cuda(), group_ids=ONE_GROUP.cuda(), action_mask=mask.cuda()
        )
        torch.testing.assert_close(gpu.cpu(), cpu)
