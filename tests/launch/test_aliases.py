"""OpenRLHF 0.11's dotted flags as aliases of `rl-launch ppo` options (rl_launch.aliases); no Ray."""

from __future__ import annotations

import os
import re
import typing

import msgspec
import pytest
import yaml

from rl_launch.aliases import ALIASES, COMMANDS, UNSUPPORTED, aliases_of, expand_aliases, refusals_of
from rl_launch.config import PPOConfig
from rl_launch.options import iter_options


def _fields(cls: type) -> dict[str, msgspec.structs.FieldInfo]:
    return {field.name: field for field in msgspec.structs.fields(cls)}


def _has_final_config() -> bool:
    """True once the config has the shape the aliases target (dict options of loss and estimator)."""
    algo = _fields(PPOConfig)["algo"].type
    return "options" in _fields(_fields(algo)["policy"].type)


needs_final_config = pytest.mark.skipif(
    not _has_final_config(), reason="algo.policy.options is not yet a field of the config"
)


# ------------------------------------------------------------------------------ each alias kind


def test_plain_rename_keeps_the_value_and_says_so():
    argv, notes = expand_aliases(["--algo.kl.init_coef", "1e-3", "--rollout.batch_size", "16"])
    assert argv == ["--algo.kl.init_kl_coef", "1e-3", "--rollout.rollout_batch_size", "16"]
    assert notes == [
        "--algo.kl.init_coef 1e-3 → --algo.kl.init_kl_coef 1e-3",
        "--rollout.batch_size 16 → --rollout.rollout_batch_size 16",
    ]


def test_equals_form_is_renamed_like_the_spaced_form():
    argv, notes = expand_aliases(["--actor.adam.lr=5e-7", "--ckpt.max_num=2"])
    assert argv == ["--train.actor_learning_rate", "5e-7", "--ckpt.max_ckpt_num", "2"]
    assert notes == [
        "--actor.adam.lr=5e-7 → --train.actor_learning_rate 5e-7",
        "--ckpt.max_num=2 → --ckpt.max_ckpt_num 2",
    ]


def test_bare_store_true_flags_become_explicit_true():
    argv, _ = expand_aliases(["--algo.kl.use_loss", "--ckpt.load_enable", "--vllm.enforce_eager"])
    assert argv == [
        "--algo.kl.use_kl_loss",
        "true",
        "--ckpt.load_checkpoint",
        "true",
        "--rollout.enforce_eager",
        "true",
    ]


def test_a_store_true_flag_with_a_value_is_refused():
    with pytest.raises(ValueError, match=r"--algo\.kl\.use_loss .*takes no value"):
        expand_aliases(["--algo.kl.use_loss=true"])


def test_two_value_flag_goes_to_two_options():
    argv, notes = expand_aliases(["--actor.eps_clip_low_high", "0.2", "0.28", "--train.max_steps", "5"])
    assert argv == [
        "--algo.policy.options.epsilon_low",
        "0.2",
        "--algo.policy.options.epsilon_high",
        "0.28",
        "--train.max_steps",
        "5",
    ]
    assert notes == [
        "--actor.eps_clip_low_high 0.2 0.28 → "
        "--algo.policy.options.epsilon_low 0.2 --algo.policy.options.epsilon_high 0.28"
    ]


def test_two_value_flag_into_a_tuple_option_is_joined_by_a_comma():
    argv, _ = expand_aliases(["--algo.dynamic_filtering_range", "0", "1"])
    assert argv == ["--rollout.dynamic_filtering_reward_range", "0,1"]


def test_is_correction_threshold_becomes_the_corrections_low_and_high_options():
    argv, _ = expand_aliases(["--algo.advantage.is_correction_threshold", "0.5", "5.0"])
    assert argv == [
        "--algo.policy.correction_options.low",
        "0.5",
        "--algo.policy.correction_options.high",
        "5.0",
    ]


def test_a_multi_value_flag_missing_a_value_is_refused():
    with pytest.raises(ValueError, match=r"--actor\.eps_clip_low_high .*expects 2 values"):
        expand_aliases(["--actor.eps_clip_low_high", "0.2", "--algo.kl.use_loss"])
    with pytest.raises(ValueError, match=r"--algo\.kl\.init_coef .*expects 1 value"):
        expand_aliases(["--algo.kl.init_coef"])


def test_variable_length_flag_takes_values_up_to_the_next_option():
    argv, _ = expand_aliases(["--ds.lora.target_modules", "q_proj", "v_proj", "--ds.lora.rank", "8"])
    assert argv == ["--model.target_modules", "q_proj,v_proj", "--model.lora_rank", "8"]


def test_one_alias_to_two_targets_kl_estimator_sets_both_sides():
    argv, notes = expand_aliases(["--algo.kl.estimator", "k3"])
    assert argv == ["--algo.kl.reward_estimator", "k3", "--algo.kl.loss_estimator", "k3"]
    assert notes == ["--algo.kl.estimator k3 → --algo.kl.reward_estimator k3 --algo.kl.loss_estimator k3"]


def test_eps_clip_sets_both_epsilons_unless_eps_clip_low_high_is_given():
    argv, _ = expand_aliases(["--actor.eps_clip", "0.1"])
    assert argv == ["--algo.policy.options.epsilon_low", "0.1", "--algo.policy.options.epsilon_high", "0.1"]
    # OpenRLHF takes eps_clip_low_high over eps_clip whatever their order.
    argv, notes = expand_aliases(["--actor.eps_clip_low_high", "0.2", "0.28", "--actor.eps_clip", "0.1"])
    assert argv == ["--algo.policy.options.epsilon_low", "0.2", "--algo.policy.options.epsilon_high", "0.28"]
    assert notes[1].startswith("--actor.eps_clip 0.1 → dropped: ")


