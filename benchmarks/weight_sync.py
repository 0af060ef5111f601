"""Time weight sync to rollout engines: bucketed broadcast (`rl_learner.sync`) vs one call per parameter.

A learner process holds a ~100M-parameter Qwen2-style causal LM built from a config (hidden 768,
12 layers, 12 heads, 4 KV heads, MLP 2048, vocabulary 32,000, tied embeddings; no hub) and
syncs it to 2 receiver processes that hold the same architecture, over gloo on 127.0.0.1 (CPU).
Both schemes are timed end to end: from the learner's first message until every receiver has
loaded the last tensor into its model, with the same `load` on the receiving side (look the
names up in `named_parameters()` and `copy_`, the shape of an engine's `load_weights` call).

- per-parameter (what OpenRLHF does): for each parameter, one remote call to every receiver
  (`--rpc pipe`: a message over a `multiprocessing` Connection; `--rpc ray`: a Ray actor method
  call, as OpenRLHF makes it) with the name, dtype and shape; the receiver allocates the
  tensor, joins the broadcast of that parameter and loads it; the learner waits for every
  receiver's reply before the next parameter.
- bucketed (ours): `rl_learner.senders.BroadcastSender`, the layout sent once up front in the spec;
  per sync one remote call, then buckets of `--bucket-mb` MiB with a checksum each, packed
  while the previous bucket is on the wire; receivers run `rl_data.sync.broadcast.receive_buckets`
  (which verifies each bucket's checksum) and load a whole bucket at a time.
- w/o checksums (benchmark only): the same buckets, packed and broadcast the same way, without
  the checksums on either side; with the "checksum (1 pass)" row (`rl_data.bucket_checksum`
  over every bucket once) it shows what the checksums cost on this machine.
- file, shared mem (ours): `rl_learner.senders.FileSender` writes the buckets (checksummed) into a
  folder under /dev/shm, then every receiver reads, verifies and loads them
  (`rl_data.sync.file.read_buckets`): the same-host CPU path that avoids the loopback sockets.
- shm (ours): `rl_learner.senders.ShmSender` packs each bucket once into a pre-faulted shared-memory
  slot and marks it ready; the receivers, called before the send as a driver does, load bucket
  i while the sender packs bucket i+1, each verifying the bucket's page checksum and loading from
  views over the shared pages (`rl_data.sync.shm`): one copy on each side, overlapped, no socket.
- memcpy: `dst.copy_(src)` of the same number of bytes in one process, the bound that memory
  bandwidth puts on any copy of these weights on this machine.

    python benchmarks/weight_sync.py [--hidden 768 --layers 12 --vocab 32000 --dtype float32
                                      --bucket-mb 128 --repeat 3 --rpc pipe|ray]
    python benchmarks/weight_sync.py --shape qwen2-0.5b --dtype bfloat16   # Qwen2-0.5B's 290 tensors
    python benchmarks/weight_sync.py --latency      # + gloo broadcast seconds per call vs bytes

`--shape qwen2-0.5b` takes Qwen2-0.5B's config numbers (hidden 896, 24 layers, 14 heads, 2 KV
heads, MLP 4864, vocabulary 151,936, tied embeddings: 494M parameters in 290 tensors; built
locally, nothing is downloaded). Prints, per scheme, the median seconds of `--repeat` syncs and
their range, GB/s at the median (10^9 bytes of weights per second, counted once however many
receivers), the ratio to the per-parameter scheme and the fraction of the memcpy rate.
`--latency` adds seconds per gloo broadcast call to the receivers for sizes 4 KiB .. 64 MiB and
a fit `seconds = latency + bytes / bandwidth`, what bounds the broadcast schemes. Between syncs the learner flips the sign of every weight, and after each sync every
receiver's weights are checked equal to the learner's (per-tensor checksums), so a scheme that
skips work cannot report a good number.
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from rl_data import bucket_checksum, decode, encode, pack_bucket, unpack_bucket
from rl_data.sync import WeightSyncSpec
from rl_data.sync.broadcast import SyncGroup, free_port, receive_buckets
from rl_data.sync.file import read_buckets
from rl_data.sync.shm import ShmReader, shm_directory
from rl_data.tensors import tensor_checksum

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Qwen2-0.5B's config.json numbers (the layout of its 290 tensors), without a download.
SHAPES = {
    "qwen2-0.5b": dict(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, vocab=151_936),
}
SCHEMES = ("per-parameter", "bucketed", "unchecked", "file", "shm")
LATENCY_SIZES = [4096 * 4**k for k in range(8)]  # 4 KiB .. 64 MiB
SHARED_MEMORY = "/dev/shm"  # the file transport through RAM: the fastest same-host path on CPU


def model_config(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "vocab_size": args.vocab,
        "hidden_size": args.hidden,
        "intermediate_size": args.intermediate,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "tie_word_embeddings": True,
        "max_position_embeddings": 2048,
    }


def build_model(config: dict[str, Any], dtype: torch.dtype, seed: int) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(Qwen2Config(**config), dtype=dtype)


def load(params: dict[str, torch.nn.Parameter], named: Any) -> None:
    """The receiver's apply, as an engine's `load_weights(named_tensors)`: look up, then copy."""
    with torch.no_grad():
        for name, tensor in named:
            params[name].copy_(tensor)


def weights_digest(model: torch.nn.Module) -> list[int]:
    return [tensor_checksum(p.detach()) for _, p in model.named_parameters()]


class ReceiverEngine:
    """A receiving engine's side of both schemes; served over a Pipe or as a Ray actor."""

    def __init__(
        self, rank: int, world: int, config: dict[str, Any], dtype_name: str, threads: int = 1
    ) -> None:
        torch.set_num_threads(threads)
        self.rank, self.world = rank, world
        self.model = build_model(config, DTYPES[dtype_name], seed=rank)
        self.group: SyncGroup | None = None
        self.shm: ShmReader | None = None

    def join(self, port: int) -> str:
        """A group of its own per scheme (both frameworks set one up once, before any sync)."""
        if self.group is not None:
            self.group.close()
        self.group = SyncGroup(host="127.0.0.1", port=port, rank=self.rank, world_size=self.world)
        return "joined"

    def update_weight(self, name: str, dtype: str, shape: tuple[int, ...]) -> str:
        """Per-parameter scheme: one remote call per parameter, then its broadcast and load."""
        buffer = torch.empty(shape, dtype=getattr(torch, dtype))
        self.group.broadcast(buffer).wait()
        load(dict(self.model.named_parameters()), [(name, buffer)])
        return "ok"

    def receive(self, spec_bytes: bytes) -> int:
        """Ours: one remote call per sync; `receive_buckets` loads a whole bucket at a time."""
        spec = decode(spec_bytes, WeightSyncSpec)
        report = receive_buckets(
            self.group,
            spec.layout,
            lambda bucket, views: load(dict(self.model.named_parameters()), views.items()),
        )
        return report.num_bytes

    def receive_file(self, spec_bytes: bytes, version: int) -> int:
        """Ours, file transport: read and verify the buckets the sender wrote, load them."""
        spec = decode(spec_bytes, WeightSyncSpec)
        report = read_buckets(
            spec.directory,
            spec.layout,
            lambda bucket, views: load(dict(self.model.named_parameters()), views.items()),
            version=version,
        )
        return report.num_bytes

    def receive_shm(self, spec_bytes: bytes, version: int) -> int:
        """Ours, shm transport: wait for the version, verify, load from views over the shared pages."""
        spec = decode(spec_bytes, WeightSyncSpec)
        if self.shm is None or str(self.shm.directory) != spec.directory:
            self.shm = ShmReader(spec.directory, spec.layout, timeout_s=spec.timeout_s)
        params = dict(self.model.named_parameters())
        start = time.perf_counter()
        waited = []

        def consume(bucket, views):
            if not waited:  # the first bucket was ready
                waited.append(time.perf_counter() - start)
            load(params, views.items())

        report = self.shm.read(consume, version=version)
        return report.seconds - waited[0], waited[0]

    def probe(self, sizes: list[int], calls: int) -> str:
        """Join `calls` broadcasts of each size (the latency measurement)."""
        for size in sizes:
            buffer = torch.empty(size, dtype=torch.uint8)
            for _ in range(calls):
                self.group.broadcast(buffer).wait()
        return "ok"

    def receive_unchecked(self, spec_bytes: bytes) -> int:
        """Buckets without checksums (benchmark only): what the checksums cost."""
        layout = decode(spec_bytes, WeightSyncSpec).layout
        size = max(bucket.nbytes for bucket in layout.buckets)
        buffers = [torch.empty(size, dtype=torch.uint8) for _ in range(2)]
        pending = None
        for bucket in layout.buckets:
            buffer = buffers[bucket.index % 2][: bucket.nbytes]
            work = self.group.broadcast(buffer)
            if pending is not None:
                load(dict(self.model.named_parameters()), unpack_bucket(*pending).items())
            work.wait()
            pending = (bucket, buffer)
        load(dict(self.model.named_parameters()), unpack_bucket(*pending).items())
        return layout.total_bytes

    def digest(self) -> list[int]:
        return weights_digest(self.model)

    def close(self) -> str:
        if self.shm is not None:
            self.shm.close()
            self.shm = None
        if self.group is not None:
            self.group.close()
            self.group = None
        return "closed"


