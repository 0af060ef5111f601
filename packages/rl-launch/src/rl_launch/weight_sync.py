"""Weight-sync strategies of `rl-launch ppo` (`rollout.weight_sync`): how the policy's weights
reach the engines, and the `auto` choice from the placement."""

from __future__ import annotations

from typing import Any

import msgspec

from rl_algos import Registry

__all__ = ["SYNC_STRATEGIES", "SyncPlacement", "choose_weight_sync"]

SYNC_STRATEGIES = Registry("weight-sync strategy")
"""How the policy's weights reach the engines (rollout.weight_sync): name -> `start(roles, layout)`
returning `(rl_data.transport.WeightSyncSpec, description)`. It runs in the driver once the actors
are up (`roles`: `rl_launch.roles.Roles`, `layout`: policy rank 0's `WeightSyncMeta`); policy rank 0
and every engine then join the spec. "none" needs no strategy; "auto" is `choose_weight_sync` of the
placement (`rl_launch.roles.Roles.sync_placement`)."""


@SYNC_STRATEGIES.register("broadcast")
def broadcast_sync(roles: Any, layout: Any) -> tuple[Any, str]:
    """A process group of policy rank 0 and every engine worker (NCCL on GPUs, gloo on CPU) that
    meets at rank 0's node, on a port held there; the weights go in buckets."""
    import ray

    from rl_data.transport import WeightSyncSpec

    backend = "nccl" if roles.device == "cuda" else "gloo"
    host, port = ray.get(roles.groups["policy"].actors[0].reserve_sync_port.remote())
    spec = WeightSyncSpec(
        transport="broadcast",
        layout=layout,
        host=host,
        port=port,
        world_size=1 + sum(roles.engine_sync_sizes),
        backend=backend,
        timeout_s=roles.config.rollout.weight_sync_timeout_s,
    )
    return spec, f"bucketed broadcast ({backend}) from {host}:{port}"


@SYNC_STRATEGIES.register("shm")
def shm_sync(roles: Any, layout: Any) -> tuple[Any, str]:
    """One copy through a /dev/shm folder made on the node of policy rank 0, which every engine must
    share (`rl_data.shm`): zero-copy views for the engines' loaders."""
    import ray

    from rl_data.transport import WeightSyncSpec

    from .cluster import ClusterError

    if any(node != roles.policy_node for node in roles.engine_nodes):
        raise ClusterError(
            "rollout.weight_sync: shm needs every engine on the node of policy rank 0; these engines run "
            "elsewhere: use broadcast (or auto)"
        )
    directory = ray.get(roles.groups["policy"].actors[0].shm_directory.remote())
    spec = WeightSyncSpec(
        transport="shm",
        layout=layout,
        directory=directory,
        timeout_s=roles.config.rollout.weight_sync_timeout_s,
    )
    return spec, f"shared memory ({directory})"


@SYNC_STRATEGIES.register("ipc")
def ipc_sync(roles: Any, layout: Any) -> tuple[Any, str]:
    """CUDA IPC for engines on the GPUs of the policy's ranks (`ray.colocate all`): every rank packs
    the weights into buffers on its GPU once, and the engines on that GPU map them without a copy
    through the network (`rl_rollout.WeightReceiver` with the rank's `IpcPayload`)."""
    from rl_data.transport import WeightSyncSpec

    from .cluster import ClusterError

    if roles.device != "cuda":
        raise ClusterError(
            "rollout.weight_sync: ipc needs CUDA devices; this run is on CPU: use shm or broadcast"
        )
    unpaired = [index for index, rank in enumerate(roles.engine_policy_ranks()) if rank is None]
    if unpaired:
        raise ClusterError(
            f"rollout.weight_sync: ipc needs every engine on the GPU of a policy rank; engines {unpaired} are "
            "not (colocate them with ray.colocate all, one GPU per engine), or use broadcast (or auto)"
        )
    spec = WeightSyncSpec(
        transport="ipc", layout=layout, timeout_s=roles.config.rollout.weight_sync_timeout_s
    )
    return spec, "CUDA IPC (each policy rank shares its GPU buffers with the engines on its GPU)"


@SYNC_STRATEGIES.register("file")
def file_sync(roles: Any, layout: Any) -> tuple[Any, str]:
    """Bucket files in `<log.output_dir>/weight_sync` (one version kept, each version appears
    atomically): the fallback that works wherever every engine can read the run folder, also
    across machines sharing a file system; slower than the others (a write and a read per sync)."""
    from pathlib import Path

    from rl_data.transport import WeightSyncSpec

    directory = Path(roles.config.log.output_dir).resolve() / "weight_sync"
    directory.mkdir(parents=True, exist_ok=True)
    spec = WeightSyncSpec(
        transport="file",
        layout=layout,
        directory=str(directory),
        timeout_s=roles.config.rollout.weight_sync_timeout_s,
    )
    return spec, f"files ({directory})"


class SyncPlacement(msgspec.Struct, frozen=True, kw_only=True):
    """The placement facts `choose_weight_sync` decides from (gathered by `rl_launch.roles.Roles`)."""

    device: str
    """"cuda" or "cpu": where the policy and the engines run."""
    engine_receives: bool
    """Whether the rollout engine can take the learner's weights at all (an http engine cannot)."""
    engines_on_policy_gpus: bool = False
    """Every engine runs on one GPU that a policy rank also uses (`ray.colocate all`)."""
    engines_on_policy_node: bool = False
    """Every engine runs on the node of policy rank 0."""


def choose_weight_sync(placement: SyncPlacement) -> str:
    """`rollout.weight_sync` auto: the cheapest strategy the placement allows.

        engine cannot receive             -> none
        CUDA, every engine on a policy GPU -> ipc        (no copy leaves the GPU)
        CUDA otherwise                    -> broadcast  (NCCL)
        CPU, every engine on rank 0's node -> shm        (one copy through /dev/shm)
        CPU across nodes                  -> broadcast  (gloo)

    "file" is never chosen: whether the engines' machines share a folder with the policy's cannot
    be told from the placement, so it stays an explicit choice.
    """
    if not placement.engine_receives:
        return "none"
    if placement.device == "cuda":
        return "ipc" if placement.engines_on_policy_gpus else "broadcast"
    return "shm" if placement.engines_on_policy_node else "broadcast"
