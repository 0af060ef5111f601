"""`--train.backend fsdp2` (`rl_launch.backends`): what reaches the learners, and what is refused
before anything starts, naming the option. (Runs: test_ppo_variants.py's GRPO run,
test_trainers.py's dpo run.)"""

from __future__ import annotations

import types

import pytest
import torch

from rl_launch.config import ConfigError, PPOConfig
from rl_launch.learner_settings import model_load_options
from rl_launch.trainers import resolve_config
from tests.launch.configs import ppo_config

BASE = {
    "preset": "arithmetic",
    "algo.advantage.estimator": "grpo",
    "algo.kl.init_kl_coef": "0.01",
    "algo.kl.use_kl_loss": "true",
    "train.backend": "fsdp2",
}


def config(**overrides) -> PPOConfig:
    return ppo_config(BASE, **overrides)


def test_fsdp2_reaches_every_learner_with_fp32_master_weights_for_the_trained_ones():
    from rl_launch.specs import learner_specs

    inputs = types.SimpleNamespace(model_path="m", critic_path="m", reward_model_path="rm", teacher_path="t")
    gae = config(**{"algo.advantage.estimator": "gae", "model.reward_pretrain": "rm"})
    specs = learner_specs(gae, inputs, dtype="bf16", use_gpus=False, total_steps=4)
    roles = ("policy", "ref", "critic", "reward_model")
    assert {specs[role].deepspeed.backend for role in roles} == {"fsdp2"}
    for role, dtype in zip(
        roles, (torch.float32, torch.bfloat16, torch.float32, torch.bfloat16), strict=True
    ):
        options = model_load_options(specs[role].deepspeed, specs[role].optimizer, world_size=2)
        assert (options["dtype"], options["zero3_config"]) == (dtype, None), (
            role
        )  # bf16 runs through the policy


@pytest.mark.parametrize(
    ("overrides", "option"),
    [
        (
            {"algo.advantage.estimator": "gae", "train.critic_optimizer": "muon"},
            "train.critic_optimizer: 'muon'",
        ),
        ({"train.deepspeed_config.zero_optimization.overlap_comm": True}, "train.deepspeed_config: {"),
        ({"model.lora_rank": 4}, "model.lora_rank: 4 LoRA"),
        ({"model.dtype": "fp16"}, "model.dtype: 'fp16'"),
        ({"train.actor_optimizer": "muon"}, "train.actor_optimizer: 'muon'"),
        ({"train.ema_beta": 0.99}, "train.ema_beta: 0.99"),
        ({"ray.colocate": "all"}, "ray.learner_offload: True with ray.colocate all"),
    ],
)
def test_what_fsdp2_does_not_do_yet_is_refused_naming_the_option(overrides, option):
    with pytest.raises(ConfigError, match=r"\(train.backend fsdp2; use train.backend deepspeed\)") as error:
        config(**overrides)
    assert str(error.value).startswith(option)


def test_fsdp2_with_the_hybrid_engine_is_taken_without_learner_offload_and_deepspeed_refuses_nothing():
    assert config(**{"ray.colocate": "all", "ray.learner_offload": False}).train.backend == "fsdp2"
    assert config(**{"train.backend": "deepspeed", "model.lora_rank": 4}).model.lora_rank == 4


@pytest.mark.parametrize("use_gpus", [False, True])
def test_fsdp2_offload_reaches_the_trained_models_and_on_gpus_the_frozen_ones_at_any_zero_stage(use_gpus):
    from rl_launch.learner_settings import frozen_offload
    from rl_launch.specs import learner_specs

    offloads = {"train.adam_offload": True, "ray.ref.offload": True, "ray.reward_model.offload": True}
    asked = config(**{**offloads, "algo.advantage.estimator": "gae", "model.reward_pretrain": "rm"})
    inputs = types.SimpleNamespace(model_path="m", critic_path="m", reward_model_path="rm", teacher_path="t")
    specs = learner_specs(asked, inputs, dtype="bf16", use_gpus=use_gpus, total_steps=4)
    trained = [
        (specs[role].deepspeed.offload_optimizer, specs[role].deepspeed.offload_params)
        for role in ("policy", "critic")
    ]
    frozen = [
        (specs[role].deepspeed.offload_optimizer, specs[role].deepspeed.offload_params)
        for role in ("ref", "reward_model")
    ]
    assert trained == [(True, False)] * 2  # Fsdp2Engine: CPUOffloadPolicy
    assert frozen == [(False, use_gpus)] * 2  # at train.zero_stage 2, where DeepSpeed would not offload
    assert frozen_offload(True, zero_stage=2, use_gpus=True, backend="deepspeed")[0] is False


@pytest.mark.parametrize("command", ["sft", "rm", "dpo", "kto"])
def test_the_supervised_commands_take_fsdp2_and_refuse_what_it_does_not_do_yet(command):
    taken = resolve_config(command, None, {"train.backend": "fsdp2", "train.adam_offload": "true"})
    assert (taken.train.backend, taken.train.adam_offload) == ("fsdp2", True)
    for overrides, option in [
        ({"model.lora_rank": "8"}, "model.lora_rank: 8 LoRA"),
        (
            {"model.sequence_parallel_size": "2", "ray.learner.num_actors": "2"},
            "model.sequence_parallel_size: 2",
        ),
        ({"model.dtype": "fp16"}, "model.dtype: 'fp16'"),
    ]:
        with pytest.raises(
            ConfigError, match=r"\(train.backend fsdp2; use train.backend deepspeed\)"
        ) as error:
            resolve_config(command, None, {"train.backend": "fsdp2", **overrides})
        assert str(error.value).startswith(option)


def test_a_supervised_fsdp2_reference_loads_in_the_run_dtype_and_the_trained_model_in_fp32():
    from rl_launch.trainers.loop import learner_options, model_options

    dpo = resolve_config("dpo", None, {"train.backend": "fsdp2", "model.dtype": "bf16"})
    settings = learner_options(dpo)
    assert model_options(dpo, settings.deepspeed)["dtype"] == torch.float32
    assert model_options(dpo, settings.inference, trained=False)["dtype"] == torch.bfloat16
