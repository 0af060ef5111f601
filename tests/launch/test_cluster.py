"""Role layout and colocation (`rl_launch.cluster.plan_roles`): which actors a run starts and where."""

from __future__ import annotations

import msgspec
import pytest

from rl_launch.cluster import _bundles, plan_roles
from rl_launch.config import ConfigError, PPOConfig


def _config(**sections) -> PPOConfig:
    return msgspec.convert(
        {"preset": "none", "model": {"pretrain": "m"}, "data": {"prompt_data": "d"}, **sections}, PPOConfig
    )


def test_grpo_without_kl_starts_only_the_policy_and_the_engines():
    config = _config(algo={"advantage": {"estimator": "grpo"}})
    assert [layout.role for layout in plan_roles(config, use_gpus=True)] == ["policy", "engine"]


def test_ppo_with_kl_and_a_reward_model_starts_every_role():
    config = _config(algo={"kl": {"init_kl_coef": 0.01}}, model={"pretrain": "m", "reward_pretrain": "r"})
    roles = {layout.role for layout in plan_roles(config, use_gpus=True)}
    assert roles == {"policy", "ref", "critic", "reward_model", "engine"}


def test_colocated_roles_share_one_group_and_split_each_bundle_gpu():
    config = _config(
        algo={"kl": {"init_kl_coef": 0.01}},
        ray={"colocate": "policy_ref", "policy": {"num_actors": 4}, "ref": {"num_actors": 4}},
        rollout={"num_engines": 2, "tensor_parallel_size": 2},
    )
    layouts = {layout.role: layout for layout in plan_roles(config, use_gpus=True)}
    assert layouts["policy"].group == layouts["ref"].group == "policy+ref"
    assert layouts["policy"].num_gpus == layouts["ref"].num_gpus == 0.5
    bundles = _bundles(list(layouts.values()))
    assert bundles["policy+ref"] == [{"CPU": 1.0, "GPU": 1.0}] * 4  # two roles on 4 GPUs, not 8
    assert bundles["engine"] == [{"CPU": 1.0, "GPU": 2.0}] * 2
    assert bundles["critic"] == [{"CPU": 1.0, "GPU": 1.0}]


def test_cpu_mode_asks_for_no_gpus():
    config = _config(ray={"colocate": "all"})
    assert all(layout.num_gpus == 0.0 for layout in plan_roles(config, use_gpus=False))


def test_colocated_roles_with_different_actor_counts_are_refused():
    config = _config(
        algo={"kl": {"init_kl_coef": 0.01}}, ray={"colocate": "policy_ref", "policy": {"num_actors": 2}}
    )
    with pytest.raises(ConfigError, match=r"ray.colocate: 'policy_ref' puts policy, ref on the same bundles"):
        plan_roles(config, use_gpus=True)
