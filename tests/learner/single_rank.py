"""Worker processes of the learner tests: the environment of one gloo/DeepSpeed rank (a free local
port, DeepSpeed's CPU accelerator, one OpenMP thread), and starting / waiting for a world of them."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from rl_data.sync.broadcast import free_port
from tests.processes import wait_world


def rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    """This process's environment plus what rank `rank` of a `world`-rank `torch.distributed`
    worker needs (rendezvous on 127.0.0.1:`port`)."""
    return {
        **os.environ,
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(rank),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
    }


def single_rank_env() -> dict[str, str]:
    """This process's environment plus what a one-rank `torch.distributed` worker needs."""
    return rank_env(0, 1, free_port())


def start_ranks(
    worker: pathlib.Path, folder: pathlib.Path, world: int, *args: str, env: dict[str, str] | None = None
) -> list:
    """Start `world` gloo ranks of `worker folder *args` writing logs into `folder`, with `env`'s
    variables added to each rank's: [(process, log file, folder)]."""
    port = free_port()
    started = []
    for rank in range(world):
        log = open(folder / f"log{rank}.txt", "w")  # noqa: SIM115 (closed by wait_ranks)
        command = [sys.executable, str(worker), str(folder), *args]
        process = subprocess.Popen(
            command, env={**rank_env(rank, world, port), **(env or {})}, stdout=log, stderr=subprocess.STDOUT
        )
        started.append((process, log, folder))
    return started


def wait_ranks(started: list, timeout: float = 900) -> None:
    """Wait for `start_ranks`' processes; fail with every folder's logs when one did not exit 0 (the
    others are then stopped at once: `tests.processes.wait_world`)."""
    codes = wait_world([process for process, _, _ in started], timeout)
    for _, log, _ in started:
        log.close()
    if any(code != 0 for code in codes):
        folders = sorted({folder for _, _, folder in started})
        logs = "\n".join(
            f"--- {folder.name}/{p.name}\n{p.read_text()[-4000:]}"
            for folder in folders
            for p in sorted(folder.glob("log*.txt"))
        )
        pytest.fail(f"worker ranks exited with {codes}\n{logs}")
