"""How `rl-launch ppo`'s config becomes the learner's objective (no Ray): options verbatim,
refused combinations before anything starts, and when the old-log-prob forward is skipped."""

from __future__ import annotations

import pytest

from rl_launch.cli import resolve_ppo_config
from rl_launch.config import ConfigError
from rl_launch.ppo import check_combination, old_logprobs_from_training, policy_loss_config

BASE = {
    "preset": "none",
    "model.pretrain": "/models/never-loaded",
    "data.prompt_data": "/data/never-read.jsonl",
    "algo.advantage.estimator": "grpo",
    "rollout.rollout_batch_size": "8",
    "rollout.n_samples_per_prompt": "4",
}


def config(**overrides: str):
    return resolve_ppo_config(None, {**BASE, **{key.replace("__", "."): v for key, v in overrides.items()}})


def test_openrlhf_correction_settings_reach_the_objective_verbatim():
    cfg = config(
        algo__policy__is_correction="mask",
        algo__policy__is_correction_level="sequence",
        algo__policy__is_correction_gating="tv",
        algo__policy__is_correction_bounds="[0.0, 0.3]",
    )
    loss = policy_loss_config(cfg, kl_coef=0.0)
    assert (loss.correction, loss.correction_level, loss.correction_gating) == ("mask", "sequence", "tv")
    assert loss.correction_bounds == (0.0, 0.3)


def test_a_correction_mode_with_a_gating_it_cannot_use_fails_before_anything_starts():
    cfg = config(algo__policy__is_correction="truncate", algo__policy__is_correction_gating="binary_kl")
    with pytest.raises(ConfigError, match=r"algo\.policy: .*correction"):
        check_combination(cfg)


def test_old_logprobs_come_from_the_training_forward_only_with_one_step_per_batch_and_no_reference():
    assert old_logprobs_from_training(config())
    assert not old_logprobs_from_training(config(train__train_batch_size="16"))  # 2 mini-batches
    assert not old_logprobs_from_training(config(train__max_epochs="2"))
    kl = {"algo__kl__init_kl_coef": "0.01", "algo__kl__use_kl_loss": "true"}
    assert not old_logprobs_from_training(config(**kl))  # the KL needs them before training
    assert policy_loss_config(config(), kl_coef=0.0).old_logprobs_from_forward


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"algo__kl__init_kl_coef": "0.01", "algo__kl__use_kl_loss": "true"},  # kl_estimator k1
            r"algo\.kl\.kl_estimator: 'k1' as a loss term .* use 'k3' or 'low_var_kl'",
        ),
        ({"algo__kl__kl_target": "0.1"}, r"algo\.kl\.kl_target: 0\.1 needs algo\.kl\.init_kl_coef > 0"),
        (
            {"algo__advantage__estimator": "remax", "model__reward_pretrain": "/models/rm"},
            r"'remax' takes the rule / remote reward of a greedy answer as its baseline",
        ),
        ({"algo__policy__eps_clip": "1.0"}, r"algo\.policy\.eps_clip: 1\.0 must be < 1"),
        (
            {"algo__policy__is_correction": "tis", "algo__policy__is_correction_bounds": "[0.0, 5.0]"},
            "correction",
        ),
    ],
)
def test_combinations_that_would_fail_after_start_up_fail_before_it(overrides, message):
    with pytest.raises(ConfigError, match=message):
        check_combination(config(**overrides))


def test_k3_in_the_loss_is_accepted():
    check_combination(
        config(algo__kl__init_kl_coef="0.01", algo__kl__use_kl_loss="true", algo__kl__kl_estimator="k3")
    )


def test_whitening_is_refused_for_an_estimator_without_it():
    with pytest.raises(
        ConfigError, match=r"algo\.advantage\.whiten: True is not an option of estimator 'grpo'"
    ):
        check_combination(config(algo__advantage__whiten="true"))
    check_combination(config(algo__advantage__estimator="reinforce", algo__advantage__whiten="false"))