def test_policy_loss_type_gspo_is_openrlhfs_sequence_ratio_form():
    assert expand_aliases(["--actor.policy_loss_type", "gspo"])[0] == ["--algo.policy.loss", "gspo_sequence"]
    assert expand_aliases(["--actor.policy_loss_type", "ppo"])[0] == ["--algo.policy.loss", "ppo"]
    with pytest.raises(ValueError, match="OpenRLHF's choices are ppo, gspo"):
        expand_aliases(["--actor.policy_loss_type", "cispo"])


def test_negative_values_are_attached_so_argparse_reads_them_as_values():
    argv, notes = expand_aliases(["--eval.steps", "-1"])
    assert argv == ["--eval.eval_steps=-1"]
    assert notes == ["--eval.steps -1 → --eval.eval_steps=-1"]


def test_reward_clip_range_must_be_symmetric():
    assert expand_aliases(["--reward.clip_range", "-10", "10"])[0] == ["--reward.clip", "10"]
    with pytest.raises(ValueError, match=r"--reward\.clip_range .*\[-c, c\]"):
        expand_aliases(["--reward.clip_range", "0", "1"])


def test_colocation_flags_combine_into_one_option_written_once():
    argv, notes = expand_aliases(
        ["--train.colocate_actor_ref", "--x.y", "1", "--train.colocate_critic_reward"]
    )
    assert argv == ["--ray.colocate", "policy_ref+critic_reward", "--x.y", "1"]
    assert notes == [
        "--train.colocate_actor_ref → --ray.colocate policy_ref+critic_reward",
        "--train.colocate_critic_reward → (with --ray.colocate policy_ref+critic_reward above)",
    ]
    argv, _ = expand_aliases(["--train.colocate_actor_ref", "--train.colocate_all"])
    assert argv == ["--ray.colocate", "all"]


def test_nodes_times_gpus_per_node_is_the_number_of_actors():
    argv, _ = expand_aliases(
        [
            *("--actor.num_nodes", "2", "--actor.num_gpus_per_node", "4"),
            *("--reward.num_gpus_per_node", "1", "--reward.num_nodes", "1"),
        ]
    )
    assert argv == ["--ray.policy.num_actors", "8", "--ray.reward_model.num_actors", "1"]


def test_a_lone_num_gpus_per_node_or_num_nodes_takes_openrlhfs_default_for_the_other():
    argv, notes = expand_aliases(["--actor.num_gpus_per_node", "2", "--ref.num_nodes", "2"])
    assert argv == ["--ray.policy.num_actors", "2", "--ray.ref.num_actors", "16"]
    assert notes == [
        "--actor.num_gpus_per_node 2 → --ray.policy.num_actors 2: --actor.num_nodes not given: "
        "OpenRLHF's default 1",
        "--ref.num_nodes 2 → --ray.ref.num_actors 16: --ref.num_gpus_per_node not given: OpenRLHF's default 8",
    ]
    argv, _ = expand_aliases(["--actor.num_gpus_per_node", "2"], "sft")
    assert argv == ["--ray.learner.num_actors", "2"]


def test_is_correction_switch_and_type_become_one_mode():
    argv, _ = expand_aliases(["--algo.advantage.is_correction_enable"])
    assert argv == ["--algo.policy.correction", "tis"]  # OpenRLHF's type when only the switch is given
    argv, notes = expand_aliases(
        ["--algo.advantage.is_correction_enable", "--algo.advantage.is_correction_type", "icepop"]
    )
    assert argv == ["--algo.policy.correction", "icepop"]
    assert len(notes) == 2
    with pytest.raises(ValueError, match=r"turns nothing on without --algo\.advantage\.is_correction_enable"):
        expand_aliases(["--algo.advantage.is_correction_type", "icepop"])


def test_gamma_and_lambd_follow_the_estimator_openrlhf_would_run():
    argv, _ = expand_aliases(["--algo.advantage.gamma", "0.99", "--algo.advantage.lambd", "0.95"])
    assert argv == ["--algo.advantage.options.gamma", "0.99", "--algo.advantage.options.lam", "0.95"]
    # OpenRLHF runs group_norm with gamma 1.0 and uses lambd for gae alone: both are dropped, said so.
    argv, notes = expand_aliases(
        [
            "--algo.advantage.estimator",
            "group_norm",
            "--algo.advantage.gamma",
            "1.0",
            "--algo.advantage.lambd",
            "1",
        ]
    )
    assert argv == ["--algo.advantage.estimator", "group_norm"]
    assert notes[0].startswith("--algo.advantage.gamma 1.0 → dropped: OpenRLHF ignores it for group_norm")
    assert notes[1].startswith("--algo.advantage.lambd 1 → dropped:")
    argv, _ = expand_aliases(["--algo.advantage.estimator=reinforce", "--algo.advantage.gamma", "0.9"])
    assert argv == ["--algo.advantage.estimator=reinforce", "--algo.advantage.options.gamma", "0.9"]


