"""SIGTERM / Ctrl-C: the guard's rules (`rl_launch.preemption`) and the step loop that applies them.

The loop runs on the in-process toy actors (`tests/launch/fakes.py`); the signal is sent to this
process from inside a toy engine's generate call or a toy learner's train step, so it lands in the
phase under test. The e2e counterparts (a real `rl-launch ppo` / `sft` sent SIGTERM) are in
test_preemption_e2e.py.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import msgspec
import pytest

from rl_launch.preemption import Preempted, PreemptionGuard
from tests.launch.fakes import fake_run, use_fake_ray
from tests.launch.test_step_loop import config, training_calls


@pytest.fixture(autouse=True)
def _no_ray(monkeypatch):
    use_fake_ray(monkeypatch)


def _guard(lines: list[str] | None = None, timeout_s: float = 600.0) -> PreemptionGuard:
    return PreemptionGuard(
        "rl-launch test",
        timeout_s,
        write=(lines if lines is not None else []).append,
        hard_exit=_no_hard_exit,
    )


def _send(signum: int) -> None:
    """Send `signum` to this process and give its handler the time to run."""
    os.kill(os.getpid(), signum)
    time.sleep(1)


def _no_hard_exit(code: int) -> None:
    raise AssertionError(f"hard exit {code}")


def _signal_on_generate(run, call: int, signum: int = signal.SIGTERM) -> None:
    """Send `signum` to this process during the engine's `call`-th generate call (1-based)."""
    engine = run.engines[0]
    original = engine.generate

    def generate(*args, **kwargs):
        if len(engine.generated) + 1 == call:
            os.kill(os.getpid(), signum)
            time.sleep(0.01)  # the handler runs here, in the engine's call
        return original(*args, **kwargs)

    engine.generate = generate


def _signal_on_train_step(run, update: int, signum: int = signal.SIGTERM) -> None:
    """Send `signum` during the policy learner's `update`-th train step (1-based)."""
    learner = run.learners["policy"][0]
    original = learner.train_step

    def train_step(*args, **kwargs):
        result = original(*args, **kwargs)
        if learner.updates == update:
            os.kill(os.getpid(), signum)
        return result

    learner.train_step = train_step


def _saved_state(run, root: str, step: int) -> dict:
    state, _ = run.checkpoints[(f"{root}/policy", f"global_step{step}", 0)]
    return msgspec.json.decode(state)


# ----------------------------------------------------------------------------------------------
# The guard


def test_the_first_signal_asks_to_stop_and_the_second_stops_at_once():
    lines: list[str] = []
    with _guard(lines) as guard:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
        assert guard.requested
        assert not guard.forced
        assert guard.exit_code == 143
        assert "SIGTERM" in lines[0]
        assert "ckpt.preemption_timeout_s" in lines[0]
        with pytest.raises(KeyboardInterrupt):
            _send(signal.SIGINT)
        assert guard.forced
    assert signal.getsignal(signal.SIGTERM) is not guard._handle  # handed back


def test_sigint_exits_130_and_a_signal_inside_an_abandonable_region_raises_at_once():
    with _guard() as guard, pytest.raises(KeyboardInterrupt), guard.abandonable():  # noqa: PT012
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1)
    assert guard.exit_code == 130
    assert not guard.forced


def test_past_the_timeout_the_main_thread_is_interrupted():
    lines: list[str] = []
    with _guard(lines, timeout_s=0.2) as guard:
        os.kill(os.getpid(), signal.SIGTERM)
        with pytest.raises(KeyboardInterrupt):
            time.sleep(5)
    assert guard.forced
    assert guard.timed_out
    assert "did not finish within ckpt.preemption_timeout_s = 0.2 s" in lines[-1]


def test_the_timeout_must_be_positive():
    with pytest.raises(ValueError, match="timeout_s"):
        PreemptionGuard("rl-launch test", 0)


# ----------------------------------------------------------------------------------------------
# The loop


