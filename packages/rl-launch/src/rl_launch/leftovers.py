"""What an actor's helper processes leave behind when the actor dies, and the sweep that removes it.

`VLLMEngine` runs vLLM in the engine actor's own process by default, and then leaves nothing.
With `rollout.engine_options.in_process false` (or a tensor-parallel engine, whose workers are
processes), vLLM runs its engine core and workers in child processes of the engine actor and
connects them through shared-memory ring buffers (`/dev/shm/psm_*`, 160-250 MB each on CPU) and
named semaphores (`/dev/shm/sem.mp-*`). `VLLMEngine.close()` (vLLM's own shutdown) removes them, and
`Roles.shutdown` calls it before it kills the actors. An actor killed first (`ray.kill`, an OOM
kill, a crash) never runs it: the segments stay until the machine reboots, and the engine core,
whose parent is gone, may go on running.

So each engine actor reports, once started, its helper processes and the shared memory they map
(`HelperProcesses.of_this_process`); after the actors are gone the driver `sweep`s exactly those:
it kills the processes still alive (the same pid *and* start time: never a recycled pid, and
only when the record was made on this host, this boot and in this pid namespace, where its pids
mean the same processes) and unlinks the segments no live process maps any more. Nothing else in /dev/shm is touched: other
runs on the same machine create the same kinds of names at the same time.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterable
from pathlib import Path

import msgspec

__all__ = ["HelperProcesses", "shared_memory_mapped_by", "sweep"]

SHM = Path("/dev/shm")


class HelperProcesses(msgspec.Struct, frozen=True, kw_only=True):
    """The child processes of one actor and the /dev/shm entries they map, on one host.

    host: `socket.gethostname()` of the actor (a sweep acts only on its own host).
    processes: (pid, start time in clock ticks since boot, from /proc/<pid>/stat) of the actor
        and each of its descendants.
    segments: names of /dev/shm entries (e.g. "psm_2c35cda3", "sem.mp-5aij8mlx").
    boot_id, pid_namespace: the actor's boot and pid namespace (`rl_data.sync.shm.ProcessIdentity`);
        a sweep acts only where both are its own ("" unknown: never).
    """

    host: str
    processes: tuple[tuple[int, int], ...] = ()
    segments: tuple[str, ...] = ()
    boot_id: str = ""
    pid_namespace: str = ""

    @classmethod
    def of_this_process(cls) -> HelperProcesses:
        """This process, its descendants and the /dev/shm entries they map."""
        pids = [os.getpid(), *_descendants(os.getpid())]
        processes = tuple((pid, start) for pid in pids if (start := _start_time(pid)) is not None)
        segments = shared_memory_mapped_by(pids)
        here = _here()
        return cls(
            host=here.host,
            processes=processes,
            segments=tuple(sorted(segments)),
            boot_id=here.boot_id,
            pid_namespace=here.pid_namespace,
        )

    def recorded_here(self) -> bool:
        """Whether its pids mean this process table's: the same host, boot and pid namespace."""
        here = _here()
        return "-" not in (here.boot_id, here.pid_namespace) and (
            self.host,
            self.boot_id,
            self.pid_namespace,
        ) == (here.host, here.boot_id, here.pid_namespace)


def _here():
    from rl_data.sync.shm import ProcessIdentity

    return ProcessIdentity.of()


def _start_time(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])  # field 22, after the command name


def _descendants(pid: int) -> list[int]:
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        parents.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def shared_memory_mapped_by(pids: Iterable[int] | None = None) -> set[str]:
    """Names of the /dev/shm entries mapped by `pids` (every readable process when None)."""
    if pids is None:
        pids = [int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()]
    names = set()
    prefix = str(SHM) + "/"
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        for line in maps.splitlines():
            fields = line.split(maxsplit=5)  # address perms offset device inode [path]
            path = fields[5].strip().removesuffix(" (deleted)") if len(fields) == 6 else ""
            if path.startswith(prefix) and "/" not in path[len(prefix) :]:
                names.add(path[len(prefix) :])
    return names


def sweep(helpers: Iterable[HelperProcesses]) -> list[str]:
    """Kill the listed processes still alive and unlink the listed segments nobody maps; what it did.

    Only entries recorded on this host, boot and pid namespace are touched; a process counts as
    the same one only when its start time matches (pids are recycled). Call after the actors are
    gone (killed or exited).
    """
    mine = [entry for entry in helpers if entry.recorded_here()]
    done = []
    for entry in mine:
        for pid, start in entry.processes:
            if _start_time(pid) == start:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
                    done.append(f"killed process {pid}")
    deadline = time.monotonic() + 5.0  # a killed process's mappings go when it is gone
    for entry in mine:
        for pid, start in entry.processes:
            while _start_time(pid) == start and not _is_zombie(pid) and time.monotonic() < deadline:
                time.sleep(0.02)
    segments = {name for entry in mine for name in entry.segments if (SHM / name).exists()}
    if segments:
        in_use = shared_memory_mapped_by() & segments
        for name in sorted(segments - in_use):
            with contextlib.suppress(FileNotFoundError, PermissionError):
                (SHM / name).unlink()
                done.append(f"removed /dev/shm/{name}")
    return done


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
