"""`rl-launch ppo` on a reasoning-gym task by name, scored by its own verifier: two steps on CPU
(hf engine, the tiny model). The test environment holds `rl-launch[reasoning-gym]` (pyproject.toml):
without it this fails. The resolution and the reward on a stand-in: tests/launch/test_reasoning_gym_data.py."""

from __future__ import annotations

import pytest

from tests.launch.launching import launch, read_metrics

pytestmark = pytest.mark.slow


def test_ppo_trains_two_steps_on_a_reasoning_gym_task_scored_by_its_verifier(
    tiny_checkpoint, joined_ray, tmp_path
):
    ray_args, env = joined_ray
    run_dir = tmp_path / "run"
    args = [
        "--preset", "none",
        "--model.pretrain", str(tiny_checkpoint),
        "--data.prompt_data", "reasoning_gym:basic_arithmetic?size=8&seed=1&max_terms=2",
        "--reward.function", "reasoning_gym",
        "--rollout.n_samples_per_prompt", "2",
        "--rollout.rollout_batch_size", "4",
        "--rollout.generate_max_len", "8",
        "--algo.advantage.estimator", "grpo",
        "--train.max_steps", "2",
        "--ckpt.save_hf_model", "false",
        "--log.output_dir", str(run_dir),
        "--log.progress_bar", "false",
        *ray_args,
        "--rollout.engine", "hf",
    ]  # fmt: skip
    result = launch(args, env)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "data: 8 training prompts" in result.stdout + result.stderr
    metrics = read_metrics(run_dir)
    assert [line["step"] for line in metrics] == [1, 2]
    for line in metrics:  # the task's score_answer on the tiny model's 8-token answers
        assert 0.0 <= line["reward/function_mean"] <= 1.0