def test_a_signal_during_generation_abandons_the_step_and_saves_the_last_finished_one():
    whole = fake_run(config(**{"ckpt.save_steps": 1}), ckpt_root="/a/checkpoints")
    whole.fit()
    run = fake_run(config(), ckpt_root="/b/checkpoints")
    _signal_on_generate(run, call=2)
    with _guard() as guard, pytest.raises(Preempted) as stopped:
        run.trainer.fit(run.tracker, _start(), preemption=guard)
    assert (stopped.value.step, stopped.value.saved, stopped.value.exit_code) == (1, True, 143)
    assert run.tracker.steps() == [1]
    assert run.learners["policy"][0].updates == 1  # step 2 never trained
    assert sorted(tag for _, tag, _ in run.checkpoints) == ["global_step1"]
    # the same state an uninterrupted run saves at step 1 (loader position, group ids, version)
    assert (
        _saved_state(run, "/b/checkpoints", 1)["data_state"]
        == _saved_state(whole, "/a/checkpoints", 1)["data_state"]
    )
    for key in ("step", "consumed_samples", "policy_version"):
        assert _saved_state(run, "/b/checkpoints", 1)[key] == _saved_state(whole, "/a/checkpoints", 1)[key]
    assert _saved_state(run, "/b/checkpoints", 1)["extra"]["next_group_id"] == 2


def test_a_signal_during_training_finishes_the_step_then_saves_it():
    run = fake_run(config(**{"train.max_steps": 4}), ckpt_root="/b/checkpoints")
    _signal_on_train_step(run, update=2)
    with _guard() as guard, pytest.raises(Preempted) as stopped:
        run.trainer.fit(run.tracker, _start(), preemption=guard)
    assert (stopped.value.step, stopped.value.saved) == (2, True)
    assert run.tracker.steps() == [1, 2]
    assert [call["version"] for call in training_calls(run)] == [0, 1]  # step 3 never started
    assert sorted(tag for _, tag, _ in run.checkpoints) == ["global_step2"]


def test_a_step_saved_by_save_steps_is_not_saved_twice():
    run = fake_run(config(**{"train.max_steps": 4, "ckpt.save_steps": 2}), ckpt_root="/b/checkpoints")
    _signal_on_train_step(run, update=2)
    with _guard() as guard, pytest.raises(Preempted) as stopped:
        run.trainer.fit(run.tracker, _start(), preemption=guard)
    assert (stopped.value.step, stopped.value.saved) == (2, True)
    assert run.log.methods("policy").count("policy.save") == 1


def test_a_signal_in_the_first_step_saves_nothing():
    run = fake_run(config(), ckpt_root="/b/checkpoints")
    _signal_on_generate(run, call=1)
    with _guard() as guard, pytest.raises(Preempted) as stopped:
        run.trainer.fit(run.tracker, _start(), preemption=guard)
    assert (stopped.value.step, stopped.value.saved) == (0, False)
    assert run.checkpoints == {}
    assert "nothing to save" in str(stopped.value)


def test_a_second_signal_stops_without_saving():
    run = fake_run(config(**{"train.max_steps": 4}), ckpt_root="/b/checkpoints")
    _signal_on_train_step(run, update=2)
    learner = run.learners["policy"][0]
    original_save = learner.save

    def save_then_signal(*args, **kwargs):  # the second signal arrives while the checkpoint is written
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
        return original_save(*args, **kwargs)

    learner.save = save_then_signal
    with _guard() as guard, pytest.raises(KeyboardInterrupt):
        run.trainer.fit(run.tracker, _start(), preemption=guard)
    assert guard.forced
    assert guard.exit_code == 143
    assert run.checkpoints == {}