@pytest.mark.parametrize("estimator", ["group_norm", "rloo", "dr_grpo"])
def test_a_group_estimator_keeps_its_name_here_and_the_kl_coefficient_is_renamed(estimator):
    # One place translates a group estimator with the KL in the reward, whichever spelling set the
    # coefficient: rl_launch.validation.kl_in_reward_form (tests/launch/test_config_validation.py).
    argv, notes = expand_aliases(["--algo.advantage.estimator", estimator, "--algo.kl.init_coef", "0.01"])
    assert argv == ["--algo.advantage.estimator", estimator, "--algo.kl.init_kl_coef", "0.01"]
    assert notes == ["--algo.kl.init_coef 0.01 → --algo.kl.init_kl_coef 0.01"]
    argv, _ = expand_aliases(["--algo.advantage.estimator", "flash_reinforce", "--algo.kl.init_coef", "0.01"])
    assert argv[:2] == ["--algo.advantage.estimator", "flash_reinforce"]  # takes the KL under its name


@needs_final_config
def test_openrlhf_group_norm_with_the_kl_in_the_reward_is_prepared_into_its_reward_to_go_form():
    from rl_launch.cli import resolve_ppo_config
    from rl_launch.validation import prepare

    argv, _ = expand_aliases(["--algo.advantage.estimator", "group_norm", "--algo.kl.init_coef", "0.01"])
    overrides = dict(zip((name.removeprefix("--") for name in argv[::2]), argv[1::2], strict=True))
    cfg = resolve_ppo_config(
        None, {"model.pretrain": "/models/never-loaded", "data.prompt_data": "/data/x.jsonl", **overrides}
    )
    notes: list[str] = []
    cfg = prepare(cfg, say=notes.append)
    assert cfg.algo.advantage.estimator == "group_reward_to_go"
    assert cfg.algo.advantage.options == {"preset": "group_norm"}
    assert len(notes) == 1


def test_unbiased_gradient_carries_openrlhfs_weight_cap_of_ten():
    argv, _ = expand_aliases(["--algo.kl.use_loss", "--algo.kl.unbiased_gradient"])
    assert argv == [
        *("--algo.kl.use_kl_loss", "true"),
        *("--algo.kl.loss_options.unbiased_gradient", "true"),
        *("--algo.kl.loss_options.importance_weight_cap", "10"),
    ]
    argv, notes = expand_aliases(["--algo.kl.unbiased_gradient"])
    assert argv == []
    assert notes[0].startswith(
        "--algo.kl.unbiased_gradient → dropped: OpenRLHF uses it only for the KL in the loss"
    )


def test_flags_meaning_what_rl_launch_always_does_are_dropped_and_others_refused():
    argv, notes = expand_aliases(["--ds.packing_samples", "--actor.adam.eps", "1e-8"])
    assert argv == []
    assert [note.partition(" → ")[2].partition(":")[0] for note in notes] == ["dropped"] * 2
    with pytest.raises(ValueError, match=r"--actor\.adam\.eps .*epsilon is 1e-8"):
        expand_aliases(["--actor.adam.eps", "1e-6"])


def test_the_async_queue_size_is_the_async_depth():
    argv, _ = expand_aliases(["--train.async_enable", "--train.async_queue_size", "3"])
    assert argv == ["--rollout.async_train", "true", "--rollout.async_depth", "3"]


def test_actor_and_critic_settings_held_once_here_must_agree():
    argv, notes = expand_aliases(["--actor.max_norm", "0.5", "--critic.max_norm", "0.5"])
    assert argv == ["--train.max_norm", "0.5"]
    assert notes[1] == "--critic.max_norm 0.5 → (with --train.max_norm 0.5 above)"
    with pytest.raises(ValueError, match=r"differ; rl-launch has one --train\.max_norm"):
        expand_aliases(["--actor.max_norm", "0.5", "--critic.max_norm", "1.0"])


def test_remote_url_to_a_python_file_is_a_reward_function_and_a_url_stays():
    argv, notes = expand_aliases(["--reward.remote_url", "/openrlhf/examples/python/reward_func.py"])
    assert argv == ["--reward.function", "/openrlhf/examples/python/reward_func.py"]
    assert len(notes) == 1
    argv, notes = expand_aliases(["--reward.remote_url", "http://localhost:5000/get_reward"])
    assert argv == ["--reward.remote_url", "http://localhost:5000/get_reward"]
    assert notes == []


def test_agent_func_path_is_the_agent_file_of_the_multi_turn_executor():
    argv, notes = expand_aliases(["--train.agent_func_path", "agents/env.py"])
    assert argv == ["--rollout.agent_func_path", "agents/env.py"]
    assert notes == ["--train.agent_func_path agents/env.py → --rollout.agent_func_path agents/env.py"]
    assert "train.agent_func_path" not in UNSUPPORTED


