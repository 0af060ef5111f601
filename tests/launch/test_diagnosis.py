"""A failed actor in words (`rl_launch.diagnosis`), and the loop saving the last finished step
when an engine fails while the learners live (`PPOTrainer.fit` on the in-process fakes)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from ray import exceptions as ray_exceptions

from rl_launch.diagnosis import describe_actor_failure, is_actor_failure, log_tail
from tests.launch.fakes import fake_run, use_fake_ray
from tests.launch.test_step_loop import config

_DIED = (
    "The actor died unexpectedly before finishing this task.\n\tclass_name: RolloutWorker\n"
    "\tactor_id: abc123\n\tpid: 4321\n\tip: 10.0.0.5\n"
    "The actor is dead because its worker process has died. Worker exit type: UNEXPECTED_SYSTEM_EXIT "
    "Worker exit detail: killed by SIGKILL"
)


def test_a_dead_engine_is_named_with_its_log_path_last_lines_and_rays_reason(tmp_path):
    (tmp_path / "engine-0.log").write_text("engine-0: pid 4321 on host\n\nloading\nout of memory\n")
    error = ray_exceptions.RayActorError(actor_id="abc123", error_msg=_DIED)
    assert is_actor_failure(error)
    name, text = describe_actor_failure(error, {"abc123": "engine-0", "def": "policy-0"}, tmp_path, tail=2)
    assert name == "engine-0"
    lines = text.splitlines()
    assert lines[0].startswith("engine-0 died: The actor died unexpectedly")
    assert "pid: 4321 ip: 10.0.0.5" in lines[0]
    assert "killed by SIGKILL" in lines[0]
    assert "actor_id" not in lines[0]
    assert lines[1] == f"  its log: {tmp_path.resolve() / 'engine-0.log'}, last lines:"
    assert lines[2:] == ["    loading", "    out of memory"]


def test_an_unknown_actor_and_a_console_log_are_said_so():
    error = ray_exceptions.RayActorError(actor_id="zzz", error_msg="The actor died.")
    name, text = describe_actor_failure(error, {}, None)
    assert name is None
    assert text.splitlines() == [
        "a Ray actor died: The actor died.",
        "  its output went to this console (log.actor_output console)",
    ]
    assert not is_actor_failure(RuntimeError("x"))
    assert log_tail(Path("/nonexistent/log")) == []


def test_an_engine_failing_in_generation_leaves_a_checkpoint_of_the_last_finished_step(monkeypatch):
    use_fake_ray(monkeypatch)
    monkeypatch.setattr(sys.modules["ray"], "exceptions", ray_exceptions, raising=False)
    run = fake_run(config(**{"train.max_steps": 4}), ckpt_root="/b/checkpoints")
    engine = run.engines[0]
    original = engine.generate

    def generate(*args, **kwargs):
        if len(engine.generated) == 2:
            raise ray_exceptions.RayActorError(actor_id="abc", error_msg="The actor died.")
        return original(*args, **kwargs)

    engine.generate = generate
    with pytest.raises(ray_exceptions.RayActorError):
        run.fit()
    assert run.trainer.saved_after_failure == 2
    assert sorted(tag for _, tag, _ in run.checkpoints) == ["global_step2"]
    assert run.tracker.steps() == [1, 2]
