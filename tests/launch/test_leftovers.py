"""The sweep of what a killed engine actor left (`rl_launch.leftovers`): its helper processes and
their /dev/shm segments, and nothing else.

A child process stands in for the actor: it creates a /dev/shm segment, starts a grandchild that
maps it (vLLM's engine core holding its ring buffer), records `HelperProcesses`, and is then
SIGKILLed, as `ray.kill` does. The vLLM case itself is in test_leftovers_vllm.py.
"""

from __future__ import annotations

import json
import mmap
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import msgspec
import pytest

from rl_launch.leftovers import HelperProcesses, shared_memory_mapped_by, sweep

pytestmark = pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs /dev/shm")

_ACTOR = r"""
import mmap, os, subprocess, sys, time, msgspec
from rl_launch.leftovers import HelperProcesses
name = sys.argv[1]
fd = os.open("/dev/shm/" + name, os.O_CREAT | os.O_RDWR, 0o600)
os.ftruncate(fd, 4096)
held = mmap.mmap(fd, 4096)
child = subprocess.Popen([sys.executable, "-c",
    "import mmap, os, time; fd = os.open('/dev/shm/%s', os.O_RDWR); m = mmap.mmap(fd, 4096); "
    "print('mapped', flush=True); time.sleep(600)" % name], stdout=subprocess.PIPE, text=True)
assert child.stdout.readline().strip() == "mapped"
print(msgspec.json.encode(HelperProcesses.of_this_process()).decode(), flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture
def segment_name():
    name = f"rlt-{uuid.uuid4().hex[:8]}"
    yield name
    Path("/dev/shm", name).unlink(missing_ok=True)


def test_the_sweep_kills_a_killed_actors_helpers_and_removes_only_its_segments(segment_name):
    actor = subprocess.Popen(
        [sys.executable, "-c", _ACTOR, segment_name], stdout=subprocess.PIPE, text=True, env=os.environ
    )
    helpers = msgspec.json.decode(actor.stdout.readline(), type=HelperProcesses)
    pids = [pid for pid, _ in helpers.processes]
    assert pids[0] == actor.pid
    assert len(pids) == 2
    assert segment_name in helpers.segments
    assert segment_name in shared_memory_mapped_by([pids[1]])

    actor.send_signal(signal.SIGKILL)  # the grandchild lives on, orphaned, holding the segment
    actor.wait()
    assert _alive(pids[1])
    assert Path("/dev/shm", segment_name).exists()

    done = sweep([helpers])
    assert f"removed /dev/shm/{segment_name}" in done
    assert not Path("/dev/shm", segment_name).exists()
    assert not _alive(pids[1])


def test_the_sweep_leaves_other_hosts_recycled_pids_and_segments_in_use_alone(segment_name):
    path = Path("/dev/shm", segment_name)
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    os.ftruncate(fd, 4096)
    held = mmap.mmap(fd, 4096)  # this process still uses it
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        own = HelperProcesses.of_this_process().host
        recycled = HelperProcesses(host=own, processes=((sleeper.pid, 1),), segments=(segment_name,))
        elsewhere = HelperProcesses(
            host=own + "-other", processes=((sleeper.pid, 0),), segments=(segment_name,)
        )
        assert sweep([recycled, elsewhere]) == []
        assert path.exists()
        assert sleeper.poll() is None
    finally:
        sleeper.kill()
        sleeper.wait()
        held.close()
        os.close(fd)
    time.sleep(0.05)
    assert json.dumps(sweep([])) == "[]"


def test_the_shm_sync_sweep_removes_the_folder_of_a_killed_policy_and_nothing_else(tmp_path):
    import types

    import msgspec

    from rl_data.sync.shm import ProcessIdentity
    from rl_launch.components.weight_sync import SYNC_STRATEGIES

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    me = ProcessIdentity.of()
    gone = msgspec.structs.replace(me, pid=dead.pid, start_time=1)
    folders = {}
    for name, owner in (("rl-weights-run", gone), ("rl-weights-run-2", gone), ("rl-weights-live", me)):
        folders[name] = tmp_path / name
        folders[name].mkdir()
        (folders[name] / "owner").write_text(owner.line())
    sweep_folder = SYNC_STRATEGIES["shm"].sweep
    for name in ("rl-weights-run", "rl-weights-live"):
        sweep_folder(types.SimpleNamespace(transport="shm", directory=str(folders[name])))  # a WeightSyncSpec
    assert not folders["rl-weights-run"].exists()  # its sender is gone
    assert folders["rl-weights-live"].exists()  # a live sender's (it removes its own at close)
    assert folders["rl-weights-run-2"].exists()  # another run's: not this run's to sweep
    assert SYNC_STRATEGIES["broadcast"].sweep is None


def test_the_sweep_leaves_a_record_from_another_pid_namespace_or_boot_alone():
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        here = HelperProcesses.of_this_process()
        start = next(start for pid, start in here.processes if pid == sleeper.pid)
        if "-" in (here.boot_id, here.pid_namespace):
            pytest.skip("needs /proc/sys/kernel/random/boot_id and /proc/self/ns/pid")
        other_container = HelperProcesses(
            host=here.host, processes=((sleeper.pid, start),), boot_id=here.boot_id, pid_namespace="1"
        )
        other_boot = HelperProcesses(
            host=here.host, processes=((sleeper.pid, start),), boot_id="x", pid_namespace=here.pid_namespace
        )
        unknown = HelperProcesses(host=here.host, processes=((sleeper.pid, start),))  # an older record
        assert sweep([other_container, other_boot, unknown]) == []
        assert sleeper.poll() is None
        ours = HelperProcesses(
            host=here.host,
            processes=((sleeper.pid, start),),
            boot_id=here.boot_id,
            pid_namespace=here.pid_namespace,
        )
        assert sweep([ours]) == [f"killed process {sleeper.pid}"]
        assert sleeper.wait(timeout=30) == -9
    finally:
        sleeper.kill()
        sleeper.wait()
