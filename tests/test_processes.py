"""tests/processes.py: a world of worker processes is waited for without waiting out a dead rank's peers."""

from __future__ import annotations

import subprocess
import sys
import time

from tests.processes import wait_world


def _python(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code])


def test_the_peers_of_a_failed_process_are_stopped_at_once():
    began = time.monotonic()
    processes = [
        _python("import time; time.sleep(600)"),
        _python("raise SystemExit(3)"),
        _python("import time; time.sleep(600)"),
    ]
    assert wait_world(processes, timeout_s=600) == [-9, 3, -9]
    assert time.monotonic() - began < 60  # not the sleepers' 600 s


def test_processes_left_at_the_deadline_are_killed_and_reported_as_timeouts():
    processes = [_python("pass"), _python("import time; time.sleep(600)")]
    assert wait_world(processes, timeout_s=1.0) == [0, "timeout"]
    assert processes[1].poll() is not None


def test_a_world_that_exits_0_gives_its_codes():
    assert wait_world([_python("pass"), _python("pass")], timeout_s=60) == [0, 0]
