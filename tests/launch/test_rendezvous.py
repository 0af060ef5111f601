"""The learners' rendezvous (`rl_launch.rendezvous`): local ranks, device ordinals, the store on rank 0."""

from __future__ import annotations

import multiprocessing
import pathlib

import pytest

from rl_launch.rendezvous import (
    device_local_rank,
    gloo_interface_towards,
    interface_with_address,
    join_process_group,
    local_ranks,
    open_master_store,
)


def test_local_ranks_count_the_ranks_before_on_the_same_node():
    assert local_ranks(["a", "b", "a", "a", "b"]) == [0, 0, 1, 2, 1]
    assert local_ranks(["a", "b", "c"]) == [0, 0, 0]
    assert local_ranks([]) == []


def test_cpu_actor_local_rank_is_its_index_on_the_node():
    assert device_local_rank(2, [], None) == 2
    assert device_local_rank(1, [], "0,1") == 1


def test_gpu_actor_local_rank_is_its_gpu_among_the_visible_devices():
    # Ray narrows CUDA_VISIBLE_DEVICES to the actor's GPU: DeepSpeed must use cuda:0
    assert device_local_rank(3, [5], "5") == 0
    assert device_local_rank(3, ["5"], "4,5") == 1
    # nothing narrowed (RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES): the GPU's own id
    assert device_local_rank(0, [6], None) == 6


def test_gpu_actor_whose_gpu_is_not_visible_is_refused():
    with pytest.raises(RuntimeError, match="GPU 3 is not among CUDA_VISIBLE_DEVICES='0,1'"):
        device_local_rank(0, [3], "0,1")


def test_loopback_is_reached_through_lo():
    assert interface_with_address("127.0.0.1") == "lo"
    assert gloo_interface_towards("127.0.0.1") == "lo"
    assert interface_with_address("203.0.113.77") is None  # TEST-NET-3: held by no interface


def test_the_rendezvous_store_listens_at_the_node_address_only():
    store = open_master_store(2, timeout_s=10, host="127.0.0.1")
    listening = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in pathlib.Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, _, port = local.partition(":")
            if state == "0A" and int(port, 16) == store.port:  # 0A: LISTEN
                listening.add(address)
    assert listening == {"0100007F"}  # 127.0.0.1; before: "::" (every interface, IPv4 and IPv6)


def _rank(rank: int, world_size: int, ports, results) -> None:
    import torch
    import torch.distributed as dist

    store = None
    if rank == 0:
        store = open_master_store(world_size, timeout_s=60, host="127.0.0.1")
        for _ in range(world_size - 1):
            ports.put(store.port)
        port = store.port
    else:
        port = ports.get(timeout=60)
    join_process_group(
        store=store, master_addr="127.0.0.1", master_port=port, rank=rank, world_size=world_size, timeout_s=60
    )
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    results.put((rank, value.item()))
    dist.destroy_process_group()


@pytest.mark.slow  # three spawned processes in a gloo group
def test_ranks_meet_at_the_store_rank_0_opened_on_a_port_it_picked():
    context = multiprocessing.get_context("spawn")
    ports, results = context.Queue(), context.Queue()
    world_size = 3
    processes = [context.Process(target=_rank, args=(rank, world_size, ports, results)) for rank in range(3)]
    for process in processes:
        process.start()
    try:
        sums = dict(results.get(timeout=120) for _ in range(world_size))
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    assert sums == {0: 6.0, 1: 6.0, 2: 6.0}
    assert [process.exitcode for process in processes] == [0, 0, 0]
