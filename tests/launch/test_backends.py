"""`--train.backend fsdp2` (`rl_launch.backends`): what reaches the learners, and what is refused
before anything starts, naming the option. (A run: test_ppo_variants.py's GRPO run.)"""

from __future__ import annotations

import types

import pytest
import torch

from rl_launch.config import ConfigError, PPOConfig
from rl_launch.learner_settings import model_load_options
from rl_launch.options import load_config
from rl_launch.trainers.config import SFTConfig
from rl_launch.validation import prepare

BASE = {
    "preset": "arithmetic",
    "algo.advantage.estimator": "grpo",
    "algo.kl.init_kl_coef": "0.01",
    "algo.kl.use_kl_loss": "true",
    "train.backend": "fsdp2",
}


def config(**overrides) -> PPOConfig:
    """The config `rl-launch ppo` runs: decoded, then its one validation pass."""
    decoded = load_config(PPOConfig, overrides={**BASE, **{k: str(v) for k, v in overrides.items()}})
    return prepare(decoded, say=lambda note: None)


def test_fsdp2_reaches_the_policy_and_reference_learners_with_fp32_master_weights():
    from rl_launch.specs import learner_specs

    inputs = types.SimpleNamespace(model_path="m", critic_path="m", reward_model_path="rm", teacher_path="t")
    specs = learner_specs(config(), inputs, dtype="bf16", use_gpus=False, total_steps=4)
    assert (specs["policy"].deepspeed.backend, specs["ref"].deepspeed.backend) == ("fsdp2", "fsdp2")
    policy = model_load_options(specs["policy"].deepspeed, specs["policy"].optimizer, world_size=2)
    assert (policy["dtype"], policy["zero3_config"]) == (torch.float32, None)  # bf16 runs through the policy
    reference = model_load_options(specs["ref"].deepspeed, None, world_size=2)
    assert reference["dtype"] == torch.bfloat16


@pytest.mark.parametrize(
    ("overrides", "option"),
    [
        ({"algo.advantage.estimator": "gae"}, "algo.advantage.estimator: 'gae' needs a critic"),
        ({"model.lora_rank": 4}, "model.lora_rank: 4 LoRA"),
        ({"model.dtype": "fp16"}, "model.dtype: 'fp16'"),
        ({"train.adam_offload": True}, "train.adam_offload: True"),
        ({"ray.ref.offload": True}, "ray.ref.offload: True"),
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


def test_the_supervised_commands_refuse_fsdp2():
    with pytest.raises(ConfigError, match=r"train.backend: 'fsdp2' applies to rl-launch ppo only yet"):
        load_config(SFTConfig, overrides={"preset": "arithmetic", "train.backend": "fsdp2"})
