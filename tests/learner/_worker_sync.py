"""Processes for tests/learner/test_sync.py: weight-sync receivers and ZeRO-3 learner ranks.

usage:
  python _worker_sync.py receiver RANK
      A receiving engine worker that stays up for the whole test module: it reads one JSON job
      per line on stdin and, per job, builds a freshly initialised tiny model (seed 1, so it
      differs from the sender's), joins the job's sync group as RANK and receives one broadcast
      sync per entry of `layouts` with a plain torch receiver (`rl_data.sync.broadcast.receive_buckets`,
      applying each bucket with `param.copy_`, as an engine's `load_weights` does). After each
      sync it writes `<tag>-report-<rank>.msgpack` (its WeightSyncReport) and
      `<tag>-state-<rank>.msgpack` (its model's state_dict); on an error `<tag>-error-<rank>.txt`;
      at the end `<tag>-done-<rank>`. Job keys: tag, out, spec (path of an encoded
      WeightSyncSpec), architecture, tied, dtype, layouts (per sync, the layout this receiver
      expects: "spec", "own" (planned from its own model's parameters) or "rebucketed" (the
      spec's parameters in 4 KiB buckets); a list, or a dict rank -> list). For a spec of the
      "shm" transport the receiver reads the job's `versions` (one per layout) with an
      `rl_data.sync.shm.ShmReader` instead of joining a group, waiting for each to be published.
  python _worker_sync.py learner RANK WORLD MASTER_PORT SPEC OUT
      One rank of a ZeRO-3 DeepSpeed learner (CPU, gloo) built from the tiny model with seed 0:
      one optimizer step, then `make_sender(spec, engine).send(version=5)` on every rank, then a
      second `send(version=6)` that a receiver rejects. Rank 0 writes `learner-state.msgpack` (the
      full weights after the step) and `learner-report.msgpack`; every rank writes
      `learner-<rank>.json` (whether it sent, whether its own `sync_layout` equals the spec's,
      the error of the second send).
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import traceback

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

from rl_data import decode, encode, plan_buckets
from rl_data.sync import WeightSyncError, WeightSyncSpec
from rl_data.sync.broadcast import SyncGroup, receive_buckets
from rl_data.sync.shm import ShmReader
from rl_data.tiny import build_tiny_model, build_tiny_tokenizer

SMALL_BUCKETS = 64 * 1024  # the bucket size test_sync.py plans with
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def sync_layouts(job: dict, rank: int, spec: WeightSyncSpec, params: dict) -> list:
    """The layout this receiver expects in each sync of the job: the spec's, its own, or re-bucketed."""
    kinds = job.get("layouts", ["spec"])
    if isinstance(kinds, dict):
        kinds = kinds[str(rank)]
    own = plan_buckets((name, p.dtype, p.shape) for name, p in params.items())
    rebucketed = plan_buckets(
        ((p.name, p.dtype, p.shape) for bucket in spec.layout.buckets for p in bucket.params),
        bucket_bytes=4096,
    )
    return [{"spec": spec.layout, "own": own, "rebucketed": rebucketed}[kind] for kind in kinds]


def run_job(job: dict, rank: int, tokenizer) -> None:
    out = pathlib.Path(job["out"])
    tag = job["tag"]
    spec = decode(pathlib.Path(job["spec"]).read_bytes(), WeightSyncSpec)
    model = build_tiny_model(
        tokenizer,
        architecture=job["architecture"],
        tie_word_embeddings=job["tied"],
        dtype=DTYPES[job["dtype"]],
        seed=1,
    )
    params = dict(model.named_parameters())

    def consume(bucket, tensors) -> None:
        with torch.no_grad():
            for name, tensor in tensors.items():
                params[name].copy_(tensor)

    shm = spec.transport == "shm"
    group = None if shm else SyncGroup.from_spec(spec, rank)
    try:
        for index, layout in enumerate(sync_layouts(job, rank, spec, params)):
            if shm:
                with ShmReader(spec.directory, layout, timeout_s=spec.timeout_s) as reader:
                    report = reader.read(consume, version=job["versions"][index])
            else:
                report = receive_buckets(group, layout, consume)
            (out / f"{tag}-report-{rank}.msgpack").write_bytes(encode(report))
            state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
            (out / f"{tag}-state-{rank}.msgpack").write_bytes(encode(state))
    except Exception as error:  # the test reads the message
        (out / f"{tag}-error-{rank}.txt").write_text(f"{type(error).__name__}: {error}")
    finally:
        if group is not None:
            group.close()


def receiver(rank: int) -> None:
    tokenizer = build_tiny_tokenizer()
    print("ready", flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        job = json.loads(line)
        try:
            run_job(job, rank, tokenizer)
        except Exception:
            pathlib.Path(job["out"], f"{job['tag']}-error-{rank}.txt").write_text(traceback.format_exc())
        pathlib.Path(job["out"], f"{job['tag']}-done-{rank}").write_text("")


def learner(rank: int, world: int, master_port: int, spec_path: str, out_dir: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(master_port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
    )
    import deepspeed

    from rl_learner.distributed import ensure_distributed
    from rl_learner.sync import make_sender, sync_layout

    out = pathlib.Path(out_dir)
    # through rl_learner: DeepSpeed's own start would first compile its shared-memory allreduce op,
    # which gloo training never calls (rl_learner.distributed)
    ensure_distributed()
    tokenizer = build_tiny_tokenizer()
    spec = decode(pathlib.Path(spec_path).read_bytes(), WeightSyncSpec)
    model = build_tiny_model(tokenizer, architecture="llama", tie_word_embeddings=True, seed=0)
    config = {
        "train_batch_size": 2 * world,
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": 3},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    generator = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, len(tokenizer), (2, 12), generator=generator)
    loss = engine(input_ids=tokens, labels=tokens).loss
    engine.backward(loss)
    engine.step()

    same_layout = sync_layout(engine, bucket_bytes=SMALL_BUCKETS) == spec.layout
    sender = make_sender(spec, engine)
    report = sender.send(version=5)
    names = [name for name, _ in engine.module.named_parameters()]
    params = [param for _, param in engine.module.named_parameters()]
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        if rank == 0:
            state = {name: param.detach().clone() for name, param in zip(names, params, strict=True)}
            (out / "learner-state.msgpack").write_bytes(encode(state))
            (out / "learner-report.msgpack").write_bytes(encode(report))
    try:
        sender.send(version=6)
        second_error = None
    except WeightSyncError as error:
        second_error = str(error)
    info = {
        "is_sender": sender.is_sender,
        "report_is_none": report is None,
        "same_layout": same_layout,
        "second_error": second_error,
    }
    (out / f"learner-{rank}.json").write_text(json.dumps(info))
    sender.close()
    # Leave DeepSpeed's world before exiting: left to interpreter shutdown, a gloo thread of the
    # rank whose peer failed mid-sync was once destroyed while joinable (SIGABRT, exit code -6).
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def main() -> None:
    role = sys.argv[1]
    if role == "receiver":
        receiver(int(sys.argv[2]))
    elif role == "learner":
        rank, world, port, spec_path, out_dir = sys.argv[2:7]
        learner(int(rank), int(world), int(port), spec_path, out_dir)
    else:
        raise SystemExit(f"unknown role {role!r}; expected 'receiver' or 'learner'")


if __name__ == "__main__":
    main()
