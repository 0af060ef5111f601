"""FSDP2 vs DeepSpeed ZeRO-3 learners, and tensor parallelism TP = 2 vs 1: step time and peak memory per rank.

Every row is the real learner step (`rl_learner.PolicyLearner.train_step`: packed forward, the
policy loss, backward, gradient norm, AdamW) of the same Qwen2 (built from a config, float32, sdpa,
seed 0) on the same per-rank micro-batch (`--sequences` sequences of `--tokens` tokens each, a
16-token prompt, random advantages and old log-probs), in a fresh gloo world of its own:

    fsdp2   2 ranks, `--train.backend fsdp2` (torch `fully_shard`, every decoder layer a unit)
    zero3   2 ranks, DeepSpeed ZeRO-3 (the default backend at train.zero_stage 3)
    tp1     1 rank, FSDP2: the whole model on one rank (TP = 1)
    tp2     2 ranks, FSDP2 with tensor_parallel_size 2 (FSDP × TP = 1 × 2: each rank holds half of
            every decoder layer's heads and MLP columns; both ranks run the same micro-batch)

Step time: the median over `--steps` timed steps (after one warm-up step) of the slowest rank's
wall time. Peak memory per rank: the resident-set high-water mark (Linux VmHWM, reset after the
warm-up by writing 5 to /proc/self/clear_refs, freed memory returned with malloc_trim and glibc's
mmap threshold fixed at 128 KiB, as benchmarks/sequence_parallel.py does) minus the RSS before the
model was built (the libraries imported): the model's shards, gradients, AdamW state and one step's activations and
communication buffers, the largest over the ranks. "state" is what the sharding alone predicts:
the bytes of this rank's parameter shards (FSDP2: `to_local()`; ZeRO-3: `ds_tensor`) × 4 for fp32
parameters, gradients and AdamW's two moments.

Ratios printed: fsdp2 / zero3 (time, peak) and tp2 / tp1 (peak). On CPU each rank runs one OpenMP
thread; the times compare the two backends' overheads at this shape, not a GPU's.
benchmarks/tensor_parallel_capacity.py runs the tp1 and tp2 rows (`run_row`) as the probes of its
longest-sequence and largest-width searches at a fixed memory per rank.

    python benchmarks/fsdp2_vs_zero3.py [--hidden 512 --layers 4 --intermediate 2048 --heads 8
        --kv-heads 4 --vocab 1024] [--sequences 2 --tokens 256] [--steps 3] [--rows fsdp2 zero3 tp1 tp2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
from peak_memory import qwen2_model, reset_peak, status_kib

PROMPT_TOKENS = 16
ROWS = {  # name: (ranks, DeepSpeedConfig keywords)
    "fsdp2": (2, {"backend": "fsdp2"}),
    "zero3": (2, {"backend": "deepspeed", "zero_stage": 3}),
    "tp1": (1, {"backend": "fsdp2"}),
    "tp2": (2, {"backend": "fsdp2", "tensor_parallel_size": 2}),
}


def micro_batch(args: argparse.Namespace, seed: int):
    """`--sequences` sequences of `--tokens` tokens, with the policy step's inputs filled."""
    from rl_data import Trajectory, build_experience

    generator = torch.Generator().manual_seed(seed)
    records = []
    for _ in range(args.sequences):
        ids = torch.randint(3, args.vocab, (args.tokens,), generator=generator)
        records.append(Trajectory(prompt_ids=ids[:PROMPT_TOKENS], response_ids=ids[PROMPT_TOKENS:]))
    batch = build_experience(records)
    on = batch.action_mask
    old = -7.0 + 0.1 * torch.randn(batch.num_tokens, generator=generator)
    batch.old_logprobs = torch.where(on, old, 0.0).float()
    batch.rollout_logprobs = batch.old_logprobs.clone()
    batch.advantages = torch.where(on, torch.randn(batch.num_tokens, generator=generator), 0.0).float()
    return batch


