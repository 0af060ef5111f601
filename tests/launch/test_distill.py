"""On-policy distillation in `rl-launch ppo` without Ray: the teacher's options and refusals, its
place among the roles, the tokenizer check, and what its log-probs do to the rewards and the loss."""

from __future__ import annotations

import pytest
import torch

from rl_data import Trajectory, build_experience
from rl_launch.algorithm import score_batch
from rl_launch.cluster import plan_roles
from rl_launch.components import describe_components
from rl_launch.components.objective import old_logprobs_from_training, policy_loss_config
from rl_launch.config import ConfigError
from rl_launch.preflight import PreflightError, check_teacher_tokenizer
from tests.launch.configs import ppo_config

BASE = {
    "model.pretrain": "/models/never-loaded",
    "model.teacher_pretrain": "/models/teacher",
    "data.prompt_data": "/data/never-read.jsonl",
    "algo.advantage.estimator": "reinforce",
    "rollout.rollout_batch_size": "2",
    "rollout.n_samples_per_prompt": "2",
}


def config(**overrides: str):
    return ppo_config(BASE, **overrides)


def test_distill_options_without_a_teacher_are_refused():
    with pytest.raises(ConfigError, match=r"^algo\.distill: .* needs model\.teacher_pretrain"):
        config(model__teacher_pretrain=None, algo__distill__coef="0.5")


def test_the_teacher_reward_with_an_outcome_only_estimator_is_refused_naming_the_ways_out():
    with pytest.raises(ConfigError, match=r"^algo\.distill\.mode: 'reward' .* 'grpo' .* group_reward_to_go"):
        config(algo__advantage__estimator="grpo")
    # the loss side reaches every estimator, and group_reward_to_go is grpo with token rewards
    config(algo__advantage__estimator="grpo", algo__distill__mode="loss")
    config(algo__advantage__estimator="group_reward_to_go", algo__advantage__options__preset="group_norm")


def test_k1_as_the_teacher_loss_is_refused():
    with pytest.raises(
        ConfigError, match=r"^algo\.distill\.estimator: 'k1' as a loss term has zero expected"
    ):
        config(algo__distill__mode="loss", algo__distill__estimator="k1")


def test_the_teacher_term_reaches_the_policy_loss_in_mode_loss_only():
    loss = policy_loss_config(config(algo__distill__mode="loss", algo__distill__coef="0.3"), kl_coef=0.0)
    assert (loss.distill_coef, loss.distill_estimator) == (0.3, "k2")
    assert policy_loss_config(config(), kl_coef=0.0).distill_coef == 0.0


def test_a_teacher_needs_the_old_logprob_forward_and_is_described():
    cfg = config()
    assert not old_logprobs_from_training(cfg)
    assert old_logprobs_from_training(config(model__teacher_pretrain=None))
    assert "distillation to /models/teacher: reward −β_d·(log π − log π_T) (β_d = 1)" in describe_components(
        cfg
    )


@pytest.mark.parametrize(
    ("colocate", "groups"),
    [
        ("none", {"policy": "policy", "teacher": "teacher", "ref": "ref"}),
        (
            "policy_ref",
            {"policy": "policy+ref+teacher", "teacher": "policy+ref+teacher", "ref": "policy+ref+teacher"},
        ),
    ],
)
def test_the_teacher_is_a_role_of_its_own_placed_where_the_reference_goes(colocate, groups):
    cfg = config(algo__kl__init_kl_coef="0.01", ray__colocate=colocate, ray__teacher__num_gpus_per_actor="1")
    layouts = {layout.role: layout for layout in plan_roles(cfg, use_gpus=True)}
    assert {role: layouts[role].group for role in groups} == groups
    share = 1 / 3 if colocate == "policy_ref" else 1.0
    assert layouts["teacher"].num_gpus == pytest.approx(share)
    assert "teacher" not in {
        layout.role for layout in plan_roles(config(model__teacher_pretrain=None), use_gpus=True)
    }


def _batch(outcomes: list[float]):
    records = [
        Trajectory(
            prompt_ids=torch.tensor([1, 2]), response_ids=torch.tensor([3, 4, 5]), reward=r, group_id=i
        )
        for i, r in enumerate(outcomes)
    ]
    batch = build_experience(records)
    batch.old_logprobs = batch.from_response_view(torch.full((len(outcomes), 3), -1.0))
    batch.teacher_logprobs = batch.from_response_view(torch.tensor([[-1.5, -1.5, -1.5], [-1.0, -0.5, -1.0]]))
    return batch


