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


def test_fsdp2_takes_lora_and_hands_it_to_the_learners():
    from rl_launch.specs import learner_specs

    lora = config(**{"model.lora_rank": 4, "model.lora_sync": "adapter"})
    inputs = types.SimpleNamespace(model_path="m", critic_path="m", reward_model_path="rm", teacher_path="t")
    policy = learner_specs(lora, inputs, dtype="fp32", use_gpus=False, total_steps=4)["policy"]
    assert (policy.deepspeed.backend, policy.lora.rank) == ("fsdp2", 4)


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
def test_the_supervised_commands_take_fsdp2_lora_and_sp_and_refuse_what_it_does_not_do_yet(command):
    taken = resolve_config(command, None, {"train.backend": "fsdp2", "train.adam_offload": "true"})
    assert (taken.train.backend, taken.train.adam_offload) == ("fsdp2", True)
    lora = resolve_config(command, None, {"train.backend": "fsdp2", "model.lora_rank": "8"})
    assert (lora.train.backend, lora.model.lora_rank) == ("fsdp2", 8)
    sp = {"train.backend": "fsdp2", "model.sequence_parallel_size": "2", "ray.learner.num_actors": "2"}
    assert resolve_config(command, None, sp).model.sequence_parallel_size == 2
    with pytest.raises(
        ConfigError, match=r"^model.sequence_parallel_size: 2 .*with train.tensor_parallel_size 2"
    ):
        resolve_config(command, None, {**sp, "train.tensor_parallel_size": "2"})
    for overrides, option in [
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


TP = {"train.tensor_parallel_size": 2, "ray.policy.num_actors": 2, "ray.ref.num_actors": 2}


def test_tensor_parallelism_reaches_every_learner_and_its_groups_share_micro_batches():
    from rl_launch.specs import learner_specs
    from rl_launch.trainers.learners import plan_items

    inputs = types.SimpleNamespace(model_path="m", critic_path="m", reward_model_path="rm", teacher_path="t")
    specs = learner_specs(config(**TP), inputs, dtype="fp32", use_gpus=False, total_steps=4)
    assert {specs[role].deepspeed.tensor_parallel_size for role in ("policy", "ref")} == {2}
    plan = plan_items(
        list("abcd"), [5, 5, 5, 5], ranks=4, sequence_parallel=1, max_tokens=5, tensor_parallel=2
    )
    assert plan[0] == plan[1] != plan[2] == plan[3]  # ranks 0, 1 and 2, 3: two TP groups
    assert sorted(item for micro in plan[0] + plan[2] for item in micro) == list("abcd")


@pytest.mark.parametrize(
    ("overrides", "refusal"),
    [
        ({"train.backend": "deepspeed"}, r"train.tensor_parallel_size: 2 needs train.backend fsdp2 .*AutoTP"),
        (
            {"ray.ref.num_actors": 1},
            r"ray.ref.num_actors: 1 must be a multiple of train.tensor_parallel_size 2",
        ),
        ({"train.adam_offload": True}, r"train.adam_offload: True with train.tensor_parallel_size 2"),
        (
            {"model.lora_rank": 4},
            r"model.lora_rank: 4 with train.tensor_parallel_size 2: torch's DTensor .* nn.Linear .* "
            r"peft .* \(train.tensor_parallel_size 1\) or tensor parallelism without LoRA",
        ),
        (
            {"model.sequence_parallel_size": 2},
            r"model.sequence_parallel_size: 2 with train.tensor_parallel_size 2: sequence and tensor "
            r"parallelism together \(a 3-D mesh\) are not built",
        ),
        ({"train.tensor_parallel_size": 4, "ray.policy.num_actors": 4, "ray.ref.num_actors": 4}, None),
    ],
)
def test_tensor_parallelism_is_refused_at_validation_naming_the_option(overrides, refusal, tmp_path):
    import json

    folder = tmp_path / "model"  # a Qwen2 checkpoint's config: 4 query heads, 2 key-value heads
    folder.mkdir()
    heads = {"num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 512}
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2", **heads}))
    if refusal is None:
        refusal = r"model.pretrain: .* cannot be split by .* 4: num_key_value_heads 2 is not divisible by"
    with pytest.raises(ConfigError, match=refusal):
        config(**{**TP, "model.pretrain": str(folder), "data.prompt_data": "p.jsonl", **overrides})
    assert (
        config(**{**TP, "model.pretrain": str(folder), "data.prompt_data": "p.jsonl"}).train.backend
        == "fsdp2"
    )


def test_openrlhfs_ds_tensor_parallel_size_is_taken_as_fsdp2_tensor_parallelism_with_a_note():
    from rl_launch.aliases import expand_aliases

    argv, notes = expand_aliases(["--train.backend", "fsdp2", "--ds.tensor_parallel_size", "2"], "ppo")
    assert argv == ["--train.backend", "fsdp2", "--train.tensor_parallel_size", "2"]
    assert "DeepSpeed AutoTP is not wired into these learners" in " ".join(notes)
    _, notes = expand_aliases(["--ds.tensor_parallel_size", "2"], "sft")
    assert "it needs --train.backend fsdp2" in " ".join(notes)
    with pytest.raises(ConfigError, match=r"train.tensor_parallel_size: 2 needs train.backend fsdp2"):
        resolve_config("sft", None, {"train.tensor_parallel_size": "2", "ray.learner.num_actors": "2"})
    taken = resolve_config(
        "dpo",
        None,
        {"train.backend": "fsdp2", "train.tensor_parallel_size": "2", "ray.learner.num_actors": "2"},
    )
    assert taken.train.tensor_parallel_size == 2


@pytest.mark.parametrize("command", ["ppo", "sft"])
def test_the_zero_stage_fsdp2_does_not_use_is_said_at_start_not_dropped_silently(command):
    from rl_launch.cli import resolve_ppo_config
    from rl_launch.trainers.learners import _backend
    from rl_launch.validation import prepare

    said = "train.zero_stage 3: not used by train.backend fsdp2, which shards parameters, gradients"
    if command == "ppo":
        notes: list[str] = []
        prepare(resolve_ppo_config(None, {**BASE, "train.zero_stage": "3"}), say=notes.append)
        assert [note for note in notes if note.startswith(said)], notes
        notes.clear()
        prepare(resolve_ppo_config(None, {**BASE, "train.backend": "deepspeed"}), say=notes.append)
        assert not [note for note in notes if "zero_stage" in note], notes
        return
    taken = resolve_config(command, None, {"train.backend": "fsdp2", "train.zero_stage": "3"})
    assert said in _backend(taken, use_gpus=False)
    assert (
        _backend(resolve_config(command, None, {"train.zero_stage": "3"}), use_gpus=False)
        == "DeepSpeed ZeRO-3"
    )
