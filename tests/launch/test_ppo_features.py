"""OpenRLHF features of `rl-launch ppo` on the in-process fakes: critic warm-up, the best checkpoint,
frozen-model offload; the EMA's options (its math: tests/learner/test_ema.py; a run:
test_data_eval_e2e.py)."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch

from rl_launch.config import ConfigError, PPOConfig
from rl_launch.options import load_config
from rl_launch.trainers.config import SFTConfig
from tests.launch.fakes import fake_run

pytestmark = pytest.mark.usefixtures("fake_ray_one_thread")


def config(**overrides) -> PPOConfig:
    settings = {
        "preset": "arithmetic",
        "rollout.rollout_batch_size": 2,
        "rollout.n_samples_per_prompt": 2,
        "rollout.generate_max_len": 8,
        "rollout.weight_sync": "broadcast",
        "algo.advantage.estimator": "grpo",
        "train.max_steps": 4,
        "train.micro_batch_tokens": 64,
        "log.progress_bar": False,
    }
    return load_config(PPOConfig, overrides={**settings, **{k: str(v) for k, v in overrides.items()}})


# ----------------------------------------------------------------------------------------------
# Critic warm-up


def test_critic_warmup_trains_only_the_critic_and_skips_the_sync_for_the_first_steps():
    run = fake_run(config(**{"algo.advantage.estimator": "gae", "train.critic_warmup_steps": 2}))
    run.fit()
    assert len(run.learners["critic"][0].trained) == 4
    assert len(run.learners["policy"][0].trained) == 2  # steps 3 and 4
    assert run.log.methods("policy").count("policy.sync") == 2
    # the engines keep version 0 through the warm-up, then get the policy's first two updates
    assert [metrics["policy_version"] for _, metrics in run.tracker.logged] == [0.0, 0.0, 1.0, 2.0]
    assert [call["version"] for call in run.engines[0].generated] == [0, 0, 0, 1]
    steps = [sorted(key for key in metrics if key.startswith("policy/")) for _, metrics in run.tracker.logged]
    assert steps[0] == []
    assert steps[2] != []


def test_critic_warmup_zero_changes_nothing():
    plain = fake_run(config(**{"algo.advantage.estimator": "gae"}))
    plain.fit()
    assert len(plain.learners["policy"][0].trained) == 4
    assert plain.log.methods("policy").count("policy.sync") == 4


def test_critic_warmup_needs_a_critic():
    from rl_launch.components import check_components  # the estimator decides: checked after decoding

    with pytest.raises(ConfigError, match=r"train\.critic_warmup_steps: 2 needs a critic"):
        check_components(config(**{"train.critic_warmup_steps": 2}))


# ----------------------------------------------------------------------------------------------
# Best checkpoint

# reward/mean per step with shuffle=False: prompts 2k, 2k+1 at step k+1; alternating samples add 0.5
_PROMPT_REWARDS = [0.0, 0.0, 5.0, 5.0, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0]


def _reward(prompt, sample):
    return _PROMPT_REWARDS[prompt.index] + float(sample % 2)


def _best_run(ckpt_root: str, **overrides):
    settings = {"ckpt.best_metric_key": "reward/mean", **overrides}
    return fake_run(config(**settings), reward=_reward, shuffle=False, ckpt_root=ckpt_root)


def test_the_best_step_is_saved_and_protected_from_rotation_in_every_later_save():
    run = _best_run("/best/checkpoints", **{"ckpt.save_steps": 3})
    run.fit()
    rewards = [metrics["reward/mean"] for _, metrics in run.tracker.logged]
    assert rewards == [0.5, 5.5, 1.5, 2.5]
    saves = run.learners["policy"][0].saves
    # step 1 and 2 are new bests (saved), 3 by save_steps, 4 the last
    assert [save["step"] for save in saves] == [1, 2, 3, 4]
    assert [save["keep_tags"] for save in saves] == [
        ("step_00000001",),
        ("step_00000002",),
        ("step_00000002",),
        ("step_00000002",),
    ]
    state = run.learners["policy"][0].load("/best/checkpoints/policy", "global_step4")
    assert state.extra["best_checkpoint"] == {"metric": "reward/mean", "value": 5.5, "step": 2}
    assert run.trainer.best_path() == Path("/best/checkpoints/policy/step_00000002")
    assert run.tracker.messages == [
        "new best checkpoint: /best/checkpoints/policy/step_00000001 (reward/mean = 0.5 at step 1)",
        "new best checkpoint: /best/checkpoints/policy/step_00000002 (reward/mean = 5.5 at step 2)",
    ]
    assert run.trainer.best_line() == (
        "best checkpoint: /best/checkpoints/policy/step_00000002 (reward/mean = 5.5 at step 2)"
    )


def test_without_a_best_metric_key_nothing_is_saved_beyond_the_cadence():
    run = fake_run(config(), reward=_reward, shuffle=False)
    run.fit()
    assert [(save["step"], save["keep_tags"]) for save in run.learners["policy"][0].saves] == [(4, ())]
    assert run.trainer.best_line() is None


def test_a_metric_that_is_never_logged_says_so_at_the_end():
    run = fake_run(config(**{"ckpt.best_metric_key": "eval/pass@1"}))
    run.fit()
    assert [save["step"] for save in run.learners["policy"][0].saves] == [4]
    assert (
        run.trainer.best_line()
        == "best checkpoint: none, eval/pass@1 was never logged (ckpt.best_metric_key)"
    )


def test_a_resumed_run_keeps_its_best_checkpoint():
    first = _best_run("/r/checkpoints", **{"ckpt.save_steps": 1, "train.max_steps": 3})
    first.fit()
    resumed = fake_run(
        config(**{"ckpt.best_metric_key": "reward/mean", "train.max_steps": 4}),
        reward=_reward,
        shuffle=False,
        ckpt_root="/r/checkpoints",
        resume_from={"policy": Path("/r/checkpoints/policy/global_step3")},
        checkpoints=first.checkpoints,
    )
    start = resumed.trainer.resume()
    assert resumed.trainer.best == {"metric": "reward/mean", "value": 5.5, "step": 2}
    resumed.fit(start)
    (save,) = resumed.learners["policy"][0].saves
    assert (save["step"], save["keep_tags"]) == (4, ("step_00000002",))


def test_best_metric_key_must_name_something():
    with pytest.raises(ConfigError, match=r"ckpt\.best_metric_key"):
        config(**{"ckpt.best_metric_key": " "})


# ----------------------------------------------------------------------------------------------
# Reference / reward model offload


def _specs(device: str, **overrides):
    from rl_launch.roles import Roles
    from rl_launch.specs import learner_specs

    roles = Roles(config(**{"algo.kl.init_kl_coef": 0.01, **overrides}))
    roles.device, roles.dtype = device, "fp32"
    inputs = types.SimpleNamespace(model_path="m", critic_path="m", reward_model_path="rm", teacher_path="t")
    specs = learner_specs(roles.config, inputs, dtype="fp32", use_gpus=device == "cuda", total_steps=4)
    return roles, specs


def test_ref_teacher_and_reward_offload_set_zero3_offload_param_on_gpus():
    from rl_learner import deepspeed_config

    _, specs = _specs(
        "cuda",
        **{
            "train.zero_stage": 3,
            "ray.ref.offload": True,
            "ray.teacher.offload": True,
            "ray.reward_model.offload": True,
        },
    )
    assert specs["teacher"].model_path == "t"
    assert specs["teacher"].optimizer is None
    for role in ("ref", "teacher", "reward_model"):
        assert specs[role].deepspeed.offload_params
        zero = deepspeed_config(specs[role].deepspeed, world_size=1, train=False)["zero_optimization"]
        assert zero["stage"] == 3
        assert zero["offload_param"] == {"device": "cpu", "pin_memory": True}
    assert not specs["policy"].deepspeed.offload_params
    only_ref = _specs("cuda", **{"train.zero_stage": 3, "ray.ref.offload": True})[1]
    assert (only_ref["ref"].deepspeed.offload_params, only_ref["reward_model"].deepspeed.offload_params) == (
        True,
        False,
    )


@pytest.mark.parametrize(
    ("device", "stage", "why"),
    [
        ("cpu", 3, "a no-op on CPU: the parameters already live in host memory"),
        ("cuda", 2, "a no-op with train.zero_stage 2: DeepSpeed offloads parameters under ZeRO-3 only"),
    ],
)
def test_offload_is_accepted_as_a_no_op_on_cpu_and_below_zero3(device, stage, why):
    from rl_launch.learner_settings import frozen_offload
    from rl_learner import deepspeed_config

    roles, specs = _specs(device, **{"train.zero_stage": stage, "ray.ref.offload": True})
    assert not specs["ref"].deepspeed.offload_params
    zero = deepspeed_config(specs["ref"].deepspeed, world_size=1, train=False)["zero_optimization"]
    assert "offload_param" not in zero
    assert frozen_offload(True, zero_stage=stage, use_gpus=device == "cuda") == (False, why)
    roles.groups = {"ref": object()}
    assert roles.describe_offload() == f"ray.ref.offload: {why}"


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_adam_offload_is_deepspeeds_zero_offload_on_gpus_and_a_no_op_said_so_on_cpu(device):
    """On CPU the optimizer states are in host memory already: no offload section, so DeepSpeed
    builds no CPU Adam op (a minute of compiling); the start-up line says so."""
    from rl_learner import build_optimizer, deepspeed_config

    roles, specs = _specs(device, **{"train.zero_stage": 3, "train.adam_offload": True})
    for role in ("policy", "critic"):
        assert specs[role].deepspeed.offload_optimizer is (device == "cuda")
    zero = deepspeed_config(specs["policy"].deepspeed, world_size=1)["zero_optimization"]
    assert ("offload_optimizer" in zero) is (device == "cuda")
    roles.groups = {"policy": object()}
    why = (
        "optimizer states offloaded to CPU memory (ZeRO-Offload, DeepSpeedCPUAdam)"
        if device == "cuda"
        else "a no-op on CPU: the optimizer states already live in host memory (no CPU Adam op to build)"
    )
    assert roles.describe_offload() == f"train.adam_offload: {why}"
    if device == "cpu":
        optimizer = build_optimizer(
            [torch.nn.Parameter(torch.zeros(2))], specs["policy"].optimizer, specs["policy"].deepspeed
        )
        assert type(optimizer) is torch.optim.AdamW


def test_offload_defaults_off_and_is_refused_for_trained_roles():
    roles, specs = _specs("cuda", **{"train.zero_stage": 3})
    assert not specs["ref"].deepspeed.offload_params
    assert roles.describe_offload() is None
    for role in ("policy", "critic"):
        with pytest.raises(ConfigError, match=rf"ray.{role}.offload: True applies to the frozen models only"):
            config(**{f"ray.{role}.offload": True})


# ----------------------------------------------------------------------------------------------
# EMA options


def test_ema_beta_goes_to_the_policy_learner_only():
    _, specs = _specs("cpu", **{"train.ema_beta": 0.99})
    assert specs["policy"].ema_beta == 0.99
    assert specs["ref"].ema_beta is None
    assert specs["critic"].ema_beta is None
    assert _specs("cpu")[1]["policy"].ema_beta is None


@pytest.mark.parametrize("beta", ["0", "1", "1.5"])
def test_ema_beta_must_be_inside_the_unit_interval(beta):
    with pytest.raises(ConfigError, match=r"train\.ema_beta"):
        config(**{"train.ema_beta": beta})


def test_ema_is_refused_with_lora_and_in_the_supervised_trainers():
    with pytest.raises(ConfigError, match=r"train\.ema_beta: 0\.99 needs model\.lora_rank 0"):
        config(**{"train.ema_beta": 0.99, "model.lora_rank": 4})
    for key, value in (("train.ema_beta", "0.99"), ("ckpt.best_metric_key", "eval/pass@1")):
        with pytest.raises(ConfigError, match=f"{key}: .* does not apply to rl-launch sft"):
            load_config(SFTConfig, overrides={"preset": "arithmetic", key: value})


# ----------------------------------------------------------------------------------------------
# Optimizer per trained role (AdamW or DeepSpeed's Muon)


def test_each_trained_role_gets_its_own_optimizer_and_learning_rates():
    from rl_learner import deepspeed_config

    _, specs = _specs(
        "cpu",
        **{
            "algo.advantage.estimator": "gae",
            "train.actor_optimizer": "muon",
            "train.actor_muon_learning_rate": 0.01,
            "train.actor_learning_rate": 2e-6,
            "train.muon_momentum": 0.9,
            "train.max_norm": 0,
        },
    )
    policy, critic = specs["policy"].optimizer, specs["critic"].optimizer
    assert (policy.name, policy.muon_lr, policy.lr, policy.muon_momentum) == ("muon", 0.01, 2e-6, 0.9)
    assert (critic.name, critic.lr) == ("adamw", 9e-6)
    section = deepspeed_config(specs["policy"].deepspeed, policy, world_size=1)
    assert section["gradient_clipping"] == 0  # train.max_norm 0: no clipping
    assert (section["optimizer"]["params"]["muon_lr"], section["optimizer"]["params"]["adam_lr"]) == (
        0.01,
        2e-6,
    )
