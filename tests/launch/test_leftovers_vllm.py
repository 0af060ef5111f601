"""vLLM's shared memory (`/dev/shm/psm_*`, `sem.mp-*`) and engine-core processes after its
process dies: `close()` leaves nothing; a SIGKILLed one leaves them, and the launcher's sweep
(`rl_launch.leftovers`) removes exactly what that engine recorded. The engine runs vLLM's engine
core in a process of its own (`in_process=False`): in one process there is nothing to leave.

One process holds both engines, one after the other (each out-of-process engine costs three
processes that import vLLM; the host process is shared): the first is closed, the second is
SIGKILLed with its host process, as an engine actor is. What the second records is the whole
process tree at that point, as the actor's record is: the host, vLLM's engine core and worker,
and multiprocessing's resource tracker (started with the first engine, shared by both).
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

_ENGINES = r"""
import os, sys, msgspec
from rl_launch.leftovers import HelperProcesses
from rl_rollout.engines.vllm import VLLMEngine
def report(engine_name):
    print(f"{engine_name} " + msgspec.json.encode(HelperProcesses.of_this_process()).decode(), flush=True)
if __name__ == "__main__":
    engine = VLLMEngine(sys.argv[1], max_model_len=64, enforce_eager=True, in_process=False)
    report("CLOSING")
    engine.close()
    print("CLOSED", flush=True)
    engine = VLLMEngine(sys.argv[1], max_model_len=64, enforce_eager=True, in_process=False)
    report("KILLING")
    sys.stdin.readline()  # killed here
"""


def _alive(pid: int, start: int) -> bool:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] != "Z" and int(fields[19]) == start


RESOURCE_TRACKER = "from multiprocessing.resource_tracker import main"


def _command(pid: int) -> str | None:
    """RESOURCE_TRACKER when `pid` runs multiprocessing's resource tracker, else its command line
    (None once it exited)."""
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None
    return RESOURCE_TRACKER if RESOURCE_TRACKER in command else command


def _alive_but_the_tracker(processes, within_s: float) -> list[str]:
    """The command lines of `processes` still alive other than the resource tracker, once there
    are none (within `within_s`; the helpers exit soon after vLLM's shutdown returns)."""
    deadline = time.monotonic() + within_s
    while True:
        alive = [_command(pid) for pid, start in processes if _alive(pid, start)]
        alive = [command for command in alive if command not in (None, RESOURCE_TRACKER)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def _next_report(engines: subprocess.Popen, name: str) -> HelperProcesses:
    for line in engines.stdout:
        if line.startswith(f"{name} "):
            return msgspec.json.decode(line.removeprefix(f"{name} "), type=HelperProcesses)
    raise AssertionError(f"no {name} line: the engine process exited with code {engines.wait()}")


def _existing(segments) -> list[str]:
    return [name for name in segments if Path("/dev/shm", name).exists()]


def test_a_closed_vllm_engine_leaves_no_shared_memory_and_a_killed_one_is_swept(tiny_checkpoint):
    engines = subprocess.Popen(
        [sys.executable, "-c", _ENGINES, str(tiny_checkpoint)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"},
    )
    try:
        closing = _next_report(engines, "CLOSING")
        assert any(name.startswith("psm_") for name in closing.segments), closing
        assert len(closing.processes) >= 4  # the host, the tracker, vLLM's engine core and its worker
        assert engines.stdout.readline().strip() == "CLOSED"
        assert _existing(closing.segments) == []
        # every process the engine started is gone but multiprocessing's resource tracker, which
        # lives as long as the host process (the killed engine's record holds it, below)
        host = closing.processes[0]
        assert host[0] == engines.pid
        assert _alive_but_the_tracker([entry for entry in closing.processes if entry != host], 10) == []

        killing = _next_report(engines, "KILLING")
        assert any(name.startswith("psm_") for name in killing.segments), killing
        engines.send_signal(signal.SIGKILL)
        engines.wait()
        assert _existing(killing.segments)  # vLLM's own: leaked
        assert sweep([killing])
        assert _existing(killing.segments) == []
        assert [pid for pid, start in killing.processes if _alive(pid, start)] == []
    finally:
        if engines.poll() is None:
            engines.kill()
            engines.wait()
