"""A failed actor in words (`rl_launch.diagnosis`), and the loop saving the last finished step
when an engine fails while the learners live (`PPOTrainer.fit` on the in-process fakes)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from ray import exceptions as ray_exceptions

from rl_launch.diagnosis import death_cause, describe_actor_failure, is_actor_failure, log_tail
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


def _dead(actor_id: str) -> BaseException:
    return ray_exceptions.RayActorError(
        actor_id=actor_id,
        error_msg=_DIED.replace(
            "killed by SIGKILL",
            "Worker unexpectedly exits with a connection error code 2. "
            "End of file. Some common causes include: (1) the process was killed",
        ),
    )


@pytest.mark.parametrize(
    ("log", "why"),
    [
        ("policy-0: pid 1 on host\nstep\n", "no error in its log, as SIGKILL ends one"),
        ("policy-0: pid 1 on host\nFatal Python error: Segmentation fault\n\nThread 0x1:\n  File x\n",
         "it crashed (Fatal Python error: Segmentation fault"),
        ("policy-0: pid 1 on host\nTraceback (most recent call last):\n  File x\nMemoryError\n",
         "an uncaught exception ended its process"),
        ("policy-0: pid 1 on host\nTraceback (most recent call last):\n  File x\n"
         "ValueError: To serve at least one request with the model's max seq len (17408), (1.06 GiB KV cache "
         "is needed, which is larger than the available KV cache memory (0.5 GiB). Based on the available "
         "memory, the estimated maximum model length is 8192. Try increasing `gpu_memory_utilization` (which "
         "also controls CPU memory on the CPU backend) or decreasing `max_model_len` when initializing the "
         "engine.\nRuntimeError: Engine core initialization failed. See root cause above.\n",
         "the engine's KV cache cannot hold one sequence of its max_model_len (data.prompt_max_len + "
         "rollout.generate_max_len) tokens (vLLM: To serve at least one request with the model's max seq len "
         "(17408), (1.06 GiB KV cache is needed, which is larger than the available KV cache memory (0.5 GiB). "
         "Based on the available memory, the estimated maximum model length is 8192): raise "
         "rollout.gpu_memory_utilization or rollout.tensor_parallel_size, give "
         "rollout.engine_options.kv_cache_memory_bytes, or lower data.prompt_max_len / rollout.generate_max_len"),
    ],
)  # fmt: skip
def test_why_a_dead_actor_ended_is_read_from_its_log_not_from_rays_guesses(tmp_path, log, why):
    (tmp_path / "policy-0.log").write_text(log)
    error = _dead("abc123")
    assert why in death_cause(error, {"abc123": "policy-0"}, tmp_path)
    _, text = describe_actor_failure(error, {"abc123": "policy-0"}, tmp_path)
    assert "End of file." in text.splitlines()[0]
    assert "Some common causes" not in text
    assert death_cause(error, {}, tmp_path) is None  # an actor of unknown name: no log to read
    assert death_cause(error, {"abc123": "policy-0"}, None) is None
    failed = ray_exceptions.RayTaskError("receive", "Traceback ...", RuntimeError("x"))
    assert death_cause(failed, {"abc123": "policy-0"}, tmp_path) is None  # raised, did not die


def _fail_generation_with(run, error: BaseException, call: int) -> None:
    engine = run.engines[0]
    original = engine.generate

    def generate(*args, **kwargs):
        if len(engine.generated) == call:
            raise error
        return original(*args, **kwargs)

    engine.generate = generate


def test_a_dead_policy_learner_is_not_asked_to_save_and_the_resume_point_is_the_last_checkpoint(
    monkeypatch, tmp_path
):
    from rl_launch import runs

    use_fake_ray(monkeypatch)
    monkeypatch.setattr(sys.modules["ray"], "exceptions", ray_exceptions, raising=False)
    run = fake_run(config(**{"train.max_steps": 4}), ckpt_root=tmp_path / "checkpoints")
    monkeypatch.setattr(run.roles, "actor_names", lambda: {"pol": "policy-0", "eng": "engine-0"})
    # a checkpoint of step 1 on disk, from an earlier start of the run
    chosen = runs.SelectedCheckpoint(
        step=1, folders={"policy": tmp_path / "checkpoints/policy/step_00000001"}
    )
    monkeypatch.setattr(runs, "select_checkpoint", lambda *args, **kwargs: chosen)
    _fail_generation_with(run, _dead("pol"), call=2)  # the loop hears of the death in step 3
    with pytest.raises(ray_exceptions.RayActorError) as raised:
        run.fit()
    assert run.checkpoints == {}  # step 2 was not saved: the toy learner would have, a dead one cannot
    assert run.trainer.lost_state == "policy-0"
    assert run.trainer.saved_after_failure is None
    assert run.trainer.after_failure(raised.value) == [
        "the policy's trained state was in policy-0's process: nothing newer can be saved",
        f"the last checkpoint on disk stays valid: step 1 ({chosen.folders['policy']}); "
        "--ckpt.load_checkpoint true continues from it",
    ]


def test_a_dead_engine_leaves_the_learners_saving_and_the_diagnosis_names_that_step(monkeypatch, tmp_path):
    use_fake_ray(monkeypatch)
    monkeypatch.setattr(sys.modules["ray"], "exceptions", ray_exceptions, raising=False)
    run = fake_run(config(**{"train.max_steps": 4}), ckpt_root=tmp_path / "checkpoints")
    monkeypatch.setattr(run.roles, "actor_names", lambda: {"pol": "policy-0", "eng": "engine-0"})
    _fail_generation_with(run, _dead("eng"), call=2)
    with pytest.raises(ray_exceptions.RayActorError) as raised:
        run.fit()
    assert run.trainer.lost_state is None
    assert run.trainer.after_failure(raised.value) == [
        "checkpoint of step 2 saved: --ckpt.load_checkpoint true continues from it"
    ]


def test_without_a_checkpoint_on_disk_the_diagnosis_says_a_run_starts_from_step_0(monkeypatch, tmp_path):
    use_fake_ray(monkeypatch)
    monkeypatch.setattr(sys.modules["ray"], "exceptions", ray_exceptions, raising=False)
    run = fake_run(config(**{"train.max_steps": 4}), ckpt_root=tmp_path / "checkpoints")
    monkeypatch.setattr(run.roles, "actor_names", lambda: {"pol": "policy-0"})
    _fail_generation_with(run, _dead("pol"), call=2)
    with pytest.raises(ray_exceptions.RayActorError) as raised:
        run.fit()
    assert run.checkpoints == {}
    assert run.trainer.after_failure(raised.value)[-1] == (
        f"no checkpoint in {tmp_path / 'checkpoints'}: a new run starts from step 0 (ckpt.save_steps)"
    )


# ------------------------------------------------ a start-up that waits on a stale build lock


def test_build_locks_are_found_at_both_depths_of_the_extensions_folder_oldest_first(tmp_path):
    import os

    from rl_launch.diagnosis import describe_build_locks, extension_build_locks

    assert extension_build_locks(str(tmp_path)) == []
    assert describe_build_locks([]) == ""
    (tmp_path / "deepspeed_shm_comm").mkdir()  # TORCH_EXTENSIONS_DIR/<op>/lock
    (tmp_path / "deepspeed_shm_comm" / "lock").write_text("")
    (tmp_path / "py311_cpu" / "fused_adam").mkdir(parents=True)  # torch's default root/<py_dev>/<op>/lock
    (tmp_path / "py311_cpu" / "fused_adam" / "lock").write_text("")
    (tmp_path / "py311_cpu" / "fused_adam" / "fused_adam.so").write_text("")  # built ops are not locks
    os.utime(tmp_path / "py311_cpu" / "fused_adam" / "lock", (1, 1))
    locks = extension_build_locks(str(tmp_path))
    assert [path for path, _ in locks] == [
        str(tmp_path / "py311_cpu" / "fused_adam" / "lock"),
        str(tmp_path / "deepspeed_shm_comm" / "lock"),
    ]
    assert locks[0][1] > locks[1][1] >= 0
    text = describe_build_locks(locks)
    assert text.startswith(f"torch extension build locks {locks[0][0]} (")
    assert "a build killed midway leaves it" in text
    assert "delete the file" in text


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc to see a lock's holder")
def test_a_build_lock_that_a_live_process_holds_open_is_a_running_build_and_not_named(tmp_path):
    # torch's build lock (FileBaton) stays open in its holder while the op compiles: the start-up's
    # line told a new user to consider deleting the lock of a compiler that was running.
    import subprocess

    from rl_launch.diagnosis import extension_build_locks

    lock = tmp_path / "cpu_adam" / "lock"
    lock.parent.mkdir()
    lock.write_text("")
    holder = subprocess.Popen([sys.executable, "-c", HOLD_OPEN, str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        assert extension_build_locks(str(tmp_path)) == []
    finally:
        holder.kill()
        holder.wait()
    assert [path for path, _ in extension_build_locks(str(tmp_path))] == [str(lock)]  # its holder died


HOLD_OPEN = (
    "import os, sys, time; os.open(sys.argv[1], os.O_RDONLY); print('holding', flush=True); time.sleep(600)"
)


def test_a_start_up_still_waiting_names_a_build_lock_on_stderr_and_in_the_timeout_error(
    tmp_path, monkeypatch, capsys
):
    import ray

    from rl_launch import roles
    from rl_launch.cluster import ClusterError

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    (tmp_path / "deepspeed_shm_comm").mkdir()
    (tmp_path / "deepspeed_shm_comm" / "lock").write_text("")
    waits = []

    def wait(futures, num_returns, timeout):  # ray.wait: the first slice leaves one call out
        waits.append(timeout)
        if len(waits) == 1:
            return futures[:1], futures[1:]
        return (list(futures), []) if finish else ([], list(futures))

    monkeypatch.setattr(ray, "wait", wait)
    monkeypatch.setattr(ray, "get", lambda done: [None for _ in done])
    finish = True  # the learner gets the lock after all (a build that was running): no error
    roles._wait_started(["engine", "policy"], 600.0, check_after_s=60.0)
    assert waits[0] == 60.0
    assert 599.0 < waits[1] <= 600.0
    err = capsys.readouterr().err
    assert err.startswith("rl-launch: 1 actor calls still starting after 60 s; torch extension build lock ")
    assert str(tmp_path / "deepspeed_shm_comm" / "lock") in err
    waits.clear()
    finish = False  # it never does: the timeout's error names the lock too
    with pytest.raises(
        ClusterError,
        match=r"1 actor calls did not finish within ray\.startup_timeout_s = 600 s; torch extension build lock .*deepspeed_shm_comm/lock",
    ):
        roles._wait_started(["engine", "policy"], 600.0, check_after_s=60.0)
    (tmp_path / "deepspeed_shm_comm" / "lock").unlink()
    capsys.readouterr()
    waits.clear()
    with pytest.raises(ClusterError, match=r"= 600 s$"):  # no lock: the error says only the timeout
        roles._wait_started(["engine", "policy"], 600.0, check_after_s=60.0)
    assert capsys.readouterr().err == ""
