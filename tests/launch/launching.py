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


def launcher_env(**extra: str) -> dict[str, str]:
    """The test environment plus a Ray auth token held in a variable (Ray then writes no token file)."""
    env = dict(os.environ)
    env.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(16))
    env["RAY_USAGE_STATS_ENABLED"] = "0"
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
    try:
        yield temp_dir, launcher_env()
    finally:
        leftovers = ray_processes(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert not leftovers, f"Ray processes outlived the run: {leftovers}"


def kill_processes(pids: list[int]) -> None:
    """SIGKILL `pids` (those still alive)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def launch(args: list[str], env: dict[str, str], *, timeout: float = 900) -> subprocess.CompletedProcess:
    """Run `rl-launch ppo <args>` to completion; the completed process (stdout and stderr text)."""
    return subprocess.run(
        [sys.executable, "-m", "rl_launch.cli", "ppo", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


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
    process = subprocess.Popen(
        [sys.executable, "-m", "rl_launch.cli", "ppo", *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 600
    while not marker.exists():
        assert process.poll() is None, "the run ended before it could be killed"
        assert time.monotonic() < deadline, f"{marker} did not appear within 10 minutes"
        time.sleep(0.05)
    os.killpg(process.pid, signal.SIGKILL)  # the driver and the local Ray it started
    process.wait()
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
    process = subprocess.Popen(
        [sys.executable, "-m", "rl_launch.cli", command, *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
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
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


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
    process = subprocess.Popen(
        [sys.executable, "-m", "rl_launch.cli", "ppo", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
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
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
