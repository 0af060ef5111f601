"""The launch tests' forked Ray workers (tests/launch/worker_zygote.py and worker_shim.py): the shim
the raylet starts hands a worker's command line, environment, folder and streams to the zygote and
stands for the forked worker (its exit code, the signals it gets, its death); a worker the zygote
cannot serve (another environment, no zygote) runs as `python default_worker.py` would. Here the
"worker" is a small script in place of Ray's default_worker.py, and the zygote preloads `csv`
only; test_ppo_runs' forked run shows Ray's own workers forked."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.launch.launching import actor_pid, launch, read_metrics, write_sum_prompts
from tests.launch.worker_zygote import SHIM, WorkerZygote, runtime_env_hook, worker_zygote

WORKER = """
import json, os, random, signal, sys, time
if sys.argv[1] == "trap":
    signal.signal(signal.SIGTERM, lambda number, frame: sys.exit(7))
print(json.dumps({"pid": os.getpid(), "argv": sys.argv, "cwd": os.getcwd(), "probe": os.environ.get("RAY_PROBE"),
                  "path0": sys.path[0], "random": random.random(), "preloaded": "csv" in sys.modules}), flush=True)
if sys.argv[1] in ("sleep", "trap"):
    time.sleep(300)
sys.exit(int(sys.argv[1]))
"""


@pytest.fixture(scope="module")
def zygote():
    started = WorkerZygote(dict(os.environ, PROBE_ZYGOTE="1"), preload=("csv",))
    started.ready()
    yield started
    started.close()


def _worker_script(tmp_path) -> str:
    path = tmp_path / "default_worker.py"
    path.write_text(WORKER)
    return str(path)


def _shim(zygote, script: str, arg: str, **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-I", "-S", str(SHIM), zygote.path, script, arg],
        env=dict(os.environ, PROBE_ZYGOTE="1", **env),
        cwd=os.path.dirname(script),
        stdout=subprocess.PIPE,
        text=True,
    )


def _report(process: subprocess.Popen) -> dict:
    return json.loads(process.stdout.readline())


def test_a_forked_worker_runs_the_script_with_the_shims_arguments_environment_and_exit_code(zygote, tmp_path):
    script = _worker_script(tmp_path)
    first = _shim(zygote, script, "3", RAY_PROBE="first")  # Ray's variables may differ per worker
    report = _report(first)
    assert first.wait(60) == 3
    assert report["pid"] != first.pid
    assert report["pid"] in zygote.forked()
    assert report["argv"] == [script, "3"]
    assert report["cwd"] == str(tmp_path)
    assert report["probe"] == "first"
    assert report["path0"] == str(tmp_path)
    assert report["preloaded"]
    second = _shim(zygote, script, "0", RAY_PROBE="second")
    assert _report(second)["random"] != report["random"]  # seeded afresh
    assert second.wait(60) == 0


def test_signals_to_the_shim_reach_the_worker_and_the_shim_ends_as_the_worker_did(zygote, tmp_path):
    process = _shim(zygote, _worker_script(tmp_path), "trap")
    _report(process)
    process.send_signal(signal.SIGTERM)  # the worker's handler exits 7
    assert process.wait(60) == 7

    process = _shim(zygote, _worker_script(tmp_path), "sleep")
    worker = _report(process)["pid"]
    process.send_signal(signal.SIGTERM)
    assert process.wait(60) == -signal.SIGTERM
    assert not _alive(worker)

    process = _shim(zygote, _worker_script(tmp_path), "sleep")
    os.kill(_report(process)["pid"], signal.SIGKILL)  # as the chaos tests kill an actor
    assert process.wait(60) == -signal.SIGKILL


def test_a_worker_dies_with_its_shim(zygote, tmp_path):
    process = _shim(zygote, _worker_script(tmp_path), "sleep")
    worker = _report(process)["pid"]
    assert worker in zygote.workers()
    process.kill()  # the raylet's SIGKILL reaches the process it started
    process.wait(60)
    deadline = time.monotonic() + 60
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(worker)


def test_a_worker_of_another_environment_or_without_a_zygote_runs_unforked(zygote, tmp_path):
    script = _worker_script(tmp_path)
    process = _shim(zygote, script, "4", OTHER="1")
    report = _report(process)
    assert process.wait(60) == 4
    assert report["pid"] == process.pid
    assert not report["preloaded"]
    assert any(line.startswith(f"{process.pid}: variables ['OTHER']") for line in zygote.fallbacks())

    process = subprocess.Popen(
        [sys.executable, "-I", "-S", str(SHIM), str(tmp_path / "socket"), script, "5"],
        stdout=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
    )
    assert _report(process)["pid"] == process.pid
    assert process.wait(60) == 5
    assert "FileNotFoundError" in (tmp_path / "fallbacks.log").read_text()


def test_the_hook_gives_a_job_the_shim_unless_it_names_a_python(monkeypatch):
    monkeypatch.delenv("RL_TESTS_WORKER_ZYGOTE", raising=False)
    assert runtime_env_hook({"env_vars": {"A": "1"}}) == {"env_vars": {"A": "1"}}
    monkeypatch.setenv("RL_TESTS_WORKER_ZYGOTE", "/tmp/rlw-x/socket")
    assert runtime_env_hook(None) == {"py_executable": f"{sys.executable} -I -S {SHIM} /tmp/rlw-x/socket"}
    assert runtime_env_hook({"py_executable": "python3"}) == {"py_executable": "python3"}


def test_a_shim_waits_for_a_starting_zygote_and_goes_on_without_one_that_refuses(tmp_path):
    script = _worker_script(tmp_path)
    starting = WorkerZygote(dict(os.environ, PROBE_ZYGOTE="1"), preload=("csv",)).start()
    try:
        process = _shim(starting, script, "0")  # asks before the zygote listens
        assert _report(process)["pid"] in starting.forked()
        assert process.wait(60) == 0
    finally:
        starting.close()

    refused = WorkerZygote(dict(os.environ, PROBE_ZYGOTE="1"), preload=("ray",)).start()
    try:
        process = _shim(refused, script, "0")
        assert _report(process)["pid"] == process.pid
        assert process.wait(60) == 0
        with pytest.raises(RuntimeError, match="ray imported: True"):
            refused.ready()
    finally:
        refused.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0] != "Z"


def _minimal_run(checkpoint, prompts, run_dir, ray_args: list[str]) -> list[str]:
    return [
        "--model.pretrain", str(checkpoint),
        "--data.prompt_data", str(prompts),
        "--reward.function", "numeric",
        "--algo.advantage.estimator", "grpo",
        "--rollout.engine", "hf",
        "--rollout.n_samples_per_prompt", "2",
        "--rollout.rollout_batch_size", "4",
        "--rollout.generate_max_len", "4",
        "--train.max_steps", "2",
        "--log.output_dir", str(run_dir),
        "--log.progress_bar", "false",
        *ray_args,
    ]  # fmt: skip


@pytest.mark.slow
def test_the_actors_of_a_run_are_forked_and_a_run_of_another_environment_falls_back(
    tiny_checkpoint, shared_ray, joined_ray, ray_temp, tmp_path
):
    if os.environ.get("RL_TESTS_FORKED_WORKERS") == "0":
        pytest.skip("RL_TESTS_FORKED_WORKERS=0")
    shared_ray.worker_zygote.ready()
    prompts = write_sum_prompts(tmp_path / "prompts.jsonl", 8)
    ray_args, env = joined_ray
    result = launch(_minimal_run(tiny_checkpoint, prompts, tmp_path / "joined", ray_args), env)
    assert result.returncode == 0, result.stderr[-3000:]
    forked = set(shared_ray.worker_zygote.forked())
    assert {actor_pid(tmp_path / "joined", name) for name in ("policy-0", "engine-0")} <= forked

    zygote = worker_zygote()  # the one for this process's environment now
    zygote.ready()
    temp_dir, local_env = ray_temp  # a local Ray inherits the driver's environment, one more variable
    local_env = {**local_env, "RL_TESTS_PROBE": "1"}
    result = launch(
        _minimal_run(tiny_checkpoint, prompts, tmp_path / "local", ["--ray.temp_dir", temp_dir]), local_env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert [line["step"] for line in read_metrics(tmp_path / "local")] == [1, 2]
    unforked = {actor_pid(tmp_path / "local", name) for name in ("policy-0", "engine-0")}
    assert not unforked & set(zygote.forked())
    assert all(
        any(line.startswith(f"{pid}: variables ['RL_TESTS_PROBE']") for line in zygote.fallbacks())
        for pid in unforked
    )