@pytest.mark.parametrize("outcome", ["true", "false"])
def test_the_teacher_reward_joins_the_token_rewards_with_or_without_the_outcome(outcome):
    # d = old − teacher = [[0.5, 0.5, 0.5], [0, −0.5, 0]]; β_d = 0.2: r = [[−0.1] * 3, [0, 0.1, 0]];
    # reinforce (γ = 1, no whitening) returns the reward-to-go, plus the outcome when kept.
    cfg = config(
        algo__distill__coef="0.2", algo__distill__outcome=outcome, algo__advantage__options__whiten="false"
    )
    batch = _batch([1.0, 0.0])
    metrics = score_batch(cfg, batch, batch.rewards.clone(), kl_coef=0.0)
    expected = torch.tensor([[-0.3, -0.2, -0.1], [0.1, 0.1, 0.0]])
    if outcome == "true":
        expected[0] += 1.0
    torch.testing.assert_close(batch.response_view(batch.advantages), expected)
    assert metrics["distill/kl_to_teacher"] == pytest.approx(1.0 / 6)
    assert metrics["distill/reward_mean"] == pytest.approx((-0.3 + 0.1) / 2)


def test_in_mode_loss_the_rewards_are_untouched_and_the_kl_is_still_measured():
    cfg = config(algo__distill__mode="loss", algo__advantage__options__whiten="false")
    batch = _batch([1.0, 0.0])
    metrics = score_batch(cfg, batch, batch.rewards.clone(), kl_coef=0.0)
    torch.testing.assert_close(batch.response_view(batch.advantages), torch.tensor([[1.0] * 3, [0.0] * 3]))
    assert metrics["distill/kl_to_teacher"] == pytest.approx(1.0 / 6)
    assert "distill/reward_mean" not in metrics


def test_a_teacher_with_another_tokenizer_is_refused_naming_both_paths(tmp_path):
    from rl_data.tiny import build_tiny_tokenizer

    paths = {}
    for name, size in (("policy", 1024), ("same", 1024), ("other", 300)):
        paths[name] = str(tmp_path / name)
        build_tiny_tokenizer(vocab_size=size).save_pretrained(paths[name])
    check_teacher_tokenizer(paths["policy"], paths["same"])
    with pytest.raises(PreflightError) as refusal:
        check_teacher_tokenizer(paths["policy"], paths["other"])
    message = str(refusal.value)
    assert message.startswith("model.teacher_pretrain: the teacher ")
    assert paths["other"] in message
    assert paths["policy"] in message
    assert "485 vs 302 tokens" in message


# ---------------------------------------------------------------------------- the step loop, on toy actors


@pytest.mark.parametrize("mode", ["reward", "loss"])
def test_the_loop_scores_with_the_teacher_and_logs_the_kl_every_step(monkeypatch, mode):
    from rl_launch.config import PPOConfig
    from rl_launch.options import load_config
    from tests.launch.fakes import fake_run, use_fake_ray

    use_fake_ray(monkeypatch)
    settings = {
        "preset": "arithmetic",  # validation only: nothing is prepared
        "model.teacher_pretrain": "/models/teacher",
        "algo.distill.mode": mode,
        "algo.distill.coef": "0.5",
        "algo.advantage.estimator": "reinforce",
        "rollout.rollout_batch_size": "2",
        "rollout.n_samples_per_prompt": "2",
        "rollout.generate_max_len": "8",
        "rollout.weight_sync": "broadcast",
        "train.max_steps": "2",
        "train.micro_batch_tokens": "64",
        "log.progress_bar": "false",
    }
    run = fake_run(load_config(PPOConfig, overrides=settings))
    run.fit()
    methods = run.log.methods()
    assert methods[:3] == ["engine.generate", "policy.logprobs", "teacher.logprobs"]  # the old forward too
    logged = [metrics for _, metrics in run.tracker.logged]
    assert [metrics["distill/kl_to_teacher"] for metrics in logged] == [0.5, 0.5]  # −1 − (−1.5)
    for trained in run.learners["policy"][0].trained:
        assert all(teacher is not None for teacher in trained["teacher_logprobs"])
        assert trained["loss"].distill_coef == (0.5 if mode == "loss" else 0.0)
    if mode == "reward":  # 3 tokens a response, −0.5 × 0.5 each
        assert [metrics["distill/reward_mean"] for metrics in logged] == [-0.75, -0.75]