def state_bytes(learner) -> int:
    """This rank's parameter shards' bytes × 4 (fp32 parameters, gradients, AdamW's two moments)."""
    total = 0
    for param in learner.module.parameters():
        local = param.to_local() if hasattr(param, "to_local") else getattr(param, "ds_tensor", param)
        total += local.numel() * local.element_size()
    return 4 * total


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from rl_learner import DeepSpeedConfig, OptimizerConfig, PolicyLearner, PolicyLossConfig
    from rl_learner.distributed import ensure_distributed

    ensure_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    ds = DeepSpeedConfig(dtype="fp32", **ROWS[args.row][1])
    data_rank = rank // ds.tensor_parallel_size  # a TP group's ranks share their micro-batch
    batch = micro_batch(args, seed=data_rank)
    import deepspeed  # noqa: F401  # libraries the learners import lazily: before the baseline
    import torch.distributed.fsdp
    import torch.distributed.tensor.parallel
    import transformers.models.qwen2.modeling_qwen2  # noqa: F401

    before = reset_peak()
    learner = PolicyLearner(
        qwen2_model(args), deepspeed=ds, optimizer=OptimizerConfig(lr=1e-5, warmup_ratio=0.0), total_steps=100
    )
    loss = PolicyLossConfig()
    learner.train_step([batch], loss)  # warm-up: gradient buffers, optimizer state
    reset_peak()
    times = []
    for _ in range(args.steps):
        dist.barrier()
        start = time.perf_counter()
        learner.train_step([batch], loss)
        times.append(time.perf_counter() - start)
    peak = status_kib("VmHWM") * 1024 - before
    mine = torch.tensor([*times, peak, state_bytes(learner)], dtype=torch.float64)
    everyone = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine)
    if rank == 0:
        rows = torch.stack(everyone)
        step_times = rows[:, : args.steps].max(dim=0).values.tolist()  # the slowest rank per step
        report = {
            "row": args.row,
            "ranks": world,
            "step_s": statistics.median(step_times),
            "peak_mib": float(rows[:, args.steps].max()) / 2**20,
            "state_mib": float(rows[:, args.steps + 1].max()) / 2**20,
        }
        print(json.dumps(report), flush=True)
    dist.barrier()


def model_arguments(args: argparse.Namespace) -> list[str]:
    names = ("hidden", "layers", "intermediate", "heads", "kv_heads", "vocab", "sequences", "tokens", "steps")
    return [part for name in names for part in (f"--{name.replace('_', '-')}", str(getattr(args, name)))]


def run_row(args: argparse.Namespace, row: str) -> dict:
    """Start the row's ranks (one gloo world), return rank 0's report."""
    from rl_data.sync.broadcast import free_port

    ranks = ROWS[row][0]
    command = [sys.executable, os.path.abspath(__file__), "--worker", "--row", row, *model_arguments(args)]
    port = free_port()
    processes = []
    for rank in range(ranks):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": "0",
            "WORLD_SIZE": str(ranks),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            "MALLOC_MMAP_THRESHOLD_": str(128 * 1024),
        }
        out = subprocess.PIPE if rank == 0 else subprocess.DEVNULL
        processes.append(subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.DEVNULL, text=True))
    output, _ = processes[0].communicate(timeout=1800)
    codes = [processes[0].returncode] + [p.wait(timeout=600) for p in processes[1:]]
    if any(codes):
        raise SystemExit(f"row {row}: workers exited with {codes}")
    return json.loads(output.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (
        ("hidden", 512),
        ("layers", 4),
        ("intermediate", 2048),
        ("heads", 8),
        ("kv-heads", 4),
        ("vocab", 1024),
        ("sequences", 2),
        ("tokens", 256),
        ("steps", 3),
    ):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--row", choices=list(ROWS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    shape = (
        f"Qwen2 hidden {args.hidden} x {args.layers} layers, MLP {args.intermediate}, {args.heads}/"
        f"{args.kv_heads} heads, vocab {args.vocab}, fp32; per rank {args.sequences} x {args.tokens} tokens"
    )
    print(shape)
    print(f"{'row':<6} {'ranks':>5} {'step s':>8} {'peak MiB/rank':>14} {'state MiB/rank':>15}")
    results = {}
    for row in args.rows:
        result = results[row] = run_row(args, row)
        print(
            f"{row:<6} {result['ranks']:>5} {result['step_s']:>8.3f} {result['peak_mib']:>14.1f} "
            f"{result['state_mib']:>15.1f}",
            flush=True,
        )
    if {"fsdp2", "zero3"} <= results.keys():
        fsdp2, zero3 = results["fsdp2"], results["zero3"]
        print(
            f"fsdp2 / zero3: step time {fsdp2['step_s'] / zero3['step_s']:.2f}x, "
            f"peak memory per rank {fsdp2['peak_mib'] / zero3['peak_mib']:.2f}x"
        )
    if {"tp1", "tp2"} <= results.keys():
        print(
            f"tp2 / tp1: peak memory per rank {results['tp2']['peak_mib'] / results['tp1']['peak_mib']:.2f}x"
        )


if __name__ == "__main__":
    main()