def test_wandb_key_true_turns_wandb_on_and_a_key_goes_into_the_environment_without_echoing_it(monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    assert expand_aliases(["--logger.wandb.key", "True"])[0] == ["--log.use_wandb", "true"]
    assert "WANDB_API_KEY" not in os.environ
    argv, notes = expand_aliases(["--logger.wandb.key=secret-api-key-123"])
    assert argv == ["--log.use_wandb", "true"]
    assert os.environ["WANDB_API_KEY"] == "secret-api-key-123"
    assert "secret-api-key-123" not in "".join(notes)
    assert notes[0].startswith("--logger.wandb.key '***' → --log.use_wandb true: the key goes into the run's")
    assert "visible to other users of this machine" in notes[0]


def test_reward_normalize_enable_normalises_the_reward_models_score_and_is_dropped_without_one():
    argv, notes = expand_aliases(["--reward.model_name_or_path", "rm", "--reward.normalize_enable"])
    assert argv == ["--model.reward_pretrain", "rm", "--reward.normalize", "model"]
    argv, notes = expand_aliases(["--reward.normalize_enable"])
    assert argv == []
    assert notes[0].startswith("--reward.normalize_enable → dropped: OpenRLHF normalises only a reward model")


def test_oversampling_and_the_moe_aux_loss_are_renames():
    argv, _ = expand_aliases(["--rollout.vllm_generate_batch_size", "64", "--actor.aux_loss_coef", "0.001"])
    assert argv == ["--rollout.generate_batch_size", "64", "--algo.policy.aux_loss_coef", "0.001"]
    for flag in ("reward.normalize_enable", "rollout.vllm_generate_batch_size", "actor.aux_loss_coef"):
        assert flag not in UNSUPPORTED


def test_optim_and_muon_flags_are_each_roles_optimizer_options():
    argv, notes = expand_aliases(
        [
            "--actor.optim",
            "muon",
            "--actor.muon.lr",
            "0.01",
            "--critic.optim",
            "adam",
            "--actor.muon.momentum",
            "0.9",
        ]
    )
    assert argv == [
        *("--train.actor_optimizer", "muon", "--train.actor_muon_learning_rate", "0.01"),
        *("--train.critic_optimizer", "adamw", "--train.muon_momentum", "0.9"),
    ]
    assert notes[0].startswith(
        "--actor.optim muon → --train.actor_optimizer muon: under ZeRO 1-3 DeepSpeed clips"
    )
    with pytest.raises(ValueError, match=r"--actor\.optim .*OpenRLHF's choices are adam and muon, got 'sgd'"):
        expand_aliases(["--actor.optim", "sgd"])
    with pytest.raises(ValueError, match=r"differ; rl-launch has one --train\.muon_momentum"):
        expand_aliases(["--actor.muon.momentum", "0.9", "--critic.muon.momentum", "0.95"])
    argv, _ = expand_aliases(["--optim", "muon", "--muon.lr", "0.03", "--muon.momentum", "0.9"], "sft")
    assert argv == [
        *("--train.actor_optimizer", "muon", "--train.actor_muon_learning_rate", "0.03"),
        *("--train.muon_momentum", "0.9"),
    ]


def test_muon_newton_schulz_steps_and_nesterov_are_deepspeeds_fixed_ones():
    argv, notes = expand_aliases(["--actor.muon.ns_steps", "5", "--critic.muon.nesterov"])
    assert argv == []
    assert all("DeepSpeed's Muon always uses" in note for note in notes)
    with pytest.raises(ValueError, match=r"--actor\.muon\.ns_steps .*rl-launch always uses 5"):
        expand_aliases(["--actor.muon.ns_steps", "3"])
    for command, flag in (("ppo", "--actor.muon.no_nesterov"), ("dpo", "--muon.no_nesterov")):
        with pytest.raises(ValueError, match=r"no_nesterov .*always uses Nesterov momentum"):
            expand_aliases([flag], command)


# ------------------------------------------------------------------------ refused and untouched


def test_unsupported_flag_names_the_flag_and_the_reason():
    with pytest.raises(
        ValueError,
        match=r"^--ds\.load_in_4bit \(OpenRLHF\) is not supported by rl-launch: QLoRA .*needs the bitsandbytes "
        r"package on every device.*CPU backend was not tried",
    ):
        expand_aliases(["--ds.load_in_4bit"])
    with pytest.raises(ValueError, match=r"--vllm\.sync_with_ray .*--rollout\.weight_sync \(broadcast"):
        expand_aliases(["--vllm.sync_with_ray"])


def test_prefix_caching_reaches_the_vllm_engine_as_its_option():
    argv, notes = expand_aliases(["--vllm.enable_prefix_caching"])
    assert argv == ["--rollout.engine_options.enable_prefix_caching", "true"]
    assert notes == ["--vllm.enable_prefix_caching → --rollout.engine_options.enable_prefix_caching true"]


def test_every_unsupported_flag_of_a_command_line_is_reported_at_once():
    with pytest.raises(ValueError, match=r"^OpenRLHF flags rl-launch cannot take:") as error:
        expand_aliases(["--ckpt.disable_ds", "--algo.kl.use_loss", "--ckpt.max_mem", "4"])
    message = str(error.value)
    assert "--ckpt.disable_ds" in message
    assert "--ckpt.max_mem" in message
    assert "--algo.kl.use_loss" not in message


def test_own_names_and_other_arguments_pass_through_untouched():
    argv = [
        "ppo",
        "--config",
        "run.yaml",
        "--algo.advantage.estimator",
        "grpo",
        "--algo.policy.options.epsilon_high=0.28",
        "--rollout.n_samples_per_prompt",
        "8",
        "--data.apply_chat_template",
        "--print-config",
        "--unknown.option",
        "x",
    ]
    assert expand_aliases(argv) == (argv, [])


def test_arguments_after_a_double_dash_are_left_alone():
    assert expand_aliases(["--", "--algo.kl.use_loss"]) == (["--", "--algo.kl.use_loss"], [])


def test_every_flag_is_listed_once_per_command():
    for command in COMMANDS:
        flags = [alias.flag for alias in ALIASES if command in alias.commands]
        assert len(flags) == len(set(flags)), command
    # a refused flag is accepted only where a command has it with a meaning (serve_rm's normalisation,
    # sequence parallelism and dataset mixing on the trainers)
    assert {alias.flag for alias in ALIASES} & set(UNSUPPORTED) == {
        "eval.dataset",
        "eval.split",
        "data.input_template",
        "ds.ring_attn_size",
        "ds.ring_attn_head_stride",
        "data.dataset_probs",
        "data.dataset_split",
        # VL prompts are ppo's; sft, rm and dpo refuse the VLM flags
        "data.image_key",
        "data.max_images_per_prompt",
        "actor.freeze_visual_encoder",
        # the MoE load-balancing loss is --model.aux_loss_coef in sft, rm and dpo, --actor.aux_loss_coef in ppo
        "model.aux_loss_coef",
    }


# ---------------------------------------------------------------- a realistic OpenRLHF 0.11 script

# The arguments of an OpenRLHF 0.11 REINFORCE++-baseline / DAPO-style example script
# (examples/scripts), less the flags rl-launch refuses, plus the realistic values of a small run.
OPENRLHF_REINFORCE_BASELINE = [
    *("--ref.num_nodes", "1", "--ref.num_gpus_per_node", "2"),
    *("--actor.num_nodes", "1", "--actor.num_gpus_per_node", "2"),
    *("--vllm.num_engines", "2", "--vllm.tensor_parallel_size", "1", "--vllm.gpu_memory_utilization", "0.6"),
    "--train.colocate_all",
    "--vllm.enforce_eager",
    *("--algo.kl.init_coef", "1e-4", "--algo.kl.use_loss", "--algo.kl.estimator", "k2"),
    *("--algo.advantage.estimator", "reinforce_baseline", "--algo.advantage.gamma", "1.0"),
    *("--actor.eps_clip_low_high", "0.2", "0.28"),
    *("--algo.dynamic_filtering_enable", "--algo.dynamic_filtering_range", "0", "1"),
    *("--actor.model_name_or_path", "Qwen/Qwen2.5-0.5B-Instruct"),
    *("--reward.remote_url", "/openrlhf/examples/python/reward_func.py"),
    *(
        "--ckpt.path",
        "/tmp/ckpt/qwen",
        "--ckpt.save_steps",
        "20",
        "--ckpt.max_num",
        "2",
        "--ckpt.load_enable",
    ),
    *("--train.batch_size", "128", "--rollout.batch_size", "16", "--rollout.n_samples_per_prompt", "8"),
    *("--train.max_epochs", "1", "--data.max_samples", "20000", "--rollout.max_new_tokens", "1024"),
    *("--ds.zero_stage", "3", "--ds.param_dtype", "bf16", "--actor.adam.lr", "5e-7"),
    *("--data.prompt_dataset", "/data/prompts.jsonl", "--data.input_key", "context_messages"),
    "--data.apply_chat_template",
    "--actor.gradient_checkpointing_enable",
    "--ds.packing_samples",
    *("--train.dynamic_batch_enable", "--train.max_tokens_per_gpu", "16384"),
    *("--reward.clip_range", "-10", "10"),
    *("--reward.overlong_buffer_len", "256", "--reward.overlong_penalty_factor", "1.0"),
    *("--reward.stop_properly_penalty_coef", "0.0"),
    *("--algo.advantage.is_correction_enable", "--algo.advantage.is_correction_type", "icepop"),
    *("--algo.advantage.is_correction_threshold", "0.5", "5.0"),
    *("--logger.wandb.project", "reinforce-baseline", "--logger.wandb.run_name", "qwen-0.5b"),
]


# OpenRLHF flags that are also options here (aliased so that the table lists them).
SAME_NAMES = {
    "reward.remote_url",
    "algo.advantage.estimator",
    "reward.overlong_buffer_len",
    "reward.overlong_penalty_factor",
    "reward.stop_properly_penalty_coef",
    "data.prompt_probs",
    "data.prompt_split",
    "eval.split",
    "data.input_template",
    "train.ema_beta",
    "ckpt.best_metric_key",
    "data.image_key",
    "data.max_images_per_prompt",
}


def test_reward_shaping_flags_pass_through_unchanged_and_are_no_longer_refused():
    argv = ["--reward.overlong_buffer_len", "64", "--reward.overlong_penalty_factor=0.5"]
    argv += ["--reward.stop_properly_penalty_coef", "-0.5"]
    assert expand_aliases(argv) == (argv, [])
    assert not SAME_NAMES & set(refusals_of("ppo"))


OPENRLHF_DATA_FLAGS = [
    *("--data.prompt_dataset", "math.jsonl,org/code", "--data.prompt_probs", "0.7,0.3"),
    *("--data.prompt_split", "test", "--eval.dataset", "org/bench", "--eval.split", "validation"),
    *("--data.input_template", "Question: {}\nAnswer:"),
]


def test_data_mixing_split_and_template_flags_are_no_longer_refused():
    argv, notes = expand_aliases(OPENRLHF_DATA_FLAGS)
    assert argv[:2] == ["--data.prompt_data", "math.jsonl,org/code"]
    assert argv[2:] == [
        *OPENRLHF_DATA_FLAGS[2:6],
        "--data.eval_dataset",
        "org/bench",
        *OPENRLHF_DATA_FLAGS[8:],
    ]
    assert len(notes) == 2  # the two renamed flags; the same-name ones pass through silently


@needs_final_config
def test_openrlhf_data_flags_parse_to_mixing_splits_and_template(capsys):
    from rl_launch.cli import main

    argv, _ = expand_aliases(OPENRLHF_DATA_FLAGS)
    assert main(["ppo", *argv, "--preset", "none", "--model.pretrain", "m", "--print-config"]) == 0
    config = yaml.safe_load(capsys.readouterr().out)
    assert config["data"]["prompt_data"] == "math.jsonl,org/code"
    assert config["data"]["prompt_probs"] == [0.7, 0.3]
    assert config["data"]["prompt_split"] == "test"
    assert config["data"]["eval_dataset"] == "org/bench"
    assert config["eval"]["split"] == "validation"
    assert config["data"]["input_template"] == "Question: {}\nAnswer:"


def test_openrlhf_example_expands_to_rl_launch_names():
    argv, notes = expand_aliases(OPENRLHF_REINFORCE_BASELINE)
    text = " ".join(argv)
    for expected in (
        "--ray.ref.num_actors 2",
        "--ray.policy.num_actors 2",
        "--rollout.num_engines 2",
        "--ray.colocate all",
        "--algo.kl.init_kl_coef 1e-4 --algo.kl.use_kl_loss true",
        "--algo.kl.reward_estimator k2 --algo.kl.loss_estimator k2",
        "--algo.advantage.estimator reinforce_baseline",
        "--algo.policy.options.epsilon_low 0.2 --algo.policy.options.epsilon_high 0.28",
        "--rollout.dynamic_filtering true --rollout.dynamic_filtering_reward_range 0,1",
        "--model.pretrain Qwen/Qwen2.5-0.5B-Instruct",
        "--reward.function /openrlhf/examples/python/reward_func.py",
        "--ckpt.path /tmp/ckpt/qwen --ckpt.save_steps 20 --ckpt.max_ckpt_num 2 --ckpt.load_checkpoint true",
        "--train.train_batch_size 128 --rollout.rollout_batch_size 16 --rollout.n_samples_per_prompt 8",
        "--rollout.generate_max_len 1024",
        "--train.zero_stage 3 --model.dtype bf16 --train.actor_learning_rate 5e-7",
        "--data.prompt_data /data/prompts.jsonl --data.input_key context_messages --data.apply_chat_template",
        "--model.gradient_checkpointing true",
        "--train.micro_batch_tokens 16384",
        "--reward.clip 10",
        "--algo.policy.correction icepop",
        "--algo.policy.correction_options.low 0.5 --algo.policy.correction_options.high 5.0",
        "--log.wandb_project reinforce-baseline --log.run_name qwen-0.5b",
    ):
        assert expected in text
    assert "--reward.overlong_buffer_len 256 --reward.overlong_penalty_factor 1.0" in text
    assert "--reward.stop_properly_penalty_coef 0.0" in text
    # No OpenRLHF-only name is left, and each rewritten flag has its note.
    openrlhf_only = {f"--{flag}" for flag in aliases_of("ppo")} - {f"--{name}" for name in SAME_NAMES}
    assert not [token for token in argv if token.partition("=")[0] in openrlhf_only]
    assert "--algo.advantage.gamma" not in text  # OpenRLHF runs reinforce_baseline with gamma 1.0
    rewritten = openrlhf_only | {"--reward.remote_url"}  # its value here is a .py file
    assert len(notes) == len([token for token in OPENRLHF_REINFORCE_BASELINE if token in rewritten])


# ------------------------------------------------------------ against the real configuration


def _dict_option(option_type: typing.Any) -> bool:
    return option_type is dict or typing.get_origin(option_type) is dict


def _config_of(command: str) -> type:
    from rl_launch.serve_rm import ServeRMConfig
    from rl_launch.trainers import COMMANDS as TRAINER_COMMANDS

    return {"ppo": PPOConfig, "serve-rm": ServeRMConfig, **TRAINER_COMMANDS}[command]


def _is_option(name: str, leaves: dict[str, typing.Any]) -> bool:
    if name in leaves:
        return True
    parts = name.split(".")  # an entry of a dict option, at any depth
    return any(_dict_option(leaves.get(".".join(parts[:end]))) for end in range(1, len(parts)))


@needs_final_config
@pytest.mark.parametrize("command", COMMANDS)
def test_every_alias_target_is_an_option_of_the_config(command):
    config = _config_of(command)
    leaves = {option.name: option.type for option in iter_options(config) if not option.is_section}
    missing = [
        f"--{alias.flag} -> {target}"
        for alias in aliases_of(command).values()
        for target in alias.targets
        if not _is_option(target, leaves)
    ]
    assert not missing


@needs_final_config
def test_no_openrlhf_flag_shadows_an_option_of_the_config():
    names = {option.name for option in iter_options(PPOConfig)}
    # Shared names: only a .py value of reward.remote_url (OpenRLHF's local function) and a group
    # estimator with the KL in the reward (OpenRLHF's reward-to-go form) change; the reward shaping
    # flags mean the same here and pass through; train.num_episodes is ours too, with a note (the
    # loop resolves it).
    assert set(aliases_of("ppo")) & names == SAME_NAMES | {"train.num_episodes"}
    assert not set(refusals_of("ppo")) & names


@needs_final_config
def test_expanded_openrlhf_example_parses_with_the_real_parser(capsys):
    from rl_launch.cli import main

    argv, _ = expand_aliases(OPENRLHF_REINFORCE_BASELINE)
    assert main(["ppo", *argv, "--preset", "none", "--print-config"]) == 0
    config = yaml.safe_load(capsys.readouterr().out)
    algo = config["algo"]
    assert algo["advantage"]["estimator"] == "reinforce_baseline"
    assert algo["advantage"]["options"] == {}  # gamma 1.0 was dropped, as OpenRLHF ignores it here
    assert algo["policy"]["options"] == {"epsilon_low": 0.2, "epsilon_high": 0.28}
    assert algo["policy"]["correction"] == "icepop"
    assert algo["policy"]["correction_options"] == {"low": 0.5, "high": 5.0}
    assert algo["kl"]["use_kl_loss"] is True
    assert (algo["kl"]["reward_estimator"], algo["kl"]["loss_estimator"]) == ("k2", "k2")
    assert algo["kl"]["init_kl_coef"] == pytest.approx(1e-4)
    assert config["ray"]["policy"]["num_actors"] == 2
    assert config["ray"]["colocate"] == "all"
    assert config["reward"]["function"] == "/openrlhf/examples/python/reward_func.py"
    assert config["reward"]["remote_url"] is None
    assert config["ckpt"]["load_checkpoint"] is True
    assert config["reward"]["overlong_buffer_len"] == 256
    assert config["reward"]["overlong_penalty_factor"] == 1.0
    assert config["reward"]["stop_properly_penalty_coef"] == 0.0
    assert config["rollout"]["dynamic_filtering_reward_range"] == [0.0, 1.0]
    assert config["train"]["micro_batch_tokens"] == 16384


@needs_final_config
def test_options_named_in_the_refusals_and_the_same_name_flags_exist():
    leaves = {option.name: option.type for option in iter_options(PPOConfig) if not option.is_section}
    named = {word for reason in UNSUPPORTED.values() for word in re.findall(r"--([\w.]+)", reason)}
    named -= {alias.flag for alias in ALIASES}  # a reason may point at an accepted OpenRLHF flag
    named -= {"data.apply_chat_template"}  # sft's option, named in a reason of sft / rm / dpo
    unknown = [
        name for name in named if name not in leaves and not _dict_option(leaves.get(name.rpartition(".")[0]))
    ]
    assert not unknown
    same_names = {
        *("algo.advantage.estimator", "rollout.n_samples_per_prompt", "rollout.temperature", "rollout.top_p"),
        *("train.max_epochs", "train.seed", "data.input_key", "data.label_key", "data.apply_chat_template"),
        *(
            "data.max_samples",
            "eval.temperature",
            "eval.n_samples_per_prompt",
            "ckpt.path",
            "ckpt.save_steps",
        ),
        "reward.remote_url",
    }
    assert same_names <= set(leaves)


# ------------------------------------------------- translations of the OpenRLHF drop-in issue


def test_sleep_flags_are_the_hybrid_engines_two_switches_and_say_when_they_do_nothing():
    argv, notes = expand_aliases(["--train.colocate_all", "--vllm.enable_sleep", "--ds.enable_sleep"])
    assert argv == ["--ray.colocate", "all", "--ray.engine_sleep", "true", "--ray.learner_offload", "true"]
    assert "with --ray.colocate all the engines sleep after generation" in notes[1]
    assert "with --ray.colocate all the learners offload their DeepSpeed states" in notes[2]
    argv, notes = expand_aliases(["--vllm.enable_sleep"])
    assert argv == ["--ray.engine_sleep", "true"]
    assert "no effect here, as in OpenRLHF without the hybrid engine" in notes[0]
    _, notes = expand_aliases(["--ray.colocate", "all", "--ds.enable_sleep"])
    assert "with --ray.colocate all the learners offload" in notes[0]


def test_sync_backend_is_the_broadcast_strategy_and_other_backends_are_refused():
    argv, notes = expand_aliases(["--vllm.sync_backend", "gloo"])
    assert argv == ["--rollout.weight_sync", "broadcast"]
    assert "NCCL on GPUs and gloo on CPU" in notes[0]
    with pytest.raises(ValueError, match="nccl and gloo"):
        expand_aliases(["--vllm.sync_backend", "mpi"])


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--data.max_len", "2048"], ["--data.prompt_max_len", "1024", "--rollout.generate_max_len", "1024"]),
        (
            ["--data.max_len", "9216", "--rollout.max_new_tokens", "8192"],
            ["--data.prompt_max_len", "1024", "--rollout.generate_max_len", "8192"],
        ),
        (
            ["--data.prompt_max_len", "512", "--data.max_len", "2048"],
            ["--data.prompt_max_len", "512", "--rollout.generate_max_len", "1536"],
        ),
    ],
)
def test_max_len_is_split_into_the_prompt_and_response_lengths_with_a_note(argv, expected):
    expanded, notes = expand_aliases(argv)
    assert expanded == expected
    assert any("prompt + response ≤" in note for note in notes)


