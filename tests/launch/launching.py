"""Helpers of the launcher tests: run the real CLI, read a run's metrics, find Ray processes."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import random
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from tests.launch.worker_zygote import start_worker_zygote, worker_zygote


def launcher_env(**extra: str) -> dict[str, str]:
    """The test environment plus a Ray auth token held in a variable (Ray then writes no token
    file), and the variables that have the runs' Ray workers forked from this test process's
    `worker_zygote` (RL_TESTS_FORKED_WORKERS=0: started as `python default_worker.py`)."""
    env = dict(os.environ)
    env.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(16))
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    zygote = worker_zygote()
    env.update(zygote.env_vars if zygote else {})
    env.update(extra)
    return env


def ray_processes(temp_dir: str) -> dict[int, str]:
    """pid -> command line of live processes that mention `temp_dir` (the daemons of that Ray session)."""
    found = {}
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if temp_dir in command and int(entry.name) != os.getpid():
            found[int(entry.name)] = command
    return found


@contextlib.contextmanager
def ray_temp_dir():
    """(temp folder, env) for one run's local Ray; the folder is removed at the end, and an
    AssertionError says so when a Ray process of that run outlived the block."""
    temp_dir = tempfile.mkdtemp(prefix="rlt-", dir="/tmp")  # unix socket paths must stay short
    env = launcher_env()
    start_worker_zygote(env)  # a run of this Ray follows
    try:
        yield temp_dir, env
    finally:
        leftovers = ray_processes(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert not leftovers, f"Ray processes outlived the run: {leftovers}"


def kill_processes(pids: list[int]) -> None:
    """SIGKILL `pids` (those still alive)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def start_driver(command: str, args: list[str], env: dict[str, str], *, capture: bool = True):
    """Start `rl-launch <command> <args>` in a session of its own, its output captured (text) or
    dropped; a `subprocess.Popen` or, by default, a `driver_zygote.ForkedDriver` (the same CLI
    forked from a process that has its imports done: RL_TESTS_FORKED_DRIVERS=0 starts each driver
    as `python -m rl_launch.cli` instead)."""
    start_worker_zygote(env)
    if os.environ.get("RL_TESTS_FORKED_DRIVERS", "1") != "0":
        from tests.launch.driver_zygote import forked_driver

        return forked_driver([command, *args], env, capture=capture)
    stream = subprocess.PIPE if capture else subprocess.DEVNULL
    return subprocess.Popen(
        [sys.executable, "-m", "rl_launch.cli", command, *args],
        env=env,
        stdout=stream,
        stderr=stream,
        text=True,
        start_new_session=True,
    )


def stop_driver(process) -> None:
    """SIGKILL a driver started by `start_driver` and its process group, if it still runs."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.kill()  # in case it had not yet made its group
        process.wait()


def launch(
    args: list[str], env: dict[str, str], *, timeout: float = 900, command: str = "ppo"
) -> subprocess.CompletedProcess:
    """Run `rl-launch <command> <args>` to completion (`start_driver`); the completed process
    (stdout and stderr text). Past `timeout` seconds the driver is killed and TimeoutExpired raised."""
    process = start_driver(command, args, env)
    try:
        out, err = process.communicate(timeout=timeout)
    finally:
        stop_driver(process)
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def read_metrics(run_dir: pathlib.Path) -> list[dict]:
    """The lines of a run's metrics.jsonl."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def write_sum_prompts(path: pathlib.Path, count: int) -> pathlib.Path:
    """A JSONL prompt file of `count` rows {"prompt": "What is a + b?", "label": "a+b"} (a, b < 10,
    seed 0), the tasks of the e2e runs; returns `path`."""
    rng = random.Random(0)
    with path.open("w") as file:
        for _ in range(count):
            a, b = rng.randrange(10), rng.randrange(10)
            file.write(json.dumps({"prompt": f"What is {a} + {b}?", "label": str(a + b)}) + "\n")
    return path


