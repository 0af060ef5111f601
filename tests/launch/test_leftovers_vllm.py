"""vLLM's shared memory (`/dev/shm/psm_*`, `sem.mp-*`) and engine-core processes after its
process dies: `close()` leaves nothing; a SIGKILLed one leaves them, and the launcher's sweep
(`rl_launch.leftovers`) removes exactly what that engine recorded. The engine runs vLLM's engine
core in a process of its own (`in_process=False`): in one process there is nothing to leave.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

from rl_launch.leftovers import HelperProcesses, sweep

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow

_ENGINE = r"""
import os, sys, msgspec
from rl_launch.leftovers import HelperProcesses
from rl_rollout.engines.vllm import VLLMEngine
if __name__ == "__main__":
    engine = VLLMEngine(sys.argv[1], max_model_len=64, enforce_eager=True, in_process=False)
    print("HELPERS " + msgspec.json.encode(HelperProcesses.of_this_process()).decode(), flush=True)
    if sys.argv[2] == "close":
        engine.close()
        print("CLOSED", flush=True)
    else:
        sys.stdin.readline()  # killed here
"""


def _alive(pid: int, start: int) -> bool:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] != "Z" and int(fields[19]) == start


def _still_alive(helpers: HelperProcesses, within_s: float) -> list[int]:
    deadline = time.monotonic() + within_s
    while True:
        alive = [pid for pid, start in helpers.processes if _alive(pid, start)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def _start(checkpoint, how: str) -> tuple[subprocess.Popen, HelperProcesses]:
    engine = subprocess.Popen(
        [sys.executable, "-c", _ENGINE, str(checkpoint), how],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"},
    )
    for line in engine.stdout:
        if line.startswith("HELPERS "):
            return engine, msgspec.json.decode(line.removeprefix("HELPERS "), type=HelperProcesses)
    raise AssertionError(f"the engine did not start (exit code {engine.wait()})")


def test_a_closed_vllm_engine_leaves_no_shared_memory_and_a_killed_one_is_swept(tiny_checkpoint):
    engine, helpers = _start(tiny_checkpoint, "close")
    assert any(name.startswith("psm_") for name in helpers.segments), helpers
    assert len(helpers.processes) >= 2  # this process and vLLM's engine core
    assert engine.stdout.readline().strip() == "CLOSED"
    engine.wait(timeout=120)
    assert [name for name in helpers.segments if Path("/dev/shm", name).exists()] == []
    assert _still_alive(helpers, within_s=10) == []  # helpers (a resource tracker) exit soon after

    engine, helpers = _start(tiny_checkpoint, "kill")
    engine.send_signal(signal.SIGKILL)
    engine.wait()
    assert [name for name in helpers.segments if Path("/dev/shm", name).exists()]  # vLLM's own: leaked
    assert sweep([helpers])
    assert [name for name in helpers.segments if Path("/dev/shm", name).exists()] == []
    assert [pid for pid, start in helpers.processes if _alive(pid, start)] == []
