"""End to end: an engine actor's process killed mid-run. The run stops with exit code 1 and a
diagnosis that names the actor (engine-0), its log file and why, and saves the last finished
step when the learners can.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.launch.launching import read_metrics, write_sum_prompts

pytestmark = pytest.mark.slow


def test_a_killed_engine_is_named_with_its_log_and_the_run_stops(tiny_checkpoint, ray_temp, tmp_path):
    ray_dir, env = ray_temp
    run_dir = tmp_path / "run"
    args = [
        "--preset", "none",
        "--model.pretrain", str(tiny_checkpoint),
        "--data.prompt_data", str(write_sum_prompts(tmp_path / "train.jsonl", 64)),
        "--reward.function", "numeric",
        "--rollout.engine", "hf",
        "--rollout.n_samples_per_prompt", "2",
        "--rollout.rollout_batch_size", "2",
        "--rollout.generate_max_len", "4",
        "--algo.advantage.estimator", "grpo",
        "--train.max_steps", "40",
        "--ckpt.save_hf_model", "false",
        "--log.output_dir", str(run_dir),
        "--log.progress_bar", "false",
        "--ray.temp_dir", ray_dir,
    ]  # fmt: skip
    process = subprocess.Popen(
        [sys.executable, "-m", "rl_launch.cli", "ppo", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    log = run_dir / "logs" / "engine-0.log"
    deadline = time.monotonic() + 600
    try:
        while not ((run_dir / "metrics.jsonl").exists() and read_metrics(run_dir)):
            assert process.poll() is None, process.communicate()[1][-4000:]
            assert time.monotonic() < deadline
            time.sleep(0.05)
        pid = int(re.search(r"engine-0: pid (\d+)", log.read_text()).group(1))
        os.kill(pid, signal.SIGKILL)
        _, err = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert process.returncode == 1, err[-4000:]
    assert "engine-0 died" in err, err[-4000:]
    assert f"its log: {log.resolve()}" in err
    saved = re.search(r"checkpoint of step (\d+) saved", err)
    if saved:  # the engine died while generating: the learners saved the last finished step
        step = int(saved.group(1))
        tag = (run_dir / "checkpoints" / "policy" / "latest").read_text().strip()
        assert tag == f"step_{step:08d}"
