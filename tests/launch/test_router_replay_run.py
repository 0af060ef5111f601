"""Routing replay through `rl-launch ppo`: a tiny Qwen3-MoE (8 experts, top-2, built locally), the
transformers engine recording routes (`rollout.engine_options.return_routed_experts`), the
learner replaying them (`algo.policy.router_replay R3`): two steps, and every step's metrics.jsonl
line has the MoE metrics, the engine's routes on every record and the learner using exactly the
engine's experts. Measured by hand on 2 loaded CPU cores: ~20 s for the run."""

from __future__ import annotations

import pytest

from tests.launch.launching import launch, read_metrics, write_sum_prompts

pytestmark = pytest.mark.slow


def test_router_replay_runs_end_to_end_and_logs_moe_metrics(joined_ray, tmp_path):
    from rl_data.tiny import build_tiny_checkpoint

    model = build_tiny_checkpoint(
        tmp_path / "moe", architecture="qwen3_moe", hidden_size=64, num_heads=2, num_kv_heads=1
    )
    prompts = write_sum_prompts(tmp_path / "train.jsonl", 8)
    ray_args, env = joined_ray
    run_dir = tmp_path / "run"
    args = [
        "--preset", "none",
        "--model.pretrain", str(model),
        "--data.prompt_data", str(prompts),
        "--reward.function", "numeric",
        "--rollout.engine", "hf",
        "--rollout.engine_options.return_routed_experts", "true",
        "--algo.policy.router_replay", "R3",
        "--rollout.n_samples_per_prompt", "2",
        "--rollout.rollout_batch_size", "4",
        "--rollout.generate_max_len", "8",
        "--algo.advantage.estimator", "grpo",
        "--train.max_steps", "2",
        "--ckpt.save_hf_model", "false",
        "--log.output_dir", str(run_dir),
        "--log.progress_bar", "false",
        *ray_args,
    ]  # fmt: skip
    result = launch(args, env, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    steps = [line for line in read_metrics(run_dir) if "policy/moe_routes_reported" in line]
    assert len(steps) == 2, steps
    for line in steps:
        assert line["policy/moe_routes_reported"] == 1.0
        assert line["policy/moe_route_mismatch_used"] == 0.0  # the learner ran the engine's experts
        assert 0.0 <= line["policy/moe_route_mismatch"] <= 1.0
        assert 1.0 <= line["policy/moe_layer1/load_max_over_mean"] <= 4.0  # E/K = 4 at most
        assert 0.0 < line["policy/moe_load_entropy"] <= 2.0795  # ln 8