def kill_once_written(args: list[str], env: dict[str, str], marker: pathlib.Path, ray_dir: str) -> None:
    """Start `rl-launch ppo <args>`, SIGKILL it (its process group and its local Ray's daemons) as
    soon as `marker` exists; fails if the run ends first or takes over 10 minutes."""
    process = start_driver("ppo", args, env, capture=False)
    deadline = time.monotonic() + 600
    while not marker.exists():
        assert process.poll() is None, "the run ended before it could be killed"
        assert time.monotonic() < deadline, f"{marker} did not appear within 10 minutes"
        time.sleep(0.05)
    stop_driver(process)  # the driver and the local Ray it started
    kill_processes(list(ray_processes(ray_dir)))  # Ray daemons outside the process group, if any


def signal_after_step(
    command: str,
    args: list[str],
    env: dict[str, str],
    run_dir: pathlib.Path,
    step: int,
    signum: int = signal.SIGTERM,
    *,
    timeout: float = 600,
) -> tuple[subprocess.CompletedProcess, float]:
    """Start `rl-launch <command> <args>`, send `signum` to it (the driver only, as a cluster does)
    once `run_dir/metrics.jsonl` holds step `step`, wait for it to exit; (the completed process,
    seconds from the signal to the exit). Fails if the run ends before that step."""
    process = start_driver(command, args, env)
    metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + timeout
    try:
        while not (metrics.exists() and any(line["step"] >= step for line in read_metrics(run_dir))):
            if process.poll() is not None:
                out, err = process.communicate()
                raise AssertionError(f"the run ended before step {step}: {err[-4000:]}")
            assert time.monotonic() < deadline, f"step {step} did not appear within {timeout} s"
            time.sleep(0.05)
        sent = time.monotonic()
        process.send_signal(signum)
        out, err = process.communicate(timeout=timeout)
        return subprocess.CompletedProcess(
            process.args, process.returncode, out, err
        ), time.monotonic() - sent
    finally:
        stop_driver(process)


# Metrics that measure time, or depend on it, differ between any two runs.
TIMING_KEYS = ("time/", "throughput/", "sync/seconds")


def comparable(line: dict) -> dict:
    """A metrics line without its wall-clock time and timing keys (`TIMING_KEYS`): what two runs
    of the same arguments log alike."""
    return {key: value for key, value in line.items() if key != "time" and not key.startswith(TIMING_KEYS)}


def actor_pids(run_dir: pathlib.Path, name: str) -> list[int]:
    """The pids an actor wrote into its log, one line per start ("policy-0: pid 4321 on host"),
    oldest first (a resumed run appends to the same log)."""
    import re

    path = run_dir / "logs" / f"{name}.log"
    found = [int(pid) for pid in re.findall(rf"^{re.escape(name)}: pid (\d+)", path.read_text(), re.M)]
    assert found, f"no '{name}: pid N' line in {path}"
    return found


def actor_pid(run_dir: pathlib.Path, name: str) -> int:
    """The pid of the actor's latest start (`actor_pids`)."""
    return actor_pids(run_dir, name)[-1]


def interrupt_after_step(
    args: list[str],
    env: dict[str, str],
    run_dir: pathlib.Path,
    step: int,
    target: str,
    *,
    delay_s: float = 0.0,
    timeout: float = 600,
) -> tuple[subprocess.CompletedProcess, float | None]:
    """Start `rl-launch ppo <args>`; once `run_dir/metrics.jsonl` holds step `step` and `delay_s`
    more seconds passed, stop `target`: "driver" (SIGTERM to the driver, as a cluster preempts a
    job) or an actor's name ("engine-0", "policy-0": SIGKILL to its process, as the OOM killer
    does). Waits for the run to exit; (the completed process, seconds from the signal to the
    exit, None when the run had ended before the signal). Fails if the run ends before `step`."""
    process = start_driver("ppo", args, env)
    metrics, deadline, sent = run_dir / "metrics.jsonl", time.monotonic() + timeout, None
    try:
        while not (metrics.exists() and any(line["step"] >= step for line in read_metrics(run_dir))):
            if process.poll() is not None:
                out, err = process.communicate()
                raise AssertionError(
                    f"the run ended (exit {process.returncode}) before step {step}: {err[-4000:]}"
                )
            assert time.monotonic() < deadline, f"step {step} did not appear within {timeout} s"
            time.sleep(0.02)
        time.sleep(delay_s)
        if process.poll() is None:
            sent = time.monotonic()
            if target == "driver":
                process.send_signal(signal.SIGTERM)
            else:
                os.kill(actor_pid(run_dir, target), signal.SIGKILL)
        out, err = process.communicate(timeout=timeout)
        seconds = time.monotonic() - sent if sent is not None else None
        return subprocess.CompletedProcess(process.args, process.returncode, out, err), seconds
    finally:
        stop_driver(process)


