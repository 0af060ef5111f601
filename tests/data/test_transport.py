"""Weight-sync transports: broadcast over a gloo group of real processes, files, the framing's checks."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from rl_data import WeightSyncReport, compare_checksums, decode, encode, pack_bucket, plan_buckets
from rl_data.sync import WeightSyncError, WeightSyncSpec, layout_fingerprint
from rl_data.sync.broadcast import free_port, local_address, reserve_port
from rl_data.sync.file import read_buckets, write_buckets
from tests.processes import wait_world

WORKER = pathlib.Path(__file__).with_name("_worker_transport.py")
_spec = importlib.util.spec_from_file_location("_worker_transport", WORKER)
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)


def run_group(tmp_path: pathlib.Path, receivers: list[int], sender_bucket_bytes: int = 8192) -> None:
    port = free_port()
    world = 1 + len(receivers)
    commands = [
        [
            sys.executable,
            str(WORKER),
            "send",
            str(port),
            "0",
            str(world),
            str(tmp_path),
            str(sender_bucket_bytes),
        ]
    ]
    commands += [
        [
            sys.executable,
            str(WORKER),
            "recv",
            str(port),
            str(rank),
            str(world),
            str(tmp_path),
            str(bucket_bytes),
        ]
        for rank, bucket_bytes in enumerate(receivers, start=1)
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    processes = [subprocess.Popen(command, env=env) for command in commands]
    assert wait_world(processes, 120) == [0] * world


def test_broadcast_delivers_identical_tensors_and_matching_checksums_to_every_receiver(tmp_path):
    run_group(tmp_path, receivers=[8192, 8192])
    sent = decode((tmp_path / "sent.msgpack").read_bytes(), WeightSyncReport)
    expected = worker.weights()
    assert sent.version == 2
    assert len(sent.checksums) == len(worker.layout().buckets) > 2
    for rank in (1, 2):
        received = decode((tmp_path / f"received-{rank}.msgpack").read_bytes(), WeightSyncReport)
        assert received.version == 2
        assert compare_checksums(sent, received) == []
        tensors = decode((tmp_path / f"tensors-{rank}.msgpack").read_bytes(), dict[str, torch.Tensor])
        assert tensors.keys() == expected.keys()
        for name, tensor in expected.items():
            assert tensors[name].dtype == tensor.dtype
            assert torch.equal(tensors[name], tensor), name


def test_a_receiver_with_another_layout_makes_every_rank_fail_before_any_bucket_is_sent(tmp_path):
    run_group(tmp_path, receivers=[8192, 4096])
    assert "rejected the layout" in (tmp_path / "error-0.txt").read_text()
    assert "differs from this receiver's" in (tmp_path / "error-2.txt").read_text()
    assert "another receiver rejected" in (tmp_path / "error-1.txt").read_text()
    assert not list(tmp_path.glob("tensors-*"))


def test_file_transport_round_trips_and_keeps_only_the_newest_versions(tmp_path):
    tensors = worker.weights()
    meta = worker.layout()
    for version in (3, 4, 5):
        sent = write_buckets(
            tmp_path, meta, lambda b, out: pack_bucket(b, tensors, out=out), version=version, keep=2
        )
    assert sorted(path.name for path in tmp_path.iterdir()) == ["version-00000004", "version-00000005"]
    received: dict[str, torch.Tensor] = {}
    report = read_buckets(
        tmp_path, meta, lambda b, views: received.update({k: v.clone() for k, v in views.items()}), version=5
    )
    assert report.version == 5
    assert compare_checksums(sent, report) == []
    assert all(torch.equal(received[name], tensor) for name, tensor in tensors.items())


def test_file_transport_refuses_a_corrupt_bucket_and_applies_nothing_from_it(tmp_path):
    tensors = worker.weights()
    meta = worker.layout()
    write_buckets(tmp_path, meta, lambda b, out: pack_bucket(b, tensors, out=out), version=1)
    path = tmp_path / "version-00000001" / "bucket-00001.bin"
    data = bytearray(path.read_bytes())
    data[10] ^= 0x01
    path.write_bytes(bytes(data))
    applied = []
    with pytest.raises(WeightSyncError, match=r"bucket 1 \(.*\) arrived with checksum .* it was not applied"):
        read_buckets(tmp_path, meta, lambda b, views: applied.append(b.index), version=1)
    assert applied == [0]


def test_file_transport_names_a_missing_version_and_a_truncated_file(tmp_path):
    tensors = worker.weights()
    meta = worker.layout()
    with pytest.raises(WeightSyncError, match=r"version-00000009 has no layout\.msgpack"):
        read_buckets(tmp_path, meta, lambda b, views: None, version=9)
    write_buckets(tmp_path, meta, lambda b, out: pack_bucket(b, tensors, out=out), version=1)
    path = tmp_path / "version-00000001" / "bucket-00000.bin"
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(WeightSyncError, match=r"bucket-00000.bin holds \d+ bytes, bucket 0 needs"):
        read_buckets(tmp_path, meta, lambda b, views: None, version=1)
    with pytest.raises(WeightSyncError, match="differs from this receiver's layout"):
        read_buckets(tmp_path, worker.layout(4096), lambda b, views: None, version=1)


def test_layout_fingerprint_sees_names_shapes_and_dtypes_but_not_checksums():
    meta = worker.layout()
    assert layout_fingerprint(meta) == layout_fingerprint(meta.with_checksums([1] * len(meta.buckets)))
    assert 0 <= layout_fingerprint(meta) < 2**63
    variants = [
        plan_buckets([("a", torch.float32, (4, 4))]),
        plan_buckets([("b", torch.float32, (4, 4))]),
        plan_buckets([("a", torch.float32, (16,))]),
        plan_buckets([("a", torch.bfloat16, (4, 4))]),
    ]
    assert len({layout_fingerprint(v) for v in variants}) == len(variants)


def test_spec_checks_name_the_field_and_the_allowed_values():
    meta = worker.layout()
    # every registered transport is named (a test plugin may have registered one more in this process)
    with pytest.raises(ValueError, match=r"transport: 'tcp' is not one of \(") as refused:
        WeightSyncSpec(transport="tcp", layout=meta)
    assert all(f"'{name}'" in str(refused.value) for name in ("broadcast", "ipc", "file", "shm"))
    with pytest.raises(ValueError, match=r"backend: 'mpi' is not one of"):
        WeightSyncSpec(transport="broadcast", layout=meta, port=1234, backend="mpi")
    with pytest.raises(ValueError, match="file transport needs a directory"):
        WeightSyncSpec(transport="file", layout=meta)
    spec = WeightSyncSpec(transport="broadcast", layout=meta, port=1234, world_size=3)
    assert decode(encode(spec), WeightSyncSpec) == spec


@pytest.mark.gpu
def test_ipc_handle_maps_the_same_cuda_memory_in_another_process(tmp_path):
    from rl_data.sync.ipc import ipc_handle

    buffer = torch.arange(256, dtype=torch.uint8, device="cuda")
    handle = ipc_handle(buffer)
    code = (
        "import sys, torch; from rl_data import decode; from rl_data.sync.ipc import IpcHandle, open_ipc_handle; "
        "t = open_ipc_handle(decode(sys.stdin.buffer.read(), IpcHandle)); "
        "assert torch.equal(t.cpu(), torch.arange(256, dtype=torch.uint8)); t.fill_(7); torch.cuda.synchronize()"
    )
    subprocess.run([sys.executable, "-c", code], input=encode(handle), check=True, timeout=120)
    assert torch.equal(buffer.cpu(), torch.full((256,), 7, dtype=torch.uint8))


def test_reserved_port_refuses_other_binders_but_a_tcpstore_serves_on_it():
    import datetime
    import errno
    import socket

    import torch.distributed as dist

    holder = reserve_port("127.0.0.1")
    port = holder.getsockname()[1]
    try:
        intruder = socket.socket()
        with pytest.raises(OSError, match="in use") as refused:
            intruder.bind(("127.0.0.1", port))
        intruder.close()
        assert refused.value.errno == errno.EADDRINUSE
        timeout = datetime.timedelta(seconds=10)
        server = dist.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False, timeout=timeout)
        client = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timeout)
        client.set("key", "value")
        assert server.port == port
        assert server.get("key") == b"value"
    finally:
        holder.close()


def test_local_address_towards_loopback_is_loopback():
    assert local_address("127.0.0.1") == "127.0.0.1"


def _listening_addresses(port: int) -> set[str]:
    """The local addresses this process listens at on TCP `port` (from /proc/net/tcp and tcp6)."""
    found = set()
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        try:
            lines = pathlib.Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            address, _, hex_port = local.partition(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.add("any" if int(address, 16) == 0 else address.rjust(width, "0"))
    return found


def test_the_sync_group_store_listens_at_its_host_only_not_on_every_interface():
    from rl_data.sync.broadcast import SyncGroup, master_store

    loopback = "0100007F"  # 127.0.0.1 as /proc/net/tcp writes it
    group = SyncGroup(host="127.0.0.1", port=free_port(), rank=0, world_size=1, timeout_s=30)
    try:
        assert _listening_addresses(group._store.port) == {loopback}
    finally:
        group.close()
    import datetime

    store = master_store("127.0.0.1", 0, 1, datetime.timedelta(seconds=10))
    assert _listening_addresses(store.port) == {loopback}


def test_a_store_on_a_reserved_port_listens_at_the_host_the_holder_reserved_it_for():
    import datetime

    import torch.distributed as dist

    from rl_data.sync.broadcast import master_store

    holder = reserve_port()  # every address, never listening: the port is held, nothing listens
    port = holder.getsockname()[1]
    try:
        server = master_store("127.0.0.1", port, 2, datetime.timedelta(seconds=10))
        client = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=datetime.timedelta(seconds=10))
        client.set("key", "value")
        assert server.get("key") == b"value"
        assert _listening_addresses(port) == {"0100007F"}
    finally:
        holder.close()
