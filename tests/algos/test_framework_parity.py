"""Parity with verl 0.9.1 and OpenRLHF 0.11.2 as they run: the numbers of issue 12.

Each test pins a value or gradient that the framework itself produces on the same input; the
comments give the hand computation.
"""

from __future__ import annotations

import math

import pytest
import torch

from rl_algos import (
    GROUP_NORM_PRESETS,
    POLICY_LOSSES,
    aggregate_loss,
    compute_advantages,
    kl_penalty,
    rollout_correction,
    token_level_rewards,
)

# ------------------------------------------------------------------- defect 1: verl's `vanilla`


def test_vanilla_is_verls_clipped_ppo_loss_not_reinforce():
    # log π = log π_old = −1, A = 1: ρ = 1, verl's vanilla l = −ρ·A = −1; REINFORCE would give −A·log π = +1
    one = torch.tensor([[-1.0]])
    loss, _ = POLICY_LOSSES["vanilla"](one, one, torch.ones(1, 1), torch.ones(1, 1))
    assert loss.item() == pytest.approx(-1.0)
    reinforce, _ = POLICY_LOSSES["reinforce"](one, one, torch.ones(1, 1), torch.ones(1, 1))
    assert reinforce.item() == pytest.approx(1.0)


def test_vanilla_has_verls_dual_clip_of_three_by_default():
    # A = −1, ρ = 5: PPO gives 5, the dual clip caps it at c·|A| = 3
    loss, metrics = POLICY_LOSSES["vanilla"](
        torch.tensor([[math.log(5.0)]]), torch.zeros(1, 1), -torch.ones(1, 1), torch.ones(1, 1)
    )
    assert loss.item() == pytest.approx(3.0)
    assert metrics["dual_clip_fraction"].item() == 1.0


def test_gpg_policy_loss_is_reinforce_as_in_verl():
    assert POLICY_LOSSES["gpg"] is POLICY_LOSSES["reinforce"]


# ------------------------------------------------------ defect 2: "+" KL gradient past the clamp


@pytest.mark.parametrize("name", ["k3+", "low_var_kl+"])
def test_straight_through_kl_keeps_its_gradient_beyond_the_log_ratio_clamp(name):
    # verl: value from d clamped to ±20 then k3 clamped to 10 → 10.0; gradient of d²/2 with the
    # unclamped d = −30 − (−1) = −29
    logprobs = torch.tensor([[-30.0]], requires_grad=True)
    kl = kl_penalty(logprobs, torch.tensor([[-1.0]]), name, log_ratio_clamp=20.0, value_clamp=10.0)
    assert kl.item() == pytest.approx(10.0)
    (grad,) = torch.autograd.grad(kl.sum(), logprobs)
    assert grad.item() == pytest.approx(-29.0)


# -------------------------------------------- defect 3: REINFORCE++-baseline centres, then clips


def test_reinforce_baseline_centres_before_clipping_like_openrlhf():
    rewards = torch.tensor([30.0, 0.0, 0.0, 12.0])
    mask = torch.ones(4, 1)
    groups = torch.zeros(4, dtype=torch.long)
    token_rewards = token_level_rewards(rewards, mask)  # default reward_clip 10
    advantages, returns = compute_advantages(
        "reinforce_baseline", token_rewards=token_rewards, rewards=rewards, group_ids=groups, action_mask=mask
    )
    # clip(r − 10.5, ±10) = [10, −10, −10, 1.5]; whitened (population std 8.428980): [1.44, −0.93, −0.93, 0.43]
    torch.testing.assert_close(returns.flatten(), torch.tensor([10.0, -10.0, -10.0, 1.5]))
    torch.testing.assert_close(
        advantages.flatten(), torch.tensor([1.438498, -0.934282, -0.934282, 0.430066]), atol=1e-5, rtol=0
    )


def test_reinforce_baseline_keeps_the_kl_part_of_the_token_rewards():
    rewards = torch.tensor([30.0, 0.0])
    mask = torch.ones(2, 2)
    kl = torch.tensor([[1.0, 2.0], [0.5, 0.0]])
    token_rewards = token_level_rewards(rewards, mask, kl=kl, kl_coef=0.1)
    _, returns = compute_advantages(
        "reinforce_baseline",
        token_rewards=token_rewards,
        rewards=rewards,
        group_ids=torch.zeros(2, dtype=torch.long),
        action_mask=mask,
        whiten=False,
    )
    # token rewards [−0.1, −0.2 + clip(15)] and [−0.05, clip(−15)]; γ = 1 returns
    torch.testing.assert_close(returns, torch.tensor([[9.7, 9.8], [-10.05, -10.0]]))