def test_max_len_is_max_len_for_sft_and_serve_rm():
    assert expand_aliases(["--data.max_len", "512"], "sft") == (["--data.max_len", "512"], [])
    assert expand_aliases(["--data.max_len", "512"], "serve-rm")[0] == ["--max_len", "512"]
    with pytest.raises(ValueError, match="leaves no room for a prompt"):
        expand_aliases(["--data.max_len", "100", "--rollout.max_new_tokens", "100"])


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--algo.advantage.is_correction_level", "off"], {"correction": "none"}),
        (["--algo.advantage.is_correction_level", "token"], {"correction": "tis"}),
        (
            ["--algo.advantage.is_correction_level", "token", "--algo.advantage.is_correction_mode", "mask"],
            {"correction": "mask"},
        ),
        (
            [
                "--algo.advantage.is_correction_level",
                "seq",
                *("--algo.advantage.is_correction_threshold", "0.5", "2"),
            ],
            {"correction": "mask", "level": "geometric", "low": "0.5", "high": "2"},
        ),
        (
            [
                *("--algo.advantage.is_correction_level", "seq", "--algo.advantage.is_correction_gating"),
                *("binary_kl", "--algo.advantage.is_correction_threshold", "5e-3"),
            ],
            {"correction": "mask", "level": "sequence", "gating": "binary_kl", "low": "0", "high": "5e-3"},
        ),
    ],
)
def test_openrlhf_0_11_2_correction_level_mode_and_gating_become_a_correction(flags, expected):
    argv, _ = expand_aliases(flags)
    pairs = dict(zip(argv[::2], argv[1::2], strict=True))
    got = {key.rpartition(".")[2]: value for key, value in pairs.items()}
    assert got == expected