@pytest.mark.parametrize("async_train", [False, True])
def test_a_run_preempted_in_generation_and_resumed_trains_like_an_uninterrupted_one(async_train):
    settings = {"rollout.async_train": str(async_train).lower(), "train.max_steps": 4}
    whole = fake_run(config(**settings), ckpt_root="/a/checkpoints")
    whole.fit()

    first = fake_run(config(**settings), ckpt_root="/b/checkpoints")
    # async: generate calls 1, 2 are steps 1 and 2 (ahead); call 3 is step 3, submitted in step 2
    _signal_on_generate(first, call=3)
    with _guard() as guard, pytest.raises(Preempted) as stopped:
        first.trainer.fit(first.tracker, _start(), preemption=guard)
    saved = stopped.value.step
    assert stopped.value.saved
    assert saved in (1, 2)
    state = _saved_state(first, "/b/checkpoints", saved)
    if async_train:
        assert [entry["step"] for entry in state["extra"]["in_flight"]] == [saved + 1]

    resumed = fake_run(
        config(**settings),
        ckpt_root="/b/checkpoints",
        resume_from={"policy": Path(f"/b/checkpoints/policy/global_step{saved}")},
        checkpoints=first.checkpoints,
    )
    start = resumed.trainer.resume()
    assert start.step == saved
    resumed.fit(start)

    def without_version(calls):
        return [{key: value for key, value in call.items() if key != "version"} for call in calls]

    assert without_version(training_calls(resumed)) == without_version(training_calls(whole)[saved:])
    assert resumed.learners["policy"][0].trained == whole.learners["policy"][0].trained[saved:]
    assert resumed.tracker.steps() == list(range(saved + 1, 5))


def _start():
    from rl_learner import TrainingState

    return TrainingState(step=0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_run_preempted_again_and_again_ends_where_an_uninterrupted_one_does(seed):
    """Chaos on the fakes: SIGTERM at a random generation or train step, resume, repeat."""
    import random

    settings = {"train.max_steps": 6, "ckpt.max_ckpt_num": 100}
    whole = fake_run(config(**settings), ckpt_root="/a/checkpoints")
    whole.fit()
    rng = random.Random(seed)
    store: dict = {}
    logged: dict[int, dict] = {}
    trained: list = []
    saved, preemptions = 0, 0
    while saved < 6:
        resume = {"policy": Path(f"/b/checkpoints/policy/global_step{saved}")} if saved else None
        run = fake_run(config(**settings), ckpt_root="/b/checkpoints", resume_from=resume, checkpoints=store)
        start = run.trainer.resume() if saved else _start()
        remaining = 6 - saved
        if preemptions < 4 and remaining > 1:
            if rng.random() < 0.5:
                _signal_on_generate(run, call=rng.randint(1, remaining))
            else:
                _signal_on_train_step(run, update=rng.randint(1, remaining))
        try:
            with _guard() as guard:
                run.trainer.fit(run.tracker, start, preemption=guard)
            saved = 6
        except Preempted as stop:
            preemptions += 1
            saved = max(saved, stop.step)
        for step, metrics in run.tracker.logged:
            logged[step] = metrics
        trained += run.learners["policy"][0].trained
    assert preemptions >= 1

    def steady(metrics):
        return {key: value for key, value in metrics.items() if not key.startswith(("time/", "throughput/"))}

    assert sorted(logged) == list(range(1, 7))
    assert [steady(logged[step]) for step in range(1, 7)] == [
        steady(metrics) for _, metrics in whole.tracker.logged
    ]
    # no update is lost or repeated: a preemption abandons a step only before it trains
    assert trained == whole.learners["policy"][0].trained


# ----------------------------------------------------------------------------- durability defaults


def test_defaults_save_every_30_minutes_and_stop_within_kubernetes_grace():
    from rl_launch.config import CheckpointConfig

    defaults = CheckpointConfig()
    assert defaults.save_steps == -1
    assert defaults.save_minutes == 30.0
    assert defaults.preemption_timeout_s == 25.0 < 30.0  # Kubernetes' default grace period
    assert not defaults.save_due(7, seconds_since_save=29 * 60)
    assert defaults.save_due(7, seconds_since_save=30 * 60)
    every_two = CheckpointConfig(save_steps=2, save_minutes=None)
    assert [every_two.save_due(step, 10**9) for step in (1, 2, 3, 4)] == [False, True, False, True]


def test_a_time_based_checkpoint_is_saved_with_save_steps_minus_one():
    timed = fake_run(config(**{"train.max_steps": 3, "ckpt.save_minutes": 1e-9}), ckpt_root="/t/checkpoints")
    timed.fit()
    assert sorted(tag for _, tag, _ in timed.checkpoints) == ["global_step1", "global_step2", "global_step3"]
    off = fake_run(config(**{"train.max_steps": 3, "ckpt.save_minutes": "null"}), ckpt_root="/u/checkpoints")
    off.fit()
    assert sorted(tag for _, tag, _ in off.checkpoints) == ["global_step3"]
