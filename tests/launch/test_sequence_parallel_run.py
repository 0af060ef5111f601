"""End to end through Ray and DeepSpeed on CPU: `rl-launch ppo` with model.sequence_parallel_size 2
(two policy ranks sharing every micro-batch) trains like the same run on one policy rank."""

from __future__ import annotations

import pytest

from tests.launch.launching import launch, read_metrics, write_sum_prompts

pytestmark = pytest.mark.slow

REWARD_FILE = """
def reward_func(queries, prompts, labels):
    # the tiny model's text decides: groups mix 0s and 1s, so GRPO's advantages are not all 0
    return [float(sum(map(ord, query)) % 3 == 0) for query in queries]
"""

# Metrics that measure time, or depend on it, differ between any two runs.
_TIMING = ("time", "time/", "throughput/", "sync/seconds", "sync/gigabytes")


def _args(checkpoint, prompts, reward, run_dir, ray_dir, *extra: str) -> list[str]:
    return [
        "--preset", "none",
        "--model.pretrain", str(checkpoint),
        "--data.prompt_data", str(prompts),
        "--reward.function", str(reward),
        "--rollout.engine", "hf",
        "--rollout.n_samples_per_prompt", "4",
        "--rollout.rollout_batch_size", "4",
        "--rollout.generate_max_len", "12",
        "--algo.advantage.estimator", "grpo",
        "--train.max_steps", "2",
        "--train.zero_stage", "0",
        "--train.actor_learning_rate", "1e-4",
        "--ckpt.save_hf_model", "false",
        "--log.output_dir", str(run_dir),
        "--log.progress_bar", "false",
        "--ray.temp_dir", ray_dir,
        *extra,
    ]  # fmt: skip


def test_sequence_parallel_two_ranks_train_like_one_rank(tiny_checkpoint, ray_temp, tmp_path):
    ray_dir, env = ray_temp
    prompts = write_sum_prompts(tmp_path / "train.jsonl", 16)
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD_FILE)
    runs = {}
    for name, extra in (
        ("one", ()),
        ("sp2", ("--model.sequence_parallel_size", "2", "--ray.policy.num_actors", "2")),
    ):
        run_dir = tmp_path / name
        result = launch(_args(tiny_checkpoint, prompts, reward, run_dir, f"{ray_dir}/{name}", *extra), env)
        assert result.returncode == 0, result.stderr[-4000:]
        runs[name] = (read_metrics(run_dir), result.stdout + result.stderr)
    assert "sequence parallel: 2 ranks share each micro-batch" in runs["sp2"][1]
    assert "sequence parallel" not in runs["one"][1]
    one, sp2 = runs["one"][0], runs["sp2"][0]
    assert [line["step"] for line in sp2] == [1, 2]
    assert all(line["policy/grad_norm"] > 0 for line in one)  # the runs train
    for ours, theirs in zip(sp2, one, strict=True):
        keys = {key for key in theirs if not key.startswith(_TIMING)}
        assert keys == {key for key in ours if not key.startswith(_TIMING)}
        for key in sorted(keys):
            assert ours[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-5), key