def serve(
    connection: Any, rank: int, world: int, config: dict[str, Any], dtype_name: str, threads: int
) -> None:
    """A receiver process for `--rpc pipe`: (method, args) messages in, results out, until None."""
    engine = ReceiverEngine(rank, world, config, dtype_name, threads)
    connection.send("ready")
    while (message := connection.recv()) is not None:
        method, args = message
        connection.send(getattr(engine, method)(*args))
    engine.close()


class PipeReceivers:
    """Remote calls over multiprocessing Connections: `call` returns at once, `wait` collects."""

    def __init__(self, count: int, config: dict[str, Any], dtype_name: str, threads: int = 1) -> None:
        context = multiprocessing.get_context("spawn")
        pipes = [context.Pipe() for _ in range(count)]
        self.processes = [
            context.Process(
                target=serve, args=(child, rank, count + 1, config, dtype_name, threads), daemon=True
            )
            for rank, (_, child) in enumerate(pipes, start=1)
        ]
        for process in self.processes:
            process.start()
        self.connections = [parent for parent, _ in pipes]
        if [connection.recv() for connection in self.connections] != ["ready"] * count:
            raise SystemExit("a receiver failed to start")

    def call(self, method: str, *args: Any) -> list:
        for connection in self.connections:
            connection.send((method, args))
        return self.connections

    def wait(self, handles: list) -> list:
        return [connection.recv() for connection in handles]

    def close(self) -> None:
        for connection in self.connections:
            connection.send(None)
        for process in self.processes:
            process.join(timeout=60)