@pytest.mark.parametrize(
    ("flags", "match"),
    [
        (
            ["--algo.advantage.is_correction_level", "seq", "--algo.advantage.is_correction_mode", "clip"],
            "clip truncates a token's ratio",
        ),
        (["--algo.advantage.is_correction_gating", "tv"], "turns nothing on without"),
        (
            ["--algo.advantage.is_correction_enable", "--algo.advantage.is_correction_level", "token"],
            "not both",
        ),
        (
            [
                "--algo.advantage.is_correction_level",
                "token",
                "--algo.advantage.is_correction_threshold",
                "2",
            ],
            "one value is an upper bound only",
        ),
    ],
)
def test_openrlhf_0_11_2_correction_flags_without_a_counterpart_are_refused(flags, match):
    with pytest.raises(ValueError, match=match):
        expand_aliases(flags)


def test_deepspeed_keys_pass_through_the_deepspeed_config_option():
    argv, _ = expand_aliases(["--ds.overlap_comm", "--ds.zpg", "8", "--ds.grad_accum_dtype", "fp32"], "dpo")
    assert argv == [
        *("--train.deepspeed_config.zero_optimization.overlap_comm", "true"),
        *("--train.deepspeed_config.zero_optimization.zero_hpz_partition_size", "8"),
        *("--train.deepspeed_config.data_types.grad_accum_dtype", "fp32"),
    ]


