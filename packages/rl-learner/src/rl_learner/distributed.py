"""torch.distributed for a learner: the process group DeepSpeed needs, made once per process.

`ensure_distributed()` is called before a learner builds its model (`rl_learner.learner`) and
before a ZeRO-3 model is constructed partitioned (`rl_learner.models._zero3_loading`).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from rl_data.sync.broadcast import free_port

__all__ = ["ensure_distributed"]


def ensure_distributed() -> None:
    """Initialise torch.distributed through DeepSpeed when the caller has not (gloo on CPU, nccl on CUDA)."""
    import deepspeed

    _without_shared_memory_allreduce()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if dist.is_initialized():
        if dist.get_world_size() == 1:
            # DeepSpeed's engine reads LOCAL_RANK from the environment even for a group the caller made.
            os.environ.setdefault("LOCAL_RANK", "0")
        # DeepSpeed's own view of the group the caller made: its config reads the world size
        # from it (a ZeRO-3 load's batch check), and it wraps the existing group. A clone of an
        # earlier world that the caller destroyed before making this one is dropped first.
        _forget_deepspeeds_world_group(only_if_dead=True)
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False)
        return
    _forget_deepspeeds_world_group()
    if "RANK" not in os.environ:
        # A single process started without a launcher: a world of one on a free local port, given
        # directly rather than through RANK / MASTER_PORT in os.environ, which child processes
        # would inherit and then try to listen on the same port. DeepSpeed's engine reads
        # LOCAL_RANK from the environment; 0 is right for a world of one and harmless to inherit.
        os.environ.setdefault("LOCAL_RANK", "0")
        deepspeed.init_distributed(
            dist_backend=backend,
            auto_mpi_discovery=False,
            verbose=False,
            init_method=f"tcp://127.0.0.1:{free_port()}",
            rank=0,
            world_size=1,
        )
        return
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False)


def _without_shared_memory_allreduce() -> None:
    """On DeepSpeed's CPU accelerator, leave out its shared-memory allreduce op (`deepspeed_shm_comm`).

    DeepSpeed's torch backend compiles that op with ninja when it first starts in a process (35-55 s
    on 2 cores, most of a CPU learner's start on a fresh machine), for `inference_all_reduce`, the
    AutoTP inference path, which no learner here calls: training's collectives go through gloo. The
    backend skips the op when the accelerator offers no builder for it (`build_shm_op` in
    `deepspeed/comm/torch.py`), and with it the probe of every op's compatibility. So a CPU
    accelerator that offers every other builder is installed through DeepSpeed's public
    `set_accelerator`, before the backend starts; a process whose backend started earlier keeps it.
    """
    from deepspeed.accelerator import get_accelerator, set_accelerator
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    class GlooCPUAccelerator(CPU_Accelerator):
        def get_op_builder(self, class_name: str) -> Any:
            return None if class_name == "ShareMemCommBuilder" else super().get_op_builder(class_name)

    current = get_accelerator()
    if type(current) is CPU_Accelerator:
        set_accelerator(GlooCPUAccelerator())


def _forget_deepspeeds_world_group(only_if_dead: bool = False) -> None:
    """Drop DeepSpeed's clone of an earlier world group before this process makes a new world
    (`only_if_dead`: only where that clone belongs to a world that no longer exists, when the
    caller made the current world itself).

    DeepSpeed clones the world group the first time an engine needs it
    (`deepspeed.utils.groups._WORLD_GROUP`) and keeps the clone for the life of the process. When
    that world ends (its process group destroyed: in the test suite, by an in-process vLLM
    engine's tests in the same process), the next learner in the same process would broadcast
    over the dead clone ("Group ... is not registered"); without it, DeepSpeed clones the new
    world.
    """
    from deepspeed.utils import groups

    clone = getattr(groups, "_WORLD_GROUP", None)
    if clone is None:
        return
    if only_if_dead:
        try:
            dist.get_process_group_ranks(clone)
            return  # a group of the current world
        except (KeyError, ValueError, RuntimeError):  # KeyError: torch 2.13's for an unknown group
            pass
    groups._WORLD_GROUP = None