# ------------------------------------------------------------------- groups of one sample


SINGLETON_REWARDS = torch.tensor([2.0, 0.0, 3.0])
SINGLETON_GROUPS = torch.tensor([0, 1, 1])  # sample 0 is alone


@pytest.mark.parametrize(
    ("name", "raw", "zero"),
    [
        ("dr_grpo", [2.0, -1.5, 1.5], [0.0, -1.5, 1.5]),
        ("rloo", [2.0, -3.0, 3.0], [0.0, -3.0, 3.0]),
        ("opo", [2.0, -1.5, 1.5], [0.0, -1.5, 1.5]),
        # α = B / #nonzero = 3/2
        ("gpg", [3.0, -2.25, 2.25], [0.0, -2.25, 2.25]),
        ("grpo", [2.0, -0.707106, 0.707106], [0.0, -0.707106, 0.707106]),
        ("grpo_passk", [2.0, 0.0, 3.0], [0.0, 0.0, 3.0]),
    ],
)
def test_singleton_raw_keeps_the_reward_as_verl_and_zero_is_the_default(name, raw, zero):
    inputs = {"rewards": SINGLETON_REWARDS, "group_ids": SINGLETON_GROUPS, "action_mask": torch.ones(3, 2)}
    got_raw, _ = compute_advantages(name, singleton="raw", **inputs)
    got_default, _ = compute_advantages(name, **inputs)
    torch.testing.assert_close(got_raw[:, 0], torch.tensor(raw), atol=1e-5, rtol=0)
    torch.testing.assert_close(got_default[:, 0], torch.tensor(zero), atol=1e-5, rtol=0)


def test_singleton_raw_in_reinforce_baseline_uses_a_zero_baseline():
    mask = torch.ones(3, 1)
    inputs = {
        "rewards": SINGLETON_REWARDS,
        "token_rewards": token_level_rewards(SINGLETON_REWARDS, mask),
        "group_ids": SINGLETON_GROUPS,
        "action_mask": mask,
        "whiten": False,
    }
    _, raw = compute_advantages("reinforce_baseline", singleton="raw", **inputs)
    _, zero = compute_advantages("reinforce_baseline", **inputs)
    torch.testing.assert_close(raw.flatten(), torch.tensor([2.0, -1.5, 1.5]))
    torch.testing.assert_close(zero.flatten(), torch.tensor([0.0, -1.5, 1.5]))


@pytest.mark.parametrize(
    "name", ["grpo", "dr_grpo", "rloo", "opo", "gpg", "grpo_passk", "reinforce_baseline"]
)
def test_singleton_error_names_the_lonely_group_in_every_group_estimator(name):
    mask = torch.ones(3, 1)
    with pytest.raises(ValueError, match=r"group\(s\) of one sample \(e\.g\. \[0\]\)"):
        compute_advantages(
            name,
            rewards=SINGLETON_REWARDS,
            token_rewards=token_level_rewards(SINGLETON_REWARDS, mask),
            group_ids=SINGLETON_GROUPS,
            action_mask=mask,
            singleton="error",
        )


def test_verl_grpo_preset_passes_a_lonely_reward_through():
    assert GROUP_NORM_PRESETS["verl"]["singleton"] == "raw"


# ---------------------------------------------------------------------------- GSPO, two forms


