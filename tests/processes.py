"""Waiting for a world of worker processes without waiting out a dead rank's peers."""

from __future__ import annotations

import subprocess
import time


def wait_world(processes: list[subprocess.Popen], timeout_s: float) -> list[int | str]:
    """The exit codes of `processes`, which should all exit 0. As soon as one exits otherwise, the
    others are killed (a rank that died, say at an import, leaves its peers waiting out their
    rendezvous or collective timeouts, minutes); past `timeout_s` every one left is killed and
    reported as "timeout". Killed peers report -9."""
    deadline = time.monotonic() + timeout_s
    while True:
        codes = [process.poll() for process in processes]  # every one polled: any() would stop early
        if None not in codes or any(code not in (None, 0) for code in codes) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    timed_out = not any(process.returncode not in (None, 0) for process in processes)
    codes: list[int | str] = []
    for process in processes:
        if process.poll() is None:
            process.kill()
            process.wait()
            codes.append("timeout" if timed_out else process.returncode)
        else:
            codes.append(process.returncode)
    return codes
