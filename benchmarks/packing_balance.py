"""Compute lost to padding and imbalance: naive padded micro-batches vs packed, balanced plans.

One global batch of sequence lengths is drawn from a long-tailed log-normal distribution
(median a few hundred tokens, clipped to [32, 16384], so a visible tail reaches the cap) and
laid out over data-parallel ranks in two ways:

- naive: the batch in random order, split into equal-count shards per rank, each shard cut
  into fixed-size micro-batches of padded rows; the micro-batch size is chosen so a micro-batch
  holds about `--max-tokens` real tokens on average. Waste = padding fraction
  (1 − real tokens / Σ batch size · longest sequence in the batch).
- ours: `rl_data.batching.plan_micro_batches` (packed, no padding; ranks balanced by
  Karmarkar–Karp, micro-batches of at most `--max-tokens` tokens). Waste = lockstep waste
  (1 − real tokens / Σ_j ranks · largest micro-batch of step j): the compute lost while every
  rank waits for the largest micro-batch at each micro-step.

It also reports token balance across ranks (max / mean), the largest micro-batch in tokens as
computed (padding included for the naive layout), and the time to plan a larger batch
(`--plan-size`, 100,000 by default) with Karmarkar–Karp and with the greedy largest-first rule.

    python benchmarks/packing_balance.py [--batch 4096 --ranks 8 --max-tokens 16384 --seed 0]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np

from rl_data.batching import (
    fixed_size_batches,
    greedy_partition,
    karmarkar_karp,
    padded_fraction,
    plan_micro_batches,
)

MIN_LENGTH = 32


def draw_lengths(
    count: int, median: float, sigma: float, max_length: int, rng: np.random.Generator
) -> list[int]:
    """Log-normal lengths with the given median, clipped to [MIN_LENGTH, max_length]."""
    raw = rng.lognormal(mean=np.log(median), sigma=sigma, size=count)
    return np.clip(np.rint(raw), MIN_LENGTH, max_length).astype(np.int64).tolist()


def naive_layout(lengths: list[int], ranks: int, batch_size: int) -> dict[str, float]:
    """Equal-count shards per rank (lengths are already in random order), fixed-size padded micro-batches."""
    shard = -(-len(lengths) // ranks)
    rank_tokens, batches = [], []
    for start in range(0, len(lengths), shard):
        indices = list(range(start, min(start + shard, len(lengths))))
        rank_tokens.append(sum(lengths[i] for i in indices))
        batches += [[indices[i] for i in batch] for batch in fixed_size_batches(indices, batch_size)]
    return {
        "waste": padded_fraction(lengths, batches),
        "balance": max(rank_tokens) / statistics.fmean(rank_tokens),
        "micro_batches": -(-shard // batch_size),
        "largest": max(len(batch) * max(lengths[i] for i in batch) for batch in batches),
        "empty": 0,
    }


def plan_layout(lengths: list[int], ranks: int, max_tokens: int, partition: str) -> dict[str, float]:
    plan = plan_micro_batches(lengths, max_tokens=max_tokens, num_ranks=ranks, partition=partition)
    return {
        "waste": plan.lockstep_waste,
        "balance": plan.balance,
        "micro_batches": plan.num_micro_batches,
        "largest": max(max(row) for row in plan.micro_batch_tokens),
        "empty": plan.num_empty_micro_batches,
    }


def median_seconds(function: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4096, help="sequences in the global batch")
    parser.add_argument("--ranks", type=int, default=8, help="data-parallel ranks")
    parser.add_argument("--max-tokens", type=int, default=16384, help="token budget of one micro-batch")
    parser.add_argument("--median", type=float, default=400.0, help="median sequence length")
    parser.add_argument("--sigma", type=float, default=1.3, help="log-normal sigma (tail weight)")
    parser.add_argument("--plan-size", type=int, default=100_000, help="sequences for the timing rows")
    parser.add_argument("--repeats", type=int, default=3, help="timing repeats (median is reported)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    rng = np.random.default_rng(args.seed)
    lengths = draw_lengths(args.batch, args.median, args.sigma, args.max_tokens, rng)
    mean_length = statistics.fmean(lengths)
    batch_size = max(1, round(args.max_tokens / mean_length))
    at_cap = sum(length == args.max_tokens for length in lengths)
    print(
        f"{args.batch} sequences, {args.ranks} ranks, budget {args.max_tokens} tokens per micro-batch; lengths: "
        f"median {int(np.median(lengths))}, mean {mean_length:.0f}, p99 {int(np.percentile(lengths, 99))}, "
        f"max {max(lengths)} ({at_cap} at the cap); naive micro-batch size {batch_size} sequences"
    )

    naive = naive_layout(lengths, args.ranks, batch_size)
    ours = plan_layout(lengths, args.ranks, args.max_tokens, "karmarkar_karp")
    greedy = plan_layout(lengths, args.ranks, args.max_tokens, "greedy")

    big = draw_lengths(args.plan_size, args.median, args.sigma, args.max_tokens, rng)
    timing = {
        "plan_kk": median_seconds(
            lambda: plan_micro_batches(big, max_tokens=args.max_tokens, num_ranks=args.ranks), args.repeats
        ),
        "plan_greedy": median_seconds(
            lambda: plan_micro_batches(
                big, max_tokens=args.max_tokens, num_ranks=args.ranks, partition="greedy"
            ),
            args.repeats,
        ),
        "kk": median_seconds(lambda: karmarkar_karp(big, args.ranks), args.repeats),
        "greedy": median_seconds(lambda: greedy_partition(big, args.ranks), args.repeats),
    }

    def ratio(a: float, b: float) -> str:
        return f"{a / b:.1f}x" if b > 0 else "inf"

    rows = [
        ("metric", "naive", "ours (KK)", "ours (greedy)", "naive/ours", "target"),
        (
            "wasted compute (padding | lockstep)",
            f"{naive['waste']:.1%}",
            f"{ours['waste']:.2%}",
            f"{greedy['waste']:.2%}",
            ratio(naive["waste"], ours["waste"]),
            "<= 3%",
        ),
        (
            "token balance max/mean over ranks",
            f"{naive['balance']:.4f}",
            f"{ours['balance']:.4f}",
            f"{greedy['balance']:.4f}",
            "",
            "<= 1.05",
        ),
        (
            "micro-batches per rank",
            f"{naive['micro_batches']}",
            f"{ours['micro_batches']}",
            f"{greedy['micro_batches']}",
            "",
            "",
        ),
        (
            "largest micro-batch, tokens computed",
            f"{naive['largest']}",
            f"{ours['largest']}",
            f"{greedy['largest']}",
            ratio(naive["largest"], ours["largest"]),
            f"<= {args.max_tokens}",
        ),
        ("empty micro-batches", "0", f"{ours['empty']}", f"{greedy['empty']}", "", "0"),
        (
            f"plan {args.plan_size} sequences, s",
            "-",
            f"{timing['plan_kk']:.3f}",
            f"{timing['plan_greedy']:.3f}",
            "",
            "< 1 s",
        ),
        (
            f"partition {args.plan_size} into {args.ranks}, s",
            "-",
            f"{timing['kk']:.3f}",
            f"{timing['greedy']:.3f}",
            "",
            "< 1 s",
        ),
    ]
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    for index, row in enumerate(rows):
        print(
            "  ".join(
                cell.ljust(width) if c == 0 else cell.rjust(width)
                for c, (cell, width) in enumerate(zip(row, widths))
            )
        )
        if index == 0:
            print("  ".join("-" * width for width in widths))


if __name__ == "__main__":
    main()