def _gspo_gradient(name, advantages):
    logprobs = torch.zeros(1, 2, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(1, 2)
    loss, _ = POLICY_LOSSES[name](logprobs, logprobs.detach(), advantages, mask)
    (grad,) = torch.autograd.grad(aggregate_loss(loss, mask, "seq-mean-token-mean"), logprobs)
    return grad


def test_gspo_token_form_and_openrlhf_sequence_form_differ_for_token_advantages():
    advantages = torch.tensor([[1.0, 3.0]], dtype=torch.float64)
    # GSPO-token: −A_t·s/L = [−0.5, −1.5]; OpenRLHF: −(Σ_t A_t/L)·s/L = −(4/2)/2 = −1 for both tokens
    torch.testing.assert_close(
        _gspo_gradient("gspo", advantages), torch.tensor([[-0.5, -1.5]], dtype=torch.float64)
    )
    torch.testing.assert_close(
        _gspo_gradient("gspo_sequence", advantages), torch.tensor([[-1.0, -1.0]], dtype=torch.float64)
    )


def test_gspo_forms_agree_for_sequence_level_advantages():
    advantages = torch.tensor([[2.0, 2.0]], dtype=torch.float64)
    torch.testing.assert_close(
        _gspo_gradient("gspo", advantages), _gspo_gradient("gspo_sequence", advantages)
    )


def test_gspo_sequence_clips_the_sequence_ratio():
    # d = [0.1, 0.3] → s = exp(0.2) = 1.221403: A > 0 → −1.0004; A < 0 → +1.221403
    old = torch.zeros(2, 2)
    logprobs = torch.tensor([[0.1, 0.3], [0.1, 0.3]])
    advantages = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    loss, _ = POLICY_LOSSES["gspo_sequence"](logprobs, old, advantages, torch.ones(2, 2))
    torch.testing.assert_close(loss, torch.tensor([[-1.0004, -1.0004], [1.221403, 1.221403]]))


# ------------------------------------------------------- OpenRLHF's unbiased_gradient KL


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_unbiased_gradient_kl_keeps_the_value_and_weights_the_k2_gradient_by_pi_over_pi_old(estimator):
    logprobs = torch.tensor([[-1.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.5]], dtype=torch.float64)
    old = torch.tensor([[-1.2]], dtype=torch.float64)
    plain = kl_penalty(logprobs, ref, estimator)
    kl = kl_penalty(logprobs, ref, estimator, unbiased_gradient=True, old_logprobs=old)
    torch.testing.assert_close(kl, plain)
    (grad,) = torch.autograd.grad(kl.sum(), logprobs)
    # w·d = exp(−1 + 1.2)·0.5 = 1.221403·0.5
    assert grad.item() == pytest.approx(math.exp(0.2) * 0.5)


def test_unbiased_gradient_without_old_logprobs_is_the_on_policy_reverse_kl_gradient():
    logprobs = torch.tensor([[-100.0, -1.0]], dtype=torch.float64, requires_grad=True)
    kl = kl_penalty(logprobs, torch.zeros(1, 2, dtype=torch.float64), "k3", unbiased_gradient=True)
    (grad,) = torch.autograd.grad(kl.sum(), logprobs)
    # value clamped to 10 on the first token, gradient d itself on both
    assert kl[0, 0].item() == pytest.approx(10.0)
    torch.testing.assert_close(grad, torch.tensor([[-100.0, -1.0]], dtype=torch.float64))


def test_unbiased_gradient_weight_cap():
    logprobs = torch.tensor([[0.0]], requires_grad=True)
    kl = kl_penalty(
        logprobs,
        torch.tensor([[-1.0]]),
        "k3",
        unbiased_gradient=True,
        old_logprobs=torch.tensor([[-3.0]]),
        importance_weight_cap=2.0,
    )
    (grad,) = torch.autograd.grad(kl.sum(), logprobs)
    assert grad.item() == pytest.approx(2.0 * 1.0)  # min(e³, 2)·d


def test_old_logprobs_without_unbiased_gradient_is_refused():
    with pytest.raises(ValueError, match="old_logprobs is used only with unbiased_gradient=True"):
        kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), "k3", old_logprobs=torch.zeros(1, 1))


def test_openrlhf_caps_the_unbiased_gradient_weight_at_ten():
    # OpenRLHF 0.11.2 (KL_IS_WEIGHT_CLIP = 10): log π = −1, log π_ref = −1.5, log π_old = −4, so
    # w = e³ = 20.09 and d = 0.5. The gradient of sg(w)·d²/2 is w·d: 10.04 uncapped, 10·0.5 = 5.0 capped.
    def gradient(**cap):
        logprobs = torch.tensor([[-1.0]], dtype=torch.float64, requires_grad=True)
        kl = kl_penalty(
            logprobs,
            torch.tensor([[-1.5]], dtype=torch.float64),
            "k3",
            unbiased_gradient=True,
            old_logprobs=torch.tensor([[-4.0]], dtype=torch.float64),
            **cap,
        )
        (grad,) = torch.autograd.grad(kl.sum(), logprobs)
        return grad.item()

    assert gradient(importance_weight_cap=10) == pytest.approx(5.0)
    assert gradient() == pytest.approx(math.exp(3.0) * 0.5)  # 10.04: kl_penalty caps nothing by default


# ------------------------------------------------------------------ verl's KL-Cov coefficient