class RayReceivers:
    """The same calls to Ray actors (as OpenRLHF makes them), on a local Ray bound to 127.0.0.1."""

    def __init__(self, count: int, config: dict[str, Any], dtype_name: str, threads: int = 1) -> None:
        import ray

        self.ray = ray
        ray.init(
            address="local",
            include_dashboard=False,
            num_cpus=count + 1,
            _node_ip_address="127.0.0.1",
            _temp_dir=tempfile.mkdtemp(prefix="ray-"),
            log_to_driver=False,
        )
        actor = ray.remote(num_cpus=1)(ReceiverEngine)
        self.actors = [
            actor.remote(rank, count + 1, config, dtype_name, threads) for rank in range(1, count + 1)
        ]
        ray.get([a.digest.remote() for a in self.actors])

    def call(self, method: str, *args: Any) -> list:
        return [getattr(actor, method).remote(*args) for actor in self.actors]

    def wait(self, handles: list) -> list:
        return self.ray.get(handles)

    def close(self) -> None:
        self.ray.get([actor.close.remote() for actor in self.actors])
        self.ray.shutdown()


def per_parameter_sync(model: torch.nn.Module, group: SyncGroup, receivers: Any) -> None:
    """OpenRLHF's loop: per parameter, a remote call to every receiver, a broadcast, wait for the loads."""
    for name, param in model.named_parameters():
        calls = receivers.call(
            "update_weight", name, str(param.dtype).removeprefix("torch."), tuple(param.shape)
        )
        group.broadcast(param.data).wait()
        receivers.wait(calls)


