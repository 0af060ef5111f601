"""The environment of a one-rank DeepSpeed worker process started by a learner test: rank 0 of a
world of one on a free local port, DeepSpeed's CPU accelerator, one OpenMP thread."""

from __future__ import annotations

import os

from rl_data.transport import free_port


def single_rank_env() -> dict[str, str]:
    """This process's environment plus what a one-rank `torch.distributed` worker needs."""
    return {
        **os.environ,
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
    }
