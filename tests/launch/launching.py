"""Helpers of the launcher tests: run the real CLI, read a run's metrics, find Ray processes."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import secrets
import signal
import subprocess
import sys


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
