"""End to end: an actor's process killed mid-run (SIGKILL, as the OOM killer does). The run stops
within a bound with exit code 1 and a diagnosis that names the actor (engine-0, policy-0), its
log file, why it ended and its last lines, and says which checkpoint a resume continues from:
when an engine dies the learners save the last finished step; when the policy learner dies its
state is gone with it, and the last checkpoint on disk stays the one to resume from.
"""

from __future__ import annotations

import re

import pytest

from tests.launch.launching import interrupt_after_step, write_sum_prompts

pytestmark = pytest.mark.slow


def _args(tiny_checkpoint, tmp_path, run_dir, ray_dir) -> list[str]:
    return [
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


def _latest_step(run_dir) -> int:
    return int((run_dir / "checkpoints" / "policy" / "latest").read_text().strip().removeprefix("step_"))


def test_a_killed_engine_is_named_with_its_log_and_the_run_stops(tiny_checkpoint, ray_temp, tmp_path):
    ray_dir, env = ray_temp
    run_dir = tmp_path / "run"
    stopped, seconds = interrupt_after_step(
        _args(tiny_checkpoint, tmp_path, run_dir, ray_dir), env, run_dir, 1, "engine-0"
    )
    err = stopped.stderr
    assert stopped.returncode == 1, err[-4000:]
    assert seconds is not None, err[-4000:]
    assert seconds < 60, err[-4000:]
    assert "engine-0 died" in err, err[-4000:]
    assert f"its log: {(run_dir / 'logs' / 'engine-0.log').resolve()}" in err
    saved = re.search(r"checkpoint of step (\d+) saved", err)
    if saved:  # the engine died while generating: the learners saved the last finished step
        assert _latest_step(run_dir) == int(saved.group(1))
    else:  # it died in the weight sync: the learners had trained on, nothing older to save
        assert "a new run starts from step 0" in err or "the last checkpoint on disk stays valid" in err


def test_a_killed_policy_learner_is_named_and_the_last_checkpoint_stays_the_resume_point(
    tiny_checkpoint, ray_temp, tmp_path
):
    ray_dir, env = ray_temp
    run_dir = tmp_path / "run"
    args = [*_args(tiny_checkpoint, tmp_path, run_dir, ray_dir), "--ckpt.save_steps", "1"]
    stopped, seconds = interrupt_after_step(args, env, run_dir, 2, "policy-0")
    err = stopped.stderr
    assert stopped.returncode == 1, err[-4000:]
    assert seconds is not None, err[-4000:]
    assert seconds < 60, err[-4000:]
    log = (run_dir / "logs" / "policy-0.log").resolve()
    assert re.search(r"policy-0 died: .*pid: \d+", err), err[-4000:]
    assert "why: its process ended with no error in its log, as SIGKILL ends one" in err
    assert f"its log: {log}, last lines:\n    " in err  # the log's last lines follow
    assert "the policy's trained state was in policy-0's process: nothing newer can be saved" in err
    step = _latest_step(run_dir)
    assert step >= 2
    folder = run_dir.resolve() / "checkpoints" / "policy" / f"step_{step:08d}"
    assert (
        f"the last checkpoint on disk stays valid: step {step} ({folder}); "
        "--ckpt.load_checkpoint true continues from it"
    ) in err, err[-4000:]
