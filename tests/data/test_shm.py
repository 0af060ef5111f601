"""The shm weight-sync transport (`rl_data.sync.shm`): real sender and receiver processes on one machine.

What is pinned: a receiver started before the sender waits for its version and gets the exact
bytes (checksums equal to the sender's, tensors equal); versions are read in order and a version
is never read half-written or after its slot was reused; a timeout names the version and the
file; a corrupt or foreign-layout version is refused; the views handed over are the shared
pages themselves; a receiver's own write into a view reaches neither the sender nor other
receivers; a sender's folder disappears on close and at exit, and after a SIGKILL the stale
sweep removes it; two concurrent runs never share a folder. Per bucket: a receiver loads bucket
i while the sender still packs the next ones, never sees a bucket torn or from another version
(also while the next version is written), and fails at once when the sender fails mid-version;
the check (`page_checksum`) sees a flipped bit, a stale page and a moved page.
"""

from __future__ import annotations

import importlib.util
import mmap
import os
import pathlib
import subprocess
import sys
import threading

import pytest
import torch

from rl_data import WeightSyncReport, compare_checksums, decode, pack_bucket, plan_buckets
from rl_data.sync import TRANSPORTS, WeightSyncError, WeightSyncSpec
from rl_data.sync.shm import (
    PAGE_BYTES,
    ShmPublisher,
    ShmReader,
    WeightSyncTimeout,
    page_checksum,
    remove_stale_directories,
    shm_directory,
)

WORKER = pathlib.Path(__file__).with_name("_worker_shm.py")
_spec = importlib.util.spec_from_file_location("_worker_shm", WORKER)
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)