def bucketed_sync(sender: Any, spec_bytes: bytes, receivers: Any, version: int) -> None:
    calls = receivers.call("receive", spec_bytes)
    sender.send(version=version)
    receivers.wait(calls)


def unchecked_sync(
    model: torch.nn.Module, group: SyncGroup, layout: Any, spec_bytes: bytes, receivers: Any
) -> None:
    """Buckets as ours packs them, without the checksums (benchmark only)."""
    calls = receivers.call("receive_unchecked", spec_bytes)
    tensors = dict(model.named_parameters())
    size = max(bucket.nbytes for bucket in layout.buckets)
    buffers = [torch.empty(size, dtype=torch.uint8) for _ in range(2)]
    pending = None
    for bucket in layout.buckets:
        out = pack_bucket(bucket, tensors, out=buffers[bucket.index % 2][: bucket.nbytes])
        work = group.broadcast(out)
        if pending is not None:
            pending.wait()
        pending = work
    pending.wait()
    receivers.wait(calls)


def check_receivers(model: torch.nn.Module, receivers: Any, scheme: str) -> None:
    expected = weights_digest(model)
    for index, digest in enumerate(receivers.wait(receivers.call("digest")), start=1):
        if digest != expected:
            raise SystemExit(f"{scheme}: receiver {index} holds other weights than the learner")


def checksum_seconds(layout: Any, model: torch.nn.Module, repeat: int) -> float:
    """One pass of `bucket_checksum` over every bucket (ours does one on each side)."""
    tensors = dict(model.named_parameters())
    buffers = [pack_bucket(bucket, tensors) for bucket in layout.buckets]
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for buffer in buffers:
            bucket_checksum(buffer)
        best = min(best, time.perf_counter() - start)
    return best


def best_memcpy_seconds(nbytes: int, repeat: int) -> float:
    source = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    target = torch.empty_like(source)
    target.copy_(source)  # touch the pages once
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        target.copy_(source)
        best = min(best, time.perf_counter() - start)
    return best


def broadcast_latency(group: SyncGroup, receivers: Any, calls: int) -> list[tuple[int, float]]:
    """Mean seconds per broadcast call of each size to every receiver (after one warm-up call)."""
    handles = receivers.call("probe", LATENCY_SIZES, calls + 1)
    rows = []
    for size in LATENCY_SIZES:
        buffer = torch.randint(0, 256, (size,), dtype=torch.uint8)
        group.broadcast(buffer).wait()
        start = time.perf_counter()
        for _ in range(calls):
            group.broadcast(buffer).wait()
        rows.append((size, (time.perf_counter() - start) / calls))
    receivers.wait(handles)
    return rows