def test_kl_cov_default_coefficient_is_verls_config_default():
    # verl's actor.policy_loss.ppo_kl_coef is 0.1 (1.0 is only its fallback for None). A = [2, 1, 0, −3],
    # log π = [−1, −2, −3, −4], log π_old = log π − 0.1: ρ = e^0.1, one token penalised (covariance 4.5,
    # the last), l = ρ·[−2, −1, 0, 3] + [0, 0, 0, 0.1·|0.1|]; token-mean (ρ terms sum to 0): 0.01/4.
    logprobs = torch.tensor([[-1.0, -2.0, -3.0, -4.0]])
    advantages = torch.tensor([[2.0, 1.0, 0.0, -3.0]])
    mask = torch.ones(1, 4)
    loss, metrics = POLICY_LOSSES["kl_cov"](logprobs, logprobs - 0.1, advantages, mask)
    assert aggregate_loss(loss, mask, "token-mean").item() == pytest.approx(0.0025, abs=1e-7)
    assert metrics["kl_cov_fraction"].item() == pytest.approx(0.25)


# ----------------------------------------- OpenRLHF's divergence gate and float32 rounding


def test_a_binary_kl_rounded_below_zero_is_kept_here_and_dropped_by_openrlhf():
    # In float32, p = e^−0.5 against q = e^−0.5000003 gives a binary KL of about −4.3e-8. rl_algos
    # bounds the statistic from above only and keeps the token with its weight w = q/p ≈ 1;
    # OpenRLHF 0.11.2 keeps low ≤ statistic ≤ high (low = 0) and gives it weight 0.
    rollout = torch.tensor([[-0.5]])
    old = torch.tensor([[-0.5000003]])
    weights, metrics = rollout_correction(
        old, rollout, torch.ones(1, 1), mode="mask", gating="binary_kl", low=0.0, high=0.01
    )
    assert metrics["mismatch_binary_kl"].item() < 0
    assert weights.item() == pytest.approx(1.0, abs=1e-6)
    assert metrics["correction_mask_fraction"].item() == 0.0


# ------------------------------- OpenRLHF's outcome estimators with the KL in the reward


def test_group_norm_with_kl_in_the_reward_is_openrlhfs_reward_to_go():
    """OpenRLHF 0.11.2 `--algo.advantage.estimator group_norm --algo.kl.init_coef 0.1`, by hand.

    One group r = [2, 0, 1]: mean 1, unbiased std √((1 + 1 + 0)/2) = 1, so the normalised outcome
    is ã = [1, −1, 0] (ε = 1e-9 aside), within the clip of 10. Masks [1, 1, 1], [1, 1, 0],
    [1, 0, 0]; KL [[0.5, 1, 2], [1, 3, ·], [4, ·, ·]], β = 0.1. Token rewards −β·KL + ã on the
    last action token: [−0.05, −0.1, −0.2 + 1], [−0.1, −0.3 − 1], [−0.4 + 0]. Reward-to-go
    (γ = 1, no whitening): [0.65, 0.7, 0.8], [−1.4, −1.3, 0], [−0.4, 0, 0].
    """
    rewards = torch.tensor([2.0, 0.0, 1.0])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0]])
    kl = torch.tensor([[0.5, 1.0, 2.0], [1.0, 3.0, 9.0], [4.0, 9.0, 9.0]])
    advantages, returns = compute_advantages(
        "group_reward_to_go",
        token_rewards=token_level_rewards(rewards, mask, kl=kl, kl_coef=0.1),
        rewards=rewards,
        group_ids=torch.zeros(3, dtype=torch.long),
        action_mask=mask,
        preset="group_norm",
    )
    expected = torch.tensor([[0.65, 0.7, 0.8], [-1.4, -1.3, 0.0], [-0.4, 0.0, 0.0]])
    torch.testing.assert_close(advantages, expected)
    torch.testing.assert_close(returns, expected)


@pytest.mark.parametrize(
    ("preset", "expected"),
    [
        # r = [3, 0, 0]: mean 1, unbiased std √3 → (r − 1)/√3
        ("group_norm", [2 / math.sqrt(3), -1 / math.sqrt(3), -1 / math.sqrt(3)]),
        # r − 1
        ("dr_grpo", [2.0, -1.0, -1.0]),
        # r − mean of the others: 3 − 0, 0 − 1.5, 0 − 1.5
        ("rloo", [3.0, -1.5, -1.5]),
        # no group: r − batch mean 1
        ("flash_reinforce", [2.0, -1.0, -1.0]),
    ],
)
def test_reward_to_go_presets_without_kl_give_the_outcome_on_every_action_token(preset, expected):
    rewards = torch.tensor([3.0, 0.0, 0.0])
    mask = torch.tensor([[1, 1], [1, 0], [1, 1]])
    advantages, _ = compute_advantages(
        "group_reward_to_go",
        token_rewards=token_level_rewards(rewards, mask),
        rewards=rewards,
        group_ids=torch.zeros(3, dtype=torch.long),
        action_mask=mask,
        preset=preset,
    )
    scalar = torch.tensor(expected)
    torch.testing.assert_close(advantages, scalar[:, None] * mask, atol=1e-6, rtol=0)


