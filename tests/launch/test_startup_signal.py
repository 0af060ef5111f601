"""SIGTERM / Ctrl-C before the first step: the start-up stops at once, with nothing to save.

Until the first step begins nothing has been trained, so the run's start-up (the actors, the
weight sync's set-up, a resumed run's checkpoint loading: `rl_launch.ppo.run`) and the starting
evaluation are regions a first signal interrupts at once (`PreemptionGuard.abandonable`), where
before they ran to their end (the actors' start, up to ray.startup_timeout_s when a start stalls)
and the console promised "the step in flight". The step loop's own rules are in
test_preemption.py; this file pins the regions before it:

- the guard says the region's own words for the first signal;
- the starting evaluation (on the loop's in-process toy actors) is abandoned;
- `rl-launch ppo` in this process, with real Ray and actors, sent SIGTERM while its actors start:
  it exits 143 within the actors' start, says why, and leaves no Ray process (the `ray_temp`
  fixture fails the test if one survives).
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import ray

from rl_launch.cli import main
from rl_launch.preemption import STARTUP_STOP, PreemptionGuard
from tests.launch.fakes import fake_run, toy_prompts, use_fake_ray
from tests.launch.test_bad_inputs import _args
from tests.launch.test_step_loop import config


def _no_hard_exit(code: int) -> None:
    raise AssertionError(f"hard exit {code}")


def test_a_signal_in_a_region_with_its_own_words_says_them_and_raises_at_once():
    lines: list[str] = []
    guard = PreemptionGuard("rl-launch test", 600.0, write=lines.append, hard_exit=_no_hard_exit)
    # an inner region without words of its own keeps the outer one's
    with (  # noqa: PT012
        guard,
        pytest.raises(KeyboardInterrupt),
        guard.abandonable("stopping the start-up now"),
        guard.abandonable(),
    ):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1)
    assert lines == ["rl-launch test: SIGTERM: stopping the start-up now\n"]
    assert guard._stopping is None  # the words end with their region


def test_a_signal_during_the_starting_evaluation_stops_the_loop_before_any_step(monkeypatch):
    use_fake_ray(monkeypatch)
    run = fake_run(config(**{"eval.eval_steps": 2}), eval_prompts=toy_prompts(2))
    engine = run.engines[0]
    original = engine.generate

    def generate(*args, **kwargs):  # the first call is the starting evaluation's
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
        return original(*args, **kwargs)

    engine.generate = generate
    lines: list[str] = []
    from rl_learner import TrainingState

    with (
        PreemptionGuard("rl-launch test", 600.0, write=lines.append, hard_exit=_no_hard_exit) as guard,
        pytest.raises(KeyboardInterrupt),
    ):
        run.trainer.fit(run.tracker, TrainingState(step=0), preemption=guard)
    assert lines == [f"rl-launch test: SIGTERM: {STARTUP_STOP}\n"]
    assert not run.trainer.stepping
    assert run.log.methods("policy").count("policy.train_step") == 0
    assert run.checkpoints == {}


def test_sigterm_while_the_actors_start_stops_the_run_at_once_and_leaves_no_ray(
    tiny_checkpoint, ray_temp, tmp_path, capfd, in_process, monkeypatch
):
    import rl_launch.roles

    assert not ray.is_initialized()  # Ray in this process is the run's own
    ray_dir, _ = ray_temp
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(f'{{"prompt": "What is {i} + 1?", "label": "{i + 1}"}}\n' for i in range(8)))
    original = rl_launch.roles._wait_started

    def wait_started(futures, timeout_s, **kwargs):  # SIGTERM once the actors are asked to start
        os.kill(os.getpid(), signal.SIGTERM)
        return original(futures, timeout_s, **kwargs)

    monkeypatch.setattr(rl_launch.roles, "_wait_started", wait_started)
    assert main(_args(tiny_checkpoint, prompts, ray_dir, tmp_path)) == 143
    out, err = capfd.readouterr()  # the guard writes to the stderr file descriptor itself
    assert "ray: local cluster on 127.0.0.1" in out
    assert "actors ready" not in out  # the start was abandoned, not waited for
    assert f"rl-launch ppo: SIGTERM: {STARTUP_STOP}" in err
    assert "rl-launch ppo: SIGTERM: stopped during start-up, before the first step (nothing to save)" in err
    assert "stopping after the step in flight" not in err
    assert not ray.is_initialized()
    checkpoints = tmp_path / "run" / "checkpoints"
    assert not checkpoints.exists() or not any(checkpoints.iterdir())