def start(*args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.Popen([sys.executable, str(WORKER), *map(str, args)], env=env)


def packer(version: int):
    tensors = worker.weights(version)
    return lambda bucket, out: pack_bucket(bucket, tensors, out=out)


def collect(received: dict):
    return lambda bucket, views: received.update({k: v.clone() for k, v in views.items()})


@pytest.fixture
def directory(tmp_path):
    """A fresh shm folder name (under /dev/shm), removed after the test whatever happened."""
    path = shm_directory()
    yield path
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def test_shm_is_a_transport_and_its_spec_needs_a_directory():
    assert "shm" in TRANSPORTS
    with pytest.raises(ValueError, match="shm transport needs a directory"):
        WeightSyncSpec(transport="shm", layout=worker.layout())


def test_receiver_started_before_the_sender_gets_every_version_in_order(directory, tmp_path):
    receiver = start("recv", directory, tmp_path, 1, 2, 3)
    sender = start("send", directory, tmp_path, 1.0, "close", 1, 2, 3)  # publishes after the receiver waits
    assert receiver.wait(timeout=120) == 0
    assert sender.wait(timeout=120) == 0
    for version in (1, 2, 3):
        sent = decode((tmp_path / f"sent-{version}.msgpack").read_bytes(), WeightSyncReport)
        received = decode((tmp_path / f"received-{version}.msgpack").read_bytes(), WeightSyncReport)
        assert received.version == sent.version == version
        assert compare_checksums(sent, received) == []
        tensors = decode((tmp_path / f"tensors-{version}.msgpack").read_bytes(), dict[str, torch.Tensor])
        for name, tensor in worker.weights(version).items():
            assert tensors[name].dtype == tensor.dtype, name
            assert torch.equal(tensors[name], tensor), name
    assert not os.path.exists(directory)  # the sender's close removed its folder


def test_a_version_never_published_times_out_naming_the_version_and_the_file(directory):
    with ShmPublisher(directory, worker.layout()) as publisher:
        publisher.publish(packer(1), version=1)
        with ShmReader(directory, worker.layout(), timeout_s=0.3) as reader:
            with pytest.raises(WeightSyncTimeout, match=r"version 7 was not published as .*version-00000007"):
                reader.read(lambda b, v: None, version=7)
            assert reader.read(lambda b, v: None, version=1).version == 1


def test_a_slot_is_reused_only_after_its_readers_let_go(directory):
    """slots=1: the sender must wait for a reader that holds the slot; the old version is gone after."""
    meta = worker.layout()
    with ShmPublisher(directory, meta, slots=1, timeout_s=0.3) as publisher:
        publisher.publish(packer(1), version=1)
        reader = ShmReader(directory, meta, timeout_s=0.3)
        held: dict[str, torch.Tensor] = {}
        reader.read(lambda b, views: held.update(views), version=1, hold=True)
        with pytest.raises(WeightSyncTimeout, match=r"version 2: .*slot-0.bin is still being read"):
            publisher.publish(packer(2), version=2)
        # the held views still show version 1, untouched by the failed publish
        assert torch.equal(held["embed.weight"], worker.weights(1)["embed.weight"])
        reader.release()
        sent = publisher.publish(packer(2), version=2)
        with pytest.raises(WeightSyncTimeout, match="version 1 was not published"):
            reader.read(lambda b, v: None, version=1)  # its slot now holds version 2
        received: dict[str, torch.Tensor] = {}
        assert compare_checksums(sent, reader.read(collect(received), version=2)) == []
        assert torch.equal(received["layer.0.weight"], worker.weights(2)["layer.0.weight"])
        reader.close()


def test_concurrent_send_and_receive_in_threads_see_whole_versions(directory):
    meta = worker.layout()
    with ShmPublisher(directory, meta) as publisher, ShmReader(directory, meta, timeout_s=30) as reader:
        for version in range(1, 6):
            received: dict[str, torch.Tensor] = {}
            result = {}

            def read(version=version, received=received, result=result):
                result["report"] = reader.read(collect(received), version=version)

            thread = threading.Thread(target=read)
            thread.start()
            sent = publisher.publish(packer(version), version=version)
            thread.join(timeout=30)
            assert compare_checksums(sent, result["report"]) == []
            assert all(torch.equal(received[n], t) for n, t in worker.weights(version).items())


def test_views_are_the_shared_pages_and_a_receivers_write_stays_its_own(directory):
    meta = worker.layout()
    with ShmPublisher(directory, meta, slots=1) as publisher:
        publisher.publish(packer(1), version=1)
        first, second = ShmReader(directory, meta), ShmReader(directory, meta)
        storages = set()

        def scribble(bucket, views):
            for view in views.values():
                storages.add(view.untyped_storage().data_ptr())
                view.zero_()  # an engine that (wrongly) writes into what it was given

        first.read(scribble, version=1)
        assert len(storages) == 1  # every bucket is a view of the one mapped slot: no copy was made
        received: dict[str, torch.Tensor] = {}
        second.read(collect(received), version=1)  # the other receiver still sees the sender's bytes
        assert torch.equal(received["embed.weight"], worker.weights(1)["embed.weight"])
        sent = publisher.publish(packer(2), version=2)  # the same slot again
        again: dict[str, torch.Tensor] = {}
        assert compare_checksums(sent, first.read(collect(again), version=2)) == []
        assert torch.equal(again["embed.weight"], worker.weights(2)["embed.weight"])
        first.close()
        second.close()


def test_a_corrupt_bucket_is_refused_and_not_applied(directory):
    meta = worker.layout()
    with ShmPublisher(directory, meta, slots=1) as publisher:
        publisher.publish(packer(1), version=1)
        with open(pathlib.Path(directory) / "slot-0.bin", "r+b") as handle:
            pages = mmap.mmap(handle.fileno(), 0)
            offset = publisher.offsets[1]
            pages[offset + 3] ^= 0x01
            pages.close()
        applied = []
        with (
            ShmReader(directory, meta) as reader,
            pytest.raises(WeightSyncError, match=r"bucket 1 \(.*\) arrived with checksum"),
        ):
            reader.read(lambda b, views: applied.append(b.index), version=1)
        assert applied == [0]


def test_a_sender_with_another_layout_is_refused(directory):
    with ShmPublisher(directory, worker.layout(4096)) as publisher:
        publisher.publish(packer(1), version=1)
        with (
            ShmReader(directory, worker.layout(), timeout_s=5) as reader,
            pytest.raises(WeightSyncError, match="differs from this receiver's layout"),
        ):
            reader.read(lambda b, v: None, version=1)


@pytest.mark.parametrize("end", ["exit", "raise"])
def test_a_sender_that_ends_without_close_leaves_no_folder(directory, tmp_path, end):
    sender = start("send", directory, tmp_path, 0, end, 1)
    assert sender.wait(timeout=120) == (0 if end == "exit" else 1)
    assert (tmp_path / "sent-1.msgpack").exists()
    assert not os.path.exists(directory)


def test_a_killed_senders_folder_is_removed_by_the_stale_sweep(directory, tmp_path):
    sender = start("send", directory, tmp_path, 0, "kill", 1)
    assert sender.wait(timeout=120) == -9
    assert (pathlib.Path(directory) / "slot-0.bin").exists()  # nothing ran at the kill
    root = pathlib.Path(directory).parent
    live = str(root / f"rl-weights-live-{os.getpid()}")  # named by hand: shm_directory() sweeps
    with ShmPublisher(live, worker.layout()):
        removed = remove_stale_directories(root)
        assert directory in removed
        assert not os.path.exists(directory)
        assert os.path.exists(live)  # a live sender's folder is left alone
    assert not os.path.exists(live)
    sender = start("send", directory, tmp_path, 0, "kill", 1)
    assert sender.wait(timeout=120) == -9
    shm_directory()  # naming a new run's folder sweeps too
    assert not os.path.exists(directory)


@pytest.mark.slow  # four sender and receiver processes
def test_two_concurrent_runs_get_their_own_folders_and_a_folder_has_one_sender(directory, tmp_path):
    other = shm_directory()
    assert other != directory
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    runs = [
        start("recv", directory, first, 1, 2),
        start("recv", other, second, 2, 1),
        start("send", directory, first, 0.5, "close", 1, 2),
        start("send", other, second, 0.5, "close", 2, 1),  # other contents under the same numbers
    ]
    assert [run.wait(timeout=120) for run in runs] == [0, 0, 0, 0]
    for out in (first, second):
        for version in (1, 2):
            sent = decode((out / f"sent-{version}.msgpack").read_bytes(), WeightSyncReport)
            received = decode((out / f"received-{version}.msgpack").read_bytes(), WeightSyncReport)
            assert compare_checksums(sent, received) == []
    with ShmPublisher(directory, worker.layout()):
        holder = start("send", directory, tmp_path, 0, "close", 1)
        assert holder.wait(timeout=120) == 1  # FileExistsError: the folder belongs to this process
    meta = plan_buckets([("a", torch.float32, (4,))])
    assert (
        ShmPublisher(other, meta).slot_bytes == 2 * 4096
    )  # free again after its run: header + 1 bucket page


def test_page_checksum_sees_a_flipped_bit_a_stale_page_and_a_moved_page():
    generator = torch.Generator().manual_seed(0)
    pages = torch.randint(0, 256, (4 * PAGE_BYTES,), dtype=torch.uint8, generator=generator)
    reference = page_checksum(pages, pages.numel())
    assert page_checksum(pages.clone(), pages.numel()) == reference  # a function of the bytes
    assert page_checksum(pages, pages.numel() - 1) != reference  # the length counts
    for position in (0, 5, PAGE_BYTES + 8, pages.numel() - 1):
        flipped = pages.clone()
        flipped[position] ^= 0x10
        assert page_checksum(flipped, pages.numel()) != reference, position
    stale = pages.clone()
    stale[PAGE_BYTES : 2 * PAGE_BYTES] = torch.randint(
        0, 256, (PAGE_BYTES,), dtype=torch.uint8, generator=generator
    )
    assert page_checksum(stale, pages.numel()) != reference
    swapped = pages.clone()
    swapped[:PAGE_BYTES], swapped[2 * PAGE_BYTES : 3 * PAGE_BYTES] = (
        pages[2 * PAGE_BYTES : 3 * PAGE_BYTES],
        pages[:PAGE_BYTES],
    )
    assert page_checksum(swapped, pages.numel()) != reference
    with pytest.raises(ValueError, match="whole 4096-byte pages"):
        page_checksum(pages[:100], 100)


def test_a_stale_page_in_a_bucket_is_refused(directory):
    """Bucket 1's first page is put back to what version 1 held after version 2 was published in
    the same slot: the shape a torn or unsynchronised write would leave."""
    meta = worker.layout()
    with ShmPublisher(directory, meta, slots=1) as publisher:
        publisher.publish(packer(1), version=1)
        offset = publisher.offsets[1]
        with open(pathlib.Path(directory) / "slot-0.bin", "r+b") as handle:
            pages = mmap.mmap(handle.fileno(), 0)
            old_page = bytes(pages[offset : offset + PAGE_BYTES])
            publisher.publish(packer(2), version=2)
            pages[offset : offset + PAGE_BYTES] = old_page
            pages.close()
        with (
            ShmReader(directory, meta) as reader,
            pytest.raises(WeightSyncError, match=r"bucket 1 \(.*\) arrived with checksum"),
        ):
            reader.read(lambda b, views: None, version=2)


def test_a_receiver_loads_a_bucket_while_the_sender_packs_the_next(directory):
    """The sender's bucket 1 waits until the receiver has consumed bucket 0 of the same version:
    this only finishes if buckets are handed over one by one, not after the whole version."""
    meta = worker.layout()
    assert len(meta.buckets) >= 2
    consumed = threading.Event()
    tensors = worker.weights(1)

    def produce(bucket, out):
        if bucket.index == 1 and not consumed.wait(timeout=30):
            raise AssertionError("bucket 0 was not handed to the receiver while bucket 1 was pending")
        return pack_bucket(bucket, tensors, out=out)

    with ShmPublisher(directory, meta) as publisher, ShmReader(directory, meta, timeout_s=60) as reader:
        received: dict[str, torch.Tensor] = {}
        result = {}

        def consume(bucket, views):
            received.update({k: v.clone() for k, v in views.items()})
            if bucket.index == 0:
                consumed.set()

        thread = threading.Thread(target=lambda: result.update(report=reader.read(consume, version=1)))
        thread.start()
        sent = publisher.publish(produce, version=1)
        thread.join(timeout=60)
        assert compare_checksums(sent, result["report"]) == []
        assert all(torch.equal(received[n], t) for n, t in tensors.items())


def test_a_reader_of_one_version_never_sees_the_next_one_written_into_its_buckets(directory):
    """A slow receiver of version v holds its views while the sender writes v+1 (the other slot)
    and then wants v+2 (its slot): the views keep v's bytes until released, then v+2 arrives whole."""
    meta = worker.layout()
    with ShmPublisher(directory, meta, slots=2, timeout_s=30) as publisher:
        reader = ShmReader(directory, meta, timeout_s=30)
        publisher.publish(packer(1), version=1)
        held: dict[str, torch.Tensor] = {}
        reader.read(lambda b, views: held.update(views), version=1, hold=True)
        publisher.publish(packer(2), version=2)  # the other slot: no wait
        done = threading.Event()
        thread = threading.Thread(target=lambda: (publisher.publish(packer(3), version=3), done.set()))
        thread.start()  # waits for the reader to let go of version 1's slot
        assert not done.wait(timeout=0.5)
        assert all(torch.equal(held[n], t) for n, t in worker.weights(1).items())
        reader.release()
        thread.join(timeout=30)
        assert done.is_set()
        received: dict[str, torch.Tensor] = {}
        reader.read(collect(received), version=3)
        assert all(torch.equal(received[n], t) for n, t in worker.weights(3).items())
        reader.close()


def test_a_version_sent_again_stays_readable_from_the_slot_its_receivers_took(directory, monkeypatch):
    """An engine restarted in place takes the last version again (`WeightSync.rejoin`): while the
    sender writes it into the other slot, the version stays readable where it was, and a receiver
    that took the old record before the new one replaced it follows the new record once its old
    slot holds a newer version."""
    meta = worker.layout()
    with ShmPublisher(directory, meta, slots=2, timeout_s=30) as publisher:
        publisher.publish(packer(1), version=1)  # slot 0
        publisher.publish(packer(2), version=2)  # slot 1
        holder, receiver = ShmReader(directory, meta, timeout_s=30), ShmReader(directory, meta, timeout_s=5)
        holder.read(lambda b, views: None, version=1, hold=True)  # the re-send must wait for slot 0
        stale = receiver._wait_for_version(2, float("inf"))
        thread = threading.Thread(target=lambda: publisher.publish(packer(2), version=2))
        thread.start()
        received: dict[str, torch.Tensor] = {}
        receiver.read(collect(received), version=2)  # meanwhile: from slot 1, without waiting
        assert all(torch.equal(received[n], t) for n, t in worker.weights(2).items())
        holder.release()
        thread.join(timeout=30)
        assert not thread.is_alive()
        publisher.publish(packer(3), version=3)  # slot 1: the old record of version 2 is stale
        monkeypatch.setattr(receiver, "_wait_for_version", lambda version, deadline: stale)
        received.clear()
        receiver.read(collect(received), version=2)
        assert all(torch.equal(received[n], t) for n, t in worker.weights(2).items())
        holder.close()
        receiver.close()


def test_a_sender_failing_mid_version_fails_its_waiting_receivers_at_once(directory):
    meta = worker.layout()
    tensors = worker.weights(1)

    def produce(bucket, out):
        if bucket.index == 1:
            raise RuntimeError("the gather failed")
        return pack_bucket(bucket, tensors, out=out)

    with ShmPublisher(directory, meta) as publisher, ShmReader(directory, meta, timeout_s=60) as reader:
        errors: list[BaseException] = []
        applied: list[int] = []

        def read():
            try:
                reader.read(lambda b, views: applied.append(b.index), version=1)
            except BaseException as error:
                errors.append(error)

        thread = threading.Thread(target=read)
        thread.start()
        with pytest.raises(RuntimeError, match="the gather failed"):
            publisher.publish(produce, version=1)
        thread.join(timeout=30)  # far below the reader's 60 s timeout
        assert not thread.is_alive()
        assert len(errors) == 1, errors
        assert isinstance(errors[0], WeightSyncError), errors
        assert "failed while publishing version 1" in str(errors[0])
        assert 1 not in applied
        with (
            ShmReader(directory, meta, timeout_s=60) as late,
            pytest.raises(WeightSyncError, match="version 1"),
        ):
            late.read(lambda b, views: None, version=1)  # a receiver that comes after the failure
        sent = publisher.publish(packer(1), version=1)  # the same version again, whole this time
        received: dict[str, torch.Tensor] = {}
        assert compare_checksums(sent, reader.read(collect(received), version=1)) == []


# ----------------------------------------------------------------------------- owners


def _owner_folder(root: pathlib.Path, name: str, line: str) -> pathlib.Path:
    folder = root / f"rl-weights-{name}"
    folder.mkdir()
    (folder / "owner").write_text(line)
    return folder


def test_the_stale_sweep_needs_this_boot_pid_namespace_and_a_gone_pid_and_start_time(tmp_path):
    from rl_data.sync.shm import ProcessIdentity, process_start_time, remove_if_stale

    me = ProcessIdentity.of()
    if "-" in (me.boot_id, me.pid_namespace):
        pytest.skip("needs /proc/sys/kernel/random/boot_id and /proc/self/ns/pid")
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()  # a pid that no longer exists here
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        start = process_start_time(live.pid)

        def owner(pid: int, start_time: int, **changes: str) -> str:
            fields = {"boot_id": me.boot_id, "pid_namespace": me.pid_namespace, **changes}
            identity = ProcessIdentity(me.host, pid, fields["boot_id"], fields["pid_namespace"], start_time)
            return identity.line()

        kept = {
            # another container sharing /dev/shm and the host name, not the pids: its live sender
            "other-namespace": owner(ended.pid, 1, pid_namespace="4026531999"),
            "other-boot": owner(ended.pid, 1, boot_id="00000000-0000-0000-0000-000000000000"),
            "live": owner(live.pid, start),
            "older-file": f"{me.host} {ended.pid}\n",  # host and pid only: cannot tell
            "other-host": owner(ended.pid, 1).replace(me.host, me.host + "-elsewhere", 1),
        }
        removed = {"gone": owner(ended.pid, 1), "recycled-pid": owner(live.pid, start + 1)}
        folders = {name: _owner_folder(tmp_path, name, line) for name, line in {**kept, **removed}.items()}
        swept = {name for name, folder in folders.items() if remove_if_stale(folder)}
        assert swept == set(removed)
        assert all(folders[name].is_dir() for name in kept)
        assert sorted(remove_stale_directories(tmp_path)) == []  # what is left stays
    finally:
        live.kill()
        live.wait()


def test_a_senders_folder_is_private_to_its_user_and_names_its_identity(directory):
    from rl_data.sync.shm import ProcessIdentity

    with ShmPublisher(directory, worker.layout()):
        assert os.stat(directory).st_mode & 0o777 == 0o700
        owner = ProcessIdentity.parse((pathlib.Path(directory) / "owner").read_text())
        assert owner == ProcessIdentity.of()
        assert not owner.certainly_gone()