def test_logger_flags_reach_wandb_and_tensorboard_options():
    argv, _ = expand_aliases(
        ["--logger.wandb.org", "team", "--logger.wandb.group", "g", "--logger.tensorboard_dir", "tb"], "rm"
    )
    assert argv == [
        *("--log.wandb_entity", "team", "--log.wandb_group", "g"),
        *("--log.use_tensorboard", "true", "--log.tensorboard_dir", "tb"),
    ]


def test_async_colocate_all_colocates_the_learners_only_as_openrlhf():
    argv, notes = expand_aliases(["--train.async_enable", "--train.colocate_all", "--vllm.enable_sleep"])
    # ray.engine_sleep applies with ray.colocate all only: here it changes nothing, as in OpenRLHF
    assert argv == [
        "--rollout.async_train",
        "true",
        "--ray.colocate",
        "policy_ref",
        "--ray.engine_sleep",
        "true",
    ]
    assert "only the DeepSpeed models" in notes[1]
    assert "no effect here, as in OpenRLHF without the hybrid engine" in notes[2]


def test_ema_best_checkpoint_warmup_and_offload_flags_become_options():
    argv, notes = expand_aliases(
        [
            *("--train.enable_ema", "--critic.freezing_steps", "5", "--ref.offload", "--reward.offload"),
            *("--ckpt.best_metric_key", "eval/pass@1"),
        ]
    )
    assert argv == [
        *("--train.ema_beta", "0.992", "--train.critic_warmup_steps", "5"),
        *("--ray.ref.offload", "true", "--ray.reward_model.offload", "true"),
        *("--ckpt.best_metric_key", "eval/pass@1"),  # rl-launch's own option: untouched
    ]
    assert len(notes) == 4
    # --train.ema_beta is rl-launch's option too: it passes through and sets the beta
    argv, notes = expand_aliases(["--train.enable_ema", "--train.ema_beta", "0.99"])
    assert argv == ["--train.ema_beta", "0.99"]
    assert notes == ["--train.enable_ema → dropped: --train.ema_beta, given too, turns the EMA on here"]
    assert expand_aliases(["--critic.freezing_steps", "-1"])[0] == ["--train.critic_warmup_steps", "0"]
    argv, notes = expand_aliases(["--ckpt.best_metric_key", "none"])
    assert argv == []
    assert "no best checkpoint" in notes[0]
    for flag in ("train.enable_ema", "train.ema_beta", "ckpt.best_metric_key", "critic.freezing_steps"):
        assert flag not in UNSUPPORTED
    assert "ref.offload" not in UNSUPPORTED
    assert "reward.offload" not in UNSUPPORTED


def test_supervised_commands_take_openrlhf_ranks_multiturn_and_ring_attention():
    argv, _ = expand_aliases(["--actor.num_nodes", "2", "--actor.num_gpus_per_node", "8"], "sft")
    assert argv == ["--ray.learner.num_actors", "16"]
    argv, _ = expand_aliases(["--ds.ring_attn_size", "2"], "dpo")
    assert argv == ["--model.sequence_parallel_size", "2"]
    # the conversations are in OpenRLHF's --data.input_key ("input" unless given)
    assert expand_aliases(["--data.multiturn"], "sft")[0] == ["--data.messages_key", "input"]
    argv, _ = expand_aliases(["--data.input_key", "chat", "--data.multiturn"], "sft")
    assert argv == ["--data.input_key", "chat", "--data.messages_key", "chat"]
