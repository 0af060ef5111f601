"""How the policy's weights reach the engines (`rollout.weight_sync`): strategies as declared entries.

A strategy is a `SyncStrategy` in `SYNC_STRATEGIES`, under the transport name it starts
(`rl_data.sync.TRANSPORTS`; its sender is `rl_learner.SENDERS[name]`, its receiver
`rl_rollout.RECEIVERS[name]`). The entry says everything `rl_launch.weights.WeightSync` needs, so
the step's sync never names a transport:

| field              | what it says                                                        | set by   |
|--------------------|---------------------------------------------------------------------|----------|
| `start`            | `start(context, layout) -> (WeightSyncSpec, description)`, in the driver once the actors are up: the rendezvous | all |
| `sender_first`     | the receivers start only once the sender returned (a reader does not wait for the data) | file |
| `per_rank_payload` | every policy rank sends; each engine receives the payload of the policy rank on its GPU, then the ranks `release` | ipc |
| `sweep`            | `sweep(spec)`, in the driver after the actors are gone: removes what a killed sender left (its `close` never ran) | shm |
| `whole_group`      | every receiver takes part in every send (a process group): an engine restarted mid-run re-forms the group with all of them (`WeightSync.rejoin`); else it joins alone | broadcast |

"none" needs no strategy; "auto" is `choose_weight_sync` of the placement
(`rl_launch.weights.sync_placement`). A plugin (`--plugin`, imported in the driver and every
actor) adds one with a module per side (see `rl_data.sync`) and here::

    @SYNC_STRATEGIES.register("mine")
    def start_mine(context, layout):
        \"\"\"One line for `rl-launch components`.\"\"\"
        spec = WeightSyncSpec(transport="mine", layout=layout, options={...})
        return spec, "my transport"

A start function that needs something made on policy rank 0's machine (a port, a folder) runs a
module-level function there with `context.on_policy_rank_0(fn)`: `fn(worker)` runs inside that
learner actor, and `worker.hold_until_sync(resource)` keeps a resource open until the sender
has joined. The `SyncContext` holds the run's config and its `Placement` (device, engine nodes,
sync sizes, which policy rank's GPU each engine shares).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec

from ..errors import ConfigError
from .base import ComponentKind, ComponentRegistry, Selection

if TYPE_CHECKING:
    from ..config import PPOConfig
    from ..placement import Placement

__all__ = [
    "SYNC_STRATEGIES",
    "WEIGHT_SYNC",
    "SyncContext",
    "SyncPlacement",
    "SyncStrategy",
    "choose_weight_sync",
]

Start = Callable[[Any, Any], tuple[Any, str]]


@dataclasses.dataclass(frozen=True)
class SyncStrategy:
    """One weight-sync strategy: its start function and what the step's sync must know about it.

    Registered under the transport name (`rollout.weight_sync`). start: `start(context, layout)` returns
    the `rl_data.sync.WeightSyncSpec` both sides join and a description for the start-up line
    (`context`: a `SyncContext`, `layout`: policy rank 0's `WeightSyncMeta`). sender_first:
    the driver waits for the sender before the receivers start (their reads do not wait for the
    data). per_rank_payload: every policy rank returns a payload with its report, each engine
    receives the one of the policy rank on its GPU (`Placement.engine_policy_ranks`), and the ranks
    then `release_sync`. sweep: `sweep(spec)` removes what a sender killed outright (SIGKILL, OOM)
    left behind, called by the driver at shutdown after the actors are gone; it must leave alone
    what a live process still uses (another run's, or a sender that closed normally). whole_group:
    every receiver takes part in every send (a process group whose member died is broken), so an
    engine restarted mid-run is joined by starting the strategy again for the sender and every
    engine (`rl_launch.weights.WeightSync.rejoin`); without it the new engine joins the spec alone.
    """

    start: Start
    sender_first: bool = False
    per_rank_payload: bool = False
    sweep: Callable[[Any], None] | None = None
    whole_group: bool = False


@dataclasses.dataclass(frozen=True)
class SyncContext:
    """What a strategy's start gets from the run: its config, where the actors run (`placement`)
    and `on_policy_rank_0(fn)`, which runs the module-level function `fn(worker)` inside the actor
    of policy rank 0 (the sender) and returns its result (Ray sends `fn` by reference)."""

    config: PPOConfig
    placement: Placement
    run_on_policy_rank_0: Callable[[Callable[[Any], Any]], Any]

    def on_policy_rank_0(self, fn: Callable[[Any], Any]) -> Any:
        return self.run_on_policy_rank_0(fn)

    @property
    def device(self) -> str:
        return self.placement.device

    @property
    def engine_sync_sizes(self) -> list[int]:
        return self.placement.engine_sync_sizes

    @property
    def engine_nodes(self) -> list[str]:
        return self.placement.engine_nodes

    @property
    def policy_node(self) -> str:
        return self.placement.policy_node

    def engine_policy_ranks(self) -> list[int | None]:
        return self.placement.engine_policy_ranks()


SYNC_STRATEGIES = ComponentRegistry("weight-sync strategy", SyncStrategy, builder="start")
"""How the policy's weights reach the engines (rollout.weight_sync): name -> `SyncStrategy`."""


# --------------------------------------------------------------------------------------------
# What runs on policy rank 0 before a start function returns (through `SyncContext.on_policy_rank_0`).


def _reserve_sync_port(worker: Any) -> tuple[str, int]:
    """(this node's IP address, a port held here until the sender's group store serves it)."""
    import ray

    from rl_data.sync.broadcast import reserve_port

    holder = reserve_port()
    worker.hold_until_sync(holder)
    return ray.util.get_node_ip_address(), holder.getsockname()[1]


def _shm_directory(worker: Any) -> str:
    """A fresh shared-memory folder on this node (`rl_data.sync.shm.shm_directory`)."""
    from rl_data.sync.shm import shm_directory

    return str(shm_directory())


# --------------------------------------------------------------------------------------------
# The built-in strategies.


@SYNC_STRATEGIES.register("broadcast", whole_group=True)
def broadcast_sync(context: SyncContext, layout: Any) -> tuple[Any, str]:
    """A process group of policy rank 0 and every engine worker (NCCL on GPUs, gloo on CPU) that
    meets at rank 0's node, on a port held there; the weights go in buckets."""
    from rl_data.sync import WeightSyncSpec

    backend = "nccl" if context.device == "cuda" else "gloo"
    host, port = context.on_policy_rank_0(_reserve_sync_port)
    spec = WeightSyncSpec(
        transport="broadcast",
        layout=layout,
        host=host,
        port=port,
        world_size=1 + sum(context.engine_sync_sizes),
        backend=backend,
        timeout_s=context.config.rollout.weight_sync_timeout_s,
    )
    return spec, f"bucketed broadcast ({backend}) from {host}:{port}"


def _sweep_shm_folder(spec: Any) -> None:
    """The run's /dev/shm folder when its sender died without removing it: only this folder, only
    when its owner file names a process of this host that is gone (`rl_data.sync.shm.remove_if_stale`)."""
    from rl_data.sync.shm import remove_if_stale

    remove_if_stale(spec.directory)


@SYNC_STRATEGIES.register("shm", sweep=_sweep_shm_folder)
def shm_sync(context: SyncContext, layout: Any) -> tuple[Any, str]:
    """One copy through a /dev/shm folder made on the node of policy rank 0, which every engine must
    share (`rl_data.sync.shm`): zero-copy views for the engines' loaders."""
    from rl_data.sync import WeightSyncSpec

    from ..errors import ClusterError

    if any(node != context.policy_node for node in context.engine_nodes):
        raise ClusterError(
            "rollout.weight_sync: shm needs every engine on the node of policy rank 0; these engines run "
            "elsewhere: use broadcast (or auto)"
        )
    directory = context.on_policy_rank_0(_shm_directory)
    spec = WeightSyncSpec(
        transport="shm",
        layout=layout,
        directory=directory,
        timeout_s=context.config.rollout.weight_sync_timeout_s,
    )
    return spec, f"shared memory ({directory})"


@SYNC_STRATEGIES.register("ipc", per_rank_payload=True)
def ipc_sync(context: SyncContext, layout: Any) -> tuple[Any, str]:
    """CUDA IPC for engines on the GPUs of the policy's ranks (`ray.colocate all`): every rank packs
    the weights into buffers on its GPU once, and the engines on that GPU map them without a copy
    through the network (`rl_rollout.WeightReceiver` with the rank's `IpcPayload`)."""
    from rl_data.sync import WeightSyncSpec

    from ..errors import ClusterError

    if context.device != "cuda":
        raise ClusterError(
            "rollout.weight_sync: ipc needs CUDA devices; this run is on CPU: use shm or broadcast"
        )
    unpaired = [index for index, rank in enumerate(context.engine_policy_ranks()) if rank is None]
    if unpaired:
        raise ClusterError(
            f"rollout.weight_sync: ipc needs every engine on the GPU of a policy rank; engines {unpaired} are "
            "not (colocate them with ray.colocate all, one GPU per engine), or use broadcast (or auto)"
        )
    spec = WeightSyncSpec(
        transport="ipc", layout=layout, timeout_s=context.config.rollout.weight_sync_timeout_s
    )
    return spec, "CUDA IPC (each policy rank shares its GPU buffers with the engines on its GPU)"


@SYNC_STRATEGIES.register("file", sender_first=True)
def file_sync(context: SyncContext, layout: Any) -> tuple[Any, str]:
    """Bucket files in `<log.output_dir>/weight_sync` (one version kept, each version appears
    atomically): the fallback that works wherever every engine can read the run folder, also
    across machines sharing a file system; slower than the others (a write and a read per sync)."""
    from pathlib import Path

    from rl_data.sync import WeightSyncSpec

    directory = Path(context.config.log.output_dir).resolve() / "weight_sync"
    directory.mkdir(parents=True, exist_ok=True)
    spec = WeightSyncSpec(
        transport="file",
        layout=layout,
        directory=str(directory),
        timeout_s=context.config.rollout.weight_sync_timeout_s,
    )
    return spec, f"files ({directory})"


# --------------------------------------------------------------------------------------------
# auto


class SyncPlacement(msgspec.Struct, frozen=True, kw_only=True):
    """The placement facts `choose_weight_sync` decides from (`rl_launch.weights.sync_placement`)."""

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


# --------------------------------------------------------------------------------------------
# The kind, as `rl_launch.components` checks and lists it.


def _select(config: PPOConfig) -> list[Selection]:
    return [
        Selection("rollout.weight_sync", config.rollout.weight_sync, None, {}, {}, allowed=("auto", "none"))
    ]


def _check(config: PPOConfig) -> None:
    if config.rollout.weight_sync == "ipc" and config.ray.device == "cpu":
        raise ConfigError(
            "rollout.weight_sync: ipc (CUDA IPC) needs GPUs, but ray.device is cpu: use shm, broadcast, file or auto"
        )


WEIGHT_SYNC = ComponentKind(
    title="weight-sync strategies",
    singular="weight-sync strategy",
    registry=SYNC_STRATEGIES,
    where="rollout.weight_sync; also auto and none",
    select=_select,
    check=_check,
    extra_names=("auto", "none"),
)
