"""The shared-memory segments (`/dev/shm/psm_*`, Python's `multiprocessing.shared_memory`) that
this test process's children leave behind, found and removed at the session's end.

vLLM's engine-core process creates its message queues as such segments and its worker maps
them; a child killed before it unlinks them leaves them in `/dev/shm` (tmpfs: memory, 100-400 MiB
each here) until the machine restarts. `SegmentWatch.sample()` records every segment a live
descendant of this process maps (cheap when there are no children: one read per thread of
`/proc/self/task/*/children`), every 2 s in a thread between `start()` and `stop()`;
`SegmentWatch.sweep()` unlinks the recorded ones that did not exist
when the watch started and that no live process maps any more. A segment another run created is
never touched: it was never mapped by one of this process's descendants.
"""

from __future__ import annotations

import os
import pathlib
import threading

SHM = pathlib.Path("/dev/shm")
PREFIX = "psm_"


def segment_names() -> set[str]:
    """The `psm_*` names now in /dev/shm (empty where there is no /dev/shm)."""
    try:
        return {entry.name for entry in os.scandir(SHM) if entry.name.startswith(PREFIX)}
    except OSError:
        return set()


def children(pid: int) -> list[int]:
    """The direct children of process `pid` (every thread's), [] when it is gone."""
    out = []
    try:
        for task in os.scandir(f"/proc/{pid}/task"):
            try:
                out += [int(child) for child in pathlib.Path(task.path, "children").read_text().split()]
            except OSError:
                continue
    except OSError:
        return []
    return out


def descendants(pid: int) -> list[int]:
    """Every live descendant of process `pid`, children first."""
    found, queue = [], children(pid)
    while queue:
        child = queue.pop()
        found.append(child)
        queue += children(child)
    return found


def mapped_segments(pid: int) -> set[str]:
    """The `psm_*` segments process `pid` maps (empty when it is gone)."""
    try:
        with open(f"/proc/{pid}/maps", "rb") as maps:
            text = maps.read()
    except OSError:
        return set()
    marker = f"{SHM}/{PREFIX}".encode()
    names = set()
    for line in text.splitlines():
        at = line.find(marker)
        if at >= 0:
            names.add(line[at + len(str(SHM)) + 1 :].split(b" ")[0].decode(errors="replace"))
    return names


def mapped_by_anyone(names: set[str]) -> set[str]:
    """Which of `names` some live process on this machine maps."""
    used: set[str] = set()
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            used |= mapped_segments(int(entry.name)) & names
            if used == names:
                break
    return used


class SegmentWatch:
    """The segments this process's descendants mapped since `__init__`; see the module docstring."""

    def __init__(self, pid: int | None = None) -> None:
        self.pid = os.getpid() if pid is None else pid
        self.before = segment_names()
        self.seen: set[str] = set()

    def sample(self) -> None:
        """Record what the live descendants map now."""
        for child in descendants(self.pid):
            self.seen |= mapped_segments(child)

    def start(self, interval_s: float = 2.0) -> None:
        """Sample every `interval_s` seconds in a daemon thread until `stop` (an engine lives for
        tens of seconds, so each one's segments are seen while it runs)."""
        self._stop = threading.Event()

        def loop() -> None:
            while not self._stop.wait(interval_s):
                self.sample()

        self._thread = threading.Thread(target=loop, name="shm-leftovers", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the sampling thread (after one last sample)."""
        self._stop.set()
        self._thread.join()
        self.sample()

    def sweep(self) -> list[str]:
        """Unlink the recorded segments that are new since `__init__`, still exist and that no live
        process maps; return their names."""
        candidates = (self.seen - self.before) & segment_names()
        if not candidates:
            return []
        removed = []
        for name in sorted(candidates - mapped_by_anyone(candidates)):
            try:
                (SHM / name).unlink()
                removed.append(name)
            except OSError:
                continue
        return removed
