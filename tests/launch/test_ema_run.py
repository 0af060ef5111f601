"""End to end through Ray: `--train.ema_beta` keeps an EMA of the policy, saves it in each
checkpoint and exports it to <log.output_dir>/final_ema (tiny model, hf engine, 2 steps)."""

from __future__ import annotations

import pytest
import torch

from tests.launch.launching import launch, write_sum_prompts

pytestmark = pytest.mark.slow

BETA = 0.5
# a reward that differs between two sampled responses, so that GRPO's advantages are not all 0
REWARD_FILE = """
def reward_func(queries, prompts, labels):
    return [(sum(map(ord, q[len(p):])) % 97) / 97.0 for q, p in zip(queries, prompts)]
"""


def test_the_exported_ema_is_the_beta_average_of_the_checkpointed_ema_and_the_final_policy(
    tiny_checkpoint, ray_temp, tmp_path
):
    from safetensors.torch import load_file

    from rl_learner import load_checkpoint_tensors

    ray_dir, env = ray_temp
    run_dir = tmp_path / "run"
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD_FILE)
    args = [
        "--preset", "none",
        "--model.pretrain", str(tiny_checkpoint),
        "--data.prompt_data", str(write_sum_prompts(tmp_path / "train.jsonl", 8)),
        "--reward.function", str(reward),
        "--algo.advantage.estimator", "grpo",
        "--rollout.n_samples_per_prompt", "2",
        "--rollout.rollout_batch_size", "2",
        "--rollout.generate_max_len", "8",
        "--rollout.engine", "hf",
        "--train.max_steps", "2",
        "--train.zero_stage", "0",
        "--train.actor_learning_rate", "1e-3",
        "--train.ema_beta", str(BETA),
        "--ckpt.save_steps", "1",
        "--log.output_dir", str(run_dir),
        "--log.progress_bar", "false",
        "--ray.temp_dir", ray_dir,
    ]  # fmt: skip
    result = launch(args, env)
    assert result.returncode == 0, result.stderr[-4000:]

    initial = load_file(str(tiny_checkpoint / "model.safetensors"))
    final = load_file(str(run_dir / "final" / "model.safetensors"))
    exported = load_file(str(run_dir / "final_ema" / "model.safetensors"))
    after_step_1 = load_checkpoint_tensors(run_dir / "checkpoints" / "policy", "ema", tag=1)
    after_step_2 = load_checkpoint_tensors(run_dir / "checkpoints" / "policy", "ema", tag=2)
    assert after_step_1 is not None
    assert sorted(after_step_2) == sorted(after_step_1)
    moved = 0
    for name, step_1 in after_step_1.items():
        # EMA_2 = β·EMA_1 + (1 − β)·θ_2, with θ_2 the exported final policy
        expected = BETA * step_1 + (1 - BETA) * final[name].float()
        assert torch.allclose(exported[name].float(), expected, atol=1e-6), name
        assert torch.equal(after_step_2[name], exported[name].float()), name
        moved += int(not torch.equal(final[name], initial[name]))
        if not torch.equal(final[name], initial[name]):
            # the average lies strictly between the initial model and the final policy
            assert not torch.equal(exported[name], final[name]), name
            assert not torch.equal(exported[name], initial[name]), name
    assert moved > 0  # the policy trained
