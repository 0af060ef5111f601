"""tests/shm_leftovers.py: a segment a killed child left is removed, nothing else is."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from multiprocessing import shared_memory

import pytest

from tests.shm_leftovers import SHM, SegmentWatch, mapped_segments

pytestmark = pytest.mark.skipif(not SHM.is_dir(), reason="needs /dev/shm")

# A child that creates a segment (untracked, like vLLM's queues: no resource tracker unlinks it),
# maps it and the segment named in argv[1], prints the new name and waits to be killed.
CHILD = (
    "import sys, time; from multiprocessing import resource_tracker, shared_memory; "
    "shm = shared_memory.SharedMemory(create=True, size=4096); "
    "resource_tracker.unregister(shm._name, 'shared_memory'); "
    "old = shared_memory.SharedMemory(name=sys.argv[1]); "
    "resource_tracker.unregister(old._name, 'shared_memory'); "
    "print(shm.name, flush=True); time.sleep(600)"
)


def test_only_a_new_segment_a_killed_child_mapped_is_swept():
    older = shared_memory.SharedMemory(create=True, size=4096)  # there before the watch
    watch = SegmentWatch()
    other = shared_memory.SharedMemory(create=True, size=4096)  # new, unmapped, never a child's
    older.close()
    other.close()
    child = subprocess.Popen([sys.executable, "-c", CHILD, older.name], stdout=subprocess.PIPE, text=True)
    try:
        leaked = child.stdout.readline().strip()
        assert mapped_segments(child.pid) >= {leaked, older.name}
        watch.sample()
        assert watch.sweep() == []  # mapped by the live child
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        assert (SHM / leaked).exists()  # the kill left it
        assert watch.sweep() == [leaked]
        assert not (SHM / leaked).exists()
        assert (SHM / older.name).exists()
        assert (SHM / other.name).exists()
    finally:
        child.kill()
        child.wait()
        older.unlink()
        other.unlink()