# A Ray cluster that the runs of one test session join --------------------------------------------

_HOLD_CLUSTER = """
import sys, logging, ray
ray.init(address="local", num_cpus=int(sys.argv[2]), _node_ip_address="127.0.0.1", include_dashboard=False,
         _temp_dir=sys.argv[1], logging_level=logging.WARNING, log_to_driver=False)
print(ray.get_runtime_context().gcs_address, flush=True)
sys.stdin.read()  # until the session closes it
"""


_RAYLET_OWN = ("ray::IDLE", "ray::DashboardAgent", "ray::RuntimeEnvAgent")  # no run's actors


class SharedRay:
    """A local Ray bound to 127.0.0.1 that the runs of one test session (one xdist worker) join with
    `--ray.address` (`args`, `env`), as runs join a cluster a user started: each run's driver and
    actors start as usual, the cluster's daemons once (~3 CPU-s and ~2 s of every run).

    A process of its own holds it (the driver that started it, until `close`), with token
    authentication (the token in `env`) and no idle workers. Runs that test a local Ray's own
    start, stop and leftovers keep `ray_temp`.
    """

    def __init__(self, num_cpus: int = 32) -> None:
        self.temp_dir = tempfile.mkdtemp(prefix="rls-", dir="/tmp")  # unix socket paths must stay short
        self.worker_zygote = worker_zygote(pin=True)  # its runs' workers fork from it (None: not)
        self.env = launcher_env(RAY_AUTH_MODE="token", RAY_prestart_worker_first_driver="0")
        if self.worker_zygote is not None:
            self.worker_zygote.start()
        errors = pathlib.Path(self.temp_dir) / "holder.err"
        with errors.open("w") as stderr:
            self.holder = subprocess.Popen(
                [sys.executable, "-c", _HOLD_CLUSTER, self.temp_dir, str(num_cpus)],
                env=self.env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
            )
        address = self.holder.stdout.readline().strip()
        if not address:
            self.close()
            raise RuntimeError(f"the shared Ray did not start: {errors.read_text()[-3000:]}")
        self.address = address
        self.args = ["--ray.address", address]
        self.raylet = self._raylet()

    def _raylet(self):
        """The cluster's raylet (a psutil.Process): its children are the cluster's workers."""
        import psutil

        for process in psutil.process_iter(["cmdline"]):
            command = process.info["cmdline"] or ()
            if command and "raylet" in command[0] and self.temp_dir in " ".join(command):
                return process
        self.close()
        raise RuntimeError(f"the shared Ray in {self.temp_dir} has no raylet")

    def actor_processes(self) -> dict[int, str]:
        """pid -> title of the cluster's worker processes that hold an actor or run a task (`ray::`
        titles but idle workers' and the raylet's own agents')."""
        import psutil

        titles = self.worker_zygote.workers(self.temp_dir) if self.worker_zygote else {}
        for child in self.raylet.children():
            with contextlib.suppress(psutil.Error):
                titles[child.pid] = " ".join(child.cmdline())
        return {
            pid: title.strip()
            for pid, title in titles.items()
            if title.startswith("ray::") and title.split()[0] not in _RAYLET_OWN
        }

    def wait_for_no_actors(self, timeout_s: float = 30.0) -> dict[int, str]:
        """The cluster's actor processes still alive after `timeout_s` (those of a run end just
        after its driver: Ray kills a job's actors when its driver exits)."""
        deadline = time.monotonic() + timeout_s
        while (left := self.actor_processes()) and time.monotonic() < deadline:
            time.sleep(0.2)
        return left

    def close(self) -> None:
        """Stop the holder (it takes its cluster down) and whatever of the cluster is left."""
        from tests.launch.driver_zygote import close_stdin_and_wait

        close_stdin_and_wait(self.holder, 60)
        kill_processes(list(ray_processes(self.temp_dir)))
        shutil.rmtree(self.temp_dir, ignore_errors=True)
