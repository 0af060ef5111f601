"""End to end: `rl-launch sft` sent SIGTERM mid-run, then resumed (`rl-launch ppo`'s SIGTERM, with
every assertion below, is one of the stops of tests/launch/test_chaos.py).

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

from rl_launch.cli import main
from tests.launch.launching import read_metrics, signal_after_step

pytestmark = pytest.mark.slow


def _saved_step(run_dir, role: str = "policy") -> int:
    latest = run_dir / "checkpoints" / role / "latest"
    tag = latest.read_text().strip()
    state = json.loads((latest.parent / tag / "training_state.json").read_text())
    return int(state["step"])


def test_sft_sigterm_saves_the_last_finished_step_and_the_resume_continues_from_it(
    tmp_path, capsys, in_process
):
    run_dir = tmp_path / "run"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1"}
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

    # the resume through the CLI's main in this process (sft trains in the driver: a process of
    # its own would add only its imports)
    capsys.readouterr()
    code = main(["sft", *args[:-1], str(saved + 1), "--ckpt.load_checkpoint", "true"])
    out, err = capsys.readouterr()
    assert code == 0, err[-4000:]
    assert f"from step {saved}" in out + err
    assert [line["step"] for line in read_metrics(run_dir)] == list(range(1, saved + 2))