def fit_latency(rows: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares `seconds = latency + bytes / bandwidth`; returns (latency s, bandwidth B/s)."""
    x = torch.tensor([size for size, _ in rows], dtype=torch.float64)
    y = torch.tensor([seconds for _, seconds in rows], dtype=torch.float64)
    slope = ((x - x.mean()) * (y - y.mean())).sum() / ((x - x.mean()) ** 2).sum()
    return float(y.mean() - slope * x.mean()), float(1 / slope)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None, help="a preset for the sizes below")
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32_000)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="model and wire dtype")
    parser.add_argument("--bucket-mb", type=int, default=128, help="bucket size of ours, MiB")
    parser.add_argument("--receivers", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3, help="syncs per scheme; the best is kept")
    parser.add_argument(
        "--rpc", choices=("pipe", "ray"), default="pipe", help="remote calls over Pipes or to Ray actors"
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=2,
        help="untimed syncs per scheme first (a run's steady state: shm receivers map each of the 2 "
        "slots once, paying its page faults, then reuse the mapping)",
    )
    parser.add_argument("--latency", action="store_true", help="also time gloo broadcast calls per size")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads of the learner (its sends, memcpy and checksum rows) and of each "
        "receiver; default: torch's own in the learner, 1 per receiver",
    )
    parser.add_argument(
        "--schemes",
        default=",".join(SCHEMES),
        help=f"comma-separated subset of {','.join(SCHEMES)} (memcpy and checksum rows always run)",
    )
    args = parser.parse_args()
    schemes = set(args.schemes.split(","))
    if not schemes <= set(SCHEMES):
        parser.error(f"--schemes: unknown {sorted(schemes - set(SCHEMES))}; choose from {','.join(SCHEMES)}")
    if args.threads is not None:
        if args.threads < 1:
            parser.error("--threads must be >= 1")
        torch.set_num_threads(args.threads)
    for key, value in SHAPES.get(args.shape, {}).items():
        setattr(args, key, value)
    if min(args.hidden, args.layers, args.vocab, args.bucket_mb, args.receivers, args.repeat) < 1:
        parser.error("sizes, --bucket-mb, --receivers and --repeat must be >= 1")
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")

    from rl_learner.senders import BroadcastSender, FileSender, ShmSender
    from rl_learner.sync import sync_layout

    config = model_config(args)
    model = build_model(config, DTYPES[args.dtype], seed=0)
    num_params = sum(p.numel() for p in model.parameters())
    num_tensors = len(list(model.parameters()))
    layout = sync_layout(model, bucket_bytes=args.bucket_mb * 2**20)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    world = 1 + args.receivers
    receivers = (RayReceivers if args.rpc == "ray" else PipeReceivers)(
        args.receivers, config, args.dtype, args.threads or 1
    )
    results: dict[str, list[float]] = {}
    shm_split: list[tuple[float, list[tuple[float, float]]]] = []
    latency_rows: list[tuple[int, float]] = []

    def timed(scheme: str, run: Callable[[int], None]) -> None:
        seconds = []
        for version in range(1, args.warmup + args.repeat + 1):
            with torch.no_grad():
                for param in model.parameters():
                    param.neg_()  # every sync moves other bytes
            gc.collect()
            start = time.perf_counter()
            run(version)
            seconds.append(time.perf_counter() - start)
            check_receivers(model, receivers, scheme)
        results[scheme] = seconds[args.warmup :]

    def own_group() -> SyncGroup:
        port = free_port()
        calls = receivers.call("join", port)
        group = SyncGroup(host="127.0.0.1", port=port, rank=0, world_size=world)
        receivers.wait(calls)
        return group

    try:
        if "per-parameter" in schemes:
            group = own_group()
            timed("per-parameter", lambda version: per_parameter_sync(model, group, receivers))
            if args.latency:
                latency_rows = broadcast_latency(group, receivers, calls=5)
            group.close()

        spec = WeightSyncSpec(transport="broadcast", layout=layout, port=free_port(), world_size=world)
        spec_bytes = encode(spec)
        if "bucketed" in schemes:
            calls = receivers.call("join", spec.port)
            sender = BroadcastSender(model, spec)
            receivers.wait(calls)
            timed("bucketed (ours)", lambda version: bucketed_sync(sender, spec_bytes, receivers, version))
            sender.close()

        if "unchecked" in schemes:
            group = own_group()
            timed(
                "  w/o checksums", lambda version: unchecked_sync(model, group, layout, spec_bytes, receivers)
            )
            group.close()

        if "file" in schemes:
            with tempfile.TemporaryDirectory(
                dir=SHARED_MEMORY if os.path.isdir(SHARED_MEMORY) else None
            ) as folder:
                file_spec = WeightSyncSpec(transport="file", layout=layout, directory=folder)
                file_bytes = encode(file_spec)
                file_sender = FileSender(model, file_spec)

                def file_sync(version: int) -> None:
                    file_sender.send(version=version)
                    receivers.wait(receivers.call("receive_file", file_bytes, version))

                timed("file, shared mem", file_sync)

        if "shm" in schemes:
            shm_spec = WeightSyncSpec(
                transport="shm", layout=layout, directory=shm_directory(), timeout_s=120
            )
            shm_bytes = encode(shm_spec)
            with ShmSender(model, shm_spec) as shm_sender:

                def shm_sync(version: int) -> None:
                    calls = receivers.call("receive_shm", shm_bytes, version)  # they wait for the version
                    shm_sender.send(version=version)
                    shm_split.append((shm_sender.last_report.seconds, receivers.wait(calls)))

                del shm_split[: -args.repeat]  # the timed ones

                timed("shm (ours)", shm_sync)
    finally:
        receivers.close()
    memcpy = median(best_memcpy_seconds(nbytes, 1) for _ in range(args.repeat))
    checksum = checksum_seconds(layout, model, args.repeat)

    print(
        f"Qwen2-style LM{f' ({args.shape})' if args.shape else ''}, {num_params / 1e6:.1f}M parameters "
        f"({num_tensors} tensors), {args.dtype}, "
        f"{nbytes / 1e6:.0f} MB of weights -> {args.receivers} receivers, gloo on 127.0.0.1, remote calls "
        f"over {args.rpc}; ours: {len(layout.buckets)} buckets of <= {args.bucket_mb} MiB; median [min-max] of "
        f"{args.repeat} after {args.warmup} untimed; torch {torch.__version__}, {os.cpu_count()} CPUs, {torch.get_num_threads()} learner "
        f"threads, {args.threads or 1} per receiver, load average "
        f"{os.getloadavg()[0]:.1f}; receivers verified equal after every sync"
    )
    header = f"{'scheme':<18} {'seconds':>8} {'[min - max]':>17} {'GB/s':>7} {'vs per-param':>13} {'of memcpy':>10}"
    print(header)
    print("-" * len(header))
    baseline = median(results["per-parameter"]) if "per-parameter" in results else float("nan")
    rows = [
        (name, median(times), f"[{min(times):.3f} - {max(times):.3f}]") for name, times in results.items()
    ]
    rows += [("memcpy (1 copy)", memcpy, ""), ("checksum (1 pass)", checksum, "")]
    for name, seconds, spread in rows:
        rate = nbytes / seconds
        print(
            f"{name:<18} {seconds:>8.3f} {spread:>17} {rate / 1e9:>7.2f} {baseline / seconds:>12.2f}x "
            f"{rate / (nbytes / memcpy):>9.1%}"
        )
    if shm_split:
        publish = median(sender for sender, _ in shm_split)
        reads = median(max(read for read, _ in replies) for _, replies in shm_split)
        print(
            f"\nshm split (medians): the sender's publish (pack + page checksum of every bucket) {publish:.3f} s; "
            f"the slower receiver's read from its first ready bucket on (checksum + load into its model, "
            f"overlapping the publish) {reads:.3f} s; one memcpy {memcpy:.3f} s, one bucket_checksum pass "
            f"{checksum:.3f} s"
        )
    if latency_rows:
        latency, bandwidth = fit_latency(latency_rows)
        print(f"\ngloo broadcast to {args.receivers} receivers, seconds per call (mean of 5):")
        for size, seconds in latency_rows:
            print(f"  {size / 2**10:>8.0f} KiB  {seconds * 1e3:>9.3f} ms  {size / seconds / 1e9:>6.2f} GB/s")
        per_param = num_tensors * latency
        print(
            f"  fit: {latency * 1e3:.3f} ms per call + bytes at {bandwidth / 1e9:.2f} GB/s; {num_tensors} "
            f"tensors x latency = {per_param:.3f} s of the per-parameter scheme's calls, the bytes "
            f"{nbytes / bandwidth:.3f} s: at most {(per_param + nbytes / bandwidth) / (nbytes / bandwidth):.2f}x "
            "for bucketing on this link (before the remote calls' own cost)"
        )


def median(values) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


if __name__ == "__main__":
    main()
