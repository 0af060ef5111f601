"""How the ranks of a learner role find each other, on one node or many.

The ranks of a role form one torch.distributed world. Its rendezvous store lives in the actor of
rank 0: that actor opens a `TCPStore` on a port the OS picks on its own node (port 0: the store's
socket holds the port from the start, so no other process can take it in between), listening at
its node's address (`ray.util.get_node_ip_address()`) only, not on every interface, and reports
that address and port. The driver hands the pair to every rank, and all of them build the default
process group from it. Nothing is probed on the
driver, whose loopback and free ports say nothing about the nodes the actors run on.

`LOCAL_RANK` is what DeepSpeed reads as the device ordinal (`cuda:<LOCAL_RANK>`): on a GPU actor
it is the position of the actor's GPU among the devices it sees (0 when Ray narrowed
`CUDA_VISIBLE_DEVICES` to that GPU, its default), on CPU the rank's index among the role's ranks
on its node (`local_ranks`).
"""

from __future__ import annotations

import datetime
import fcntl
import os
import socket
import struct
from collections.abc import Sequence
from typing import Any

__all__ = [
    "device_local_rank",
    "gloo_interface_towards",
    "interface_with_address",
    "join_process_group",
    "local_ranks",
    "open_master_store",
]

_SIOCGIFADDR = 0x8915  # Linux ioctl: the IPv4 address of a network interface


def local_ranks(node_ids: Sequence[str]) -> list[int]:
    """Each rank's index among the ranks on its node, in rank order.

    `node_ids[r]` is the node of rank r; e.g. ["a", "b", "a", "a"] -> [0, 0, 1, 2].
    """
    seen: dict[str, int] = {}
    out = []
    for node in node_ids:
        out.append(seen.get(node, 0))
        seen[node] = out[-1] + 1
    return out


def device_local_rank(node_local_rank: int, gpu_ids: Sequence[Any], visible_devices: str | None) -> int:
    """The `LOCAL_RANK` DeepSpeed needs: the ordinal of this actor's device.

    gpu_ids: `ray.get_gpu_ids()` of the actor (empty on CPU); visible_devices: its
    `CUDA_VISIBLE_DEVICES` (None when unset). CPU actors: `node_local_rank`. GPU actors: where
    the first of its GPUs sits in `visible_devices` (0 under Ray's per-actor narrowing), or the
    GPU's own id when nothing narrows the visible devices.
    """
    if not gpu_ids:
        return node_local_rank
    first = str(gpu_ids[0])
    visible = [device.strip() for device in (visible_devices or "").split(",") if device.strip()]
    if first in visible:
        return visible.index(first)
    if visible_devices is None and first.isdigit():
        return int(first)
    raise RuntimeError(
        f"LOCAL_RANK: the actor's GPU {first} is not among CUDA_VISIBLE_DEVICES={visible_devices!r}"
    )


def interface_with_address(address: str) -> str | None:
    """The name of the network interface that holds IPv4 `address` (Linux), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                reply = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on this interface
                continue
            if socket.inet_ntoa(reply[20:24]) == address:
                return name
    return None


def gloo_interface_towards(master_addr: str) -> str | None:
    """The interface gloo should use to reach `master_addr`: the one its route leaves from.

    gloo otherwise binds to what the host name resolves to, which on many machines is a loopback
    address (127.0.1.1), and then no rank on another node can reach this one.
    """
    from rl_data.sync.broadcast import local_address

    return interface_with_address(local_address(master_addr))


def open_master_store(world_size: int, timeout_s: float, host: str | None = None) -> Any:
    """Rank 0's rendezvous store, listening on a port the OS picks now at `host` only (default:
    the node address Ray uses, `ray.util.get_node_ip_address()`, 127.0.0.1 for a local Ray), never
    on every interface; `.port` is that port."""
    from rl_data.sync.broadcast import master_store

    if host is None:
        import ray

        host = ray.util.get_node_ip_address()
    return master_store(host, 0, world_size, datetime.timedelta(seconds=timeout_s))


def join_process_group(
    *, store: Any, master_addr: str, master_port: int, rank: int, world_size: int, timeout_s: float
) -> None:
    """Build the default process group through rank 0's store (gloo on CPU, NCCL on CUDA).

    Rank 0 passes the store it opened (`open_master_store`), the others None and connect to
    `master_addr:master_port`. The usual variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)
    are set too; DeepSpeed then finds the group initialised and uses it.
    """
    import torch
    import torch.distributed as dist

    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR=master_addr, MASTER_PORT=str(master_port)
    )
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "gloo" and "GLOO_SOCKET_IFNAME" not in os.environ:
        interface = gloo_interface_towards(master_addr)
        if interface is not None:
            os.environ["GLOO_SOCKET_IFNAME"] = interface
    if store is None:
        store = dist.TCPStore(
            master_addr,
            master_port,
            world_size,
            is_master=False,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