def test_reward_to_go_clips_after_centring_like_openrlhf():
    # dr_grpo, r = [30, 0, 0]: clip(r − 10, ±10) = [10, −10, −10]. Clipping first (rl_algos' dr_grpo
    # on clip(r) = [10, 0, 0]) would give [6.67, −3.33, −3.33].
    rewards = torch.tensor([30.0, 0.0, 0.0])
    mask = torch.ones(3, 1)
    advantages, _ = compute_advantages(
        "group_reward_to_go",
        token_rewards=token_level_rewards(rewards, mask),
        rewards=rewards,
        group_ids=torch.zeros(3, dtype=torch.long),
        action_mask=mask,
        preset="dr_grpo",
    )
    torch.testing.assert_close(advantages.flatten(), torch.tensor([10.0, -10.0, -10.0]))


def test_group_norm_reward_to_go_without_kl_equals_grpo_with_openrlhfs_preset():
    generator = torch.Generator().manual_seed(0)
    rewards = torch.rand(8, generator=generator)
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    mask = (torch.rand(8, 5, generator=generator) < 0.7).long()
    mask[:, 0] = 1
    ours, _ = compute_advantages(
        "group_reward_to_go",
        token_rewards=token_level_rewards(rewards, mask),
        rewards=rewards,
        group_ids=groups,
        action_mask=mask,
    )
    grpo, _ = compute_advantages(
        "grpo", rewards=rewards, group_ids=groups, action_mask=mask, preset="openrlhf"
    )
    torch.testing.assert_close(ours, grpo)


def test_flash_reinforce_is_the_batch_mean_baseline_with_the_kl_and_no_whitening():
    """OpenRLHF 0.11.2 `flash_reinforce`, by hand: r = [1, 0, 0, 0], batch mean 0.25, so ã =
    [0.75, −0.25, −0.25, −0.25] (OpenRLHF's own test). Two action tokens each, KL rows [1, 1],
    [0, 0], [0, 0], [0, 2], β = 0.5: token rewards [−0.5, −0.5 + 0.75], [0, −0.25], [0, −0.25],
    [0, −1 − 0.25]; reward-to-go [−0.25, 0.25], [−0.25, −0.25], [−0.25, −0.25], [−1.25, −1.25].
    """
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])
    mask = torch.ones(4, 2)
    kl = torch.tensor([[1.0, 1.0], [0.0, 0.0], [0.0, 0.0], [0.0, 2.0]])
    inputs = {"rewards": rewards, "action_mask": mask, "group_ids": torch.arange(4)}
    plain, _ = compute_advantages(
        "flash_reinforce", token_rewards=token_level_rewards(rewards, mask), **inputs
    )
    torch.testing.assert_close(plain[:, 0], torch.tensor([0.75, -0.25, -0.25, -0.25]))
    advantages, returns = compute_advantages(
        "flash_reinforce", token_rewards=token_level_rewards(rewards, mask, kl=kl, kl_coef=0.5), **inputs
    )
    expected = torch.tensor([[-0.25, 0.25], [-0.25, -0.25], [-0.25, -0.25], [-1.25, -1.25]])
    torch.testing.assert_close(advantages, expected)
    torch.testing.assert_close(returns, expected)


def test_reward_to_go_refuses_an_unknown_preset_naming_the_known_ones():
    rewards = torch.tensor([1.0, 0.0])
    mask = torch.ones(2, 1)
    with pytest.raises(
        ValueError, match=r"preset must be one of \['dr_grpo', 'flash_reinforce', 'group_norm', 'rloo'\]"
    ):
        compute_advantages(
            "group_reward_to_go",
            token_rewards=token_level_rewards(rewards, mask),
            rewards=rewards,
            group_ids=torch.zeros(2, dtype=torch.long),
            action_mask=mask,
            preset="reinforce_baseline",
        )
