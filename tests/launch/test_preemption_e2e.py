"""End to end: `rl-launch ppo` and `rl-launch sft` sent SIGTERM mid-run, then resumed.

A cluster preempting a job sends SIGTERM to the driver and kills it a grace period later. The run
must save the last finished step (even with `ckpt.save_steps -1`), write its summary, leave no
process behind (the `ray_temp` fixture checks Ray's) and exit 143 well within the bound, and
`--ckpt.load_checkpoint true` must continue from that step.
"""

from __future__ import annotations

import json
import os
import signal

import pytest

from tests.launch.launching import launch, read_metrics, signal_after_step, write_sum_prompts

pytestmark = pytest.mark.slow


def _saved_step(run_dir, role: str = "policy") -> int:
    latest = run_dir / "checkpoints" / role / "latest"
    tag = latest.read_text().strip()
    state = json.loads((latest.parent / tag / "training_state.json").read_text())
    return int(state["step"])


def test_sigterm_saves_the_last_finished_step_and_the_resume_continues_from_it(
    tiny_checkpoint, ray_temp, tmp_path
):
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
        "--ckpt.preemption_timeout_s", "60",
        "--log.output_dir", str(run_dir),
        "--log.progress_bar", "false",
        "--ray.temp_dir", ray_dir,
    ]  # fmt: skip
    stopped, seconds = signal_after_step("ppo", args, env, run_dir, 2, signal.SIGTERM)
    assert stopped.returncode == 143, stopped.stderr[-4000:]
    assert seconds < 60
    logged = [line["step"] for line in read_metrics(run_dir)]
    saved = _saved_step(run_dir)
    assert saved >= 2
    assert logged == list(range(1, saved + 1))  # the checkpoint is the last finished step
    assert f"stopped after step {saved} (checkpoint of step {saved} saved" in stopped.stderr
    assert (run_dir / "summary.txt").is_file()
    assert "summary of" in stopped.stdout

    resumed = launch([*args, "--ckpt.load_checkpoint", "true", "--train.max_steps", str(saved + 1)], env)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert f"from step {saved}" in resumed.stdout + resumed.stderr
    assert [line["step"] for line in read_metrics(run_dir)] == list(range(1, saved + 2))


def test_sft_sigterm_saves_the_last_finished_step_and_the_resume_continues_from_it(tmp_path):
    run_dir = tmp_path / "run"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "2"}
    args = [
        "--preset_root", str(tmp_path / "presets"),
        "--log.output_dir", str(run_dir),
        "--log.progress_bar", "false",
        "--ckpt.save_hf_model", "false",
        "--train.max_steps", "400",
    ]  # fmt: skip
    stopped, seconds = signal_after_step("sft", args, env, run_dir, 2, signal.SIGTERM)
    assert stopped.returncode == 143, stopped.stderr[-4000:]
    assert seconds < 60
    saved = _saved_step(run_dir)
    assert [line["step"] for line in read_metrics(run_dir)] == list(range(1, saved + 1))
    assert (run_dir / "summary.txt").is_file()

    import subprocess
    import sys

    resumed = subprocess.run(
        [
            sys.executable,
            "-m",
            "rl_launch.cli",
            "sft",
            *args[:-1],
            str(saved + 1),
            "--ckpt.load_checkpoint",
            "true",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert f"from step {saved}" in resumed.stdout + resumed.stderr
    assert [line["step"] for line in read_metrics(run_dir)] == list(range(1, saved + 2))
