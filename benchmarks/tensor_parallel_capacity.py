"""The longest trainable sequence and the largest trainable width within a fixed memory per rank, TP = 2 vs 1.

Every probe is one row of benchmarks/fsdp2_vs_zero3.py in a fresh gloo world of its own (its
`run_row`, with one timed step): the real learner step (`rl_learner.PolicyLearner.train_step`
through `--train.backend fsdp2`: packed forward, the policy loss, backward, gradient norm, AdamW),
once to warm up and once measured, of

    tp1   1 rank, FSDP2: the whole model on one rank (TP = 1)
    tp2   2 ranks, FSDP2 with tensor_parallel_size 2 (FSDP × TP = 1 × 2: each rank holds half of
          every decoder layer's heads and MLP columns; both ranks run the same micro-batch)

A probe fits when its peak memory per rank is within `--budget-mb`: the resident-set high-water
mark of the measured step above the RSS before the model was built (the imported libraries), the
largest over the ranks, as fsdp2_vs_zero3.py measures it (benchmarks/peak_memory.py): parameters,
gradients, AdamW's moments, the step's activations and communication buffers, allocator slack.

Two searches per TP size, each doubling from a start until a probe does not fit (halving while the
start does not), then bisecting between the largest fitting and the smallest failing value until
they are one resolution step apart; TP = 2 starts from TP = 1's answer. The answer is low by up to
one step; "interp." estimates where the peak meets the budget, linear between the two bracketing
probes:

    sequence   one sequence of L tokens (a 16-token prompt, the rest actions) through a Qwen2 of
               `--hidden --layers --intermediate --heads --kv-heads --vocab`; L a multiple of
               `--seq-resolution`
    width      hidden size H at one sequence of `--width-tokens` tokens: `--heads` / `--kv-heads`
               heads of H / heads dimensions each, MLP `--mlp-ratio` × H, the other settings as
               above; H a multiple of `--width-resolution`

Printed: each probe as it finishes, then the table (largest fitting value, the smallest failing
one, the interpolated crossing, the peak and sharded state per rank at the largest, the probes)
and the ratios TP2 / TP1. Times are not reported: on 2 shared cores they measure the load, memory
does not.

    python benchmarks/tensor_parallel_capacity.py [--budget-mb 256] [--searches sequence width]
        [--hidden 256 --layers 4 --intermediate 1024 --heads 8 --kv-heads 4 --vocab 1024]
        [--width-tokens 512 --mlp-ratio 4] [--start-tokens 512 --start-hidden 256]
        [--seq-resolution 64 --width-resolution 16]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from fsdp2_vs_zero3 import run_row

SEARCHES = ("sequence", "width")


def largest_fitting(
    fits: Callable[[int], bool], start: int, unit: int, max_probes: int
) -> tuple[int | None, int | None]:
    """The largest multiple of `unit` for which `fits` holds, and the smallest one for which it does
    not (None where the probes ran out before finding one), assuming `fits` is monotone: doubling
    from `start` (halving while it does not fit), then bisection; at most `max_probes` calls."""
    low = high = None
    value, probes = max(unit, start // unit * unit), 0
    while probes < max_probes:
        probes += 1
        if fits(value):
            low = value
            if high is not None:
                break
            value *= 2
        else:
            high = value
            if low is not None or value == unit:
                break
            value = max(unit, value // 2 // unit * unit)
    while low is not None and high is not None and high - low > unit and probes < max_probes:
        probes += 1
        middle = low + (high - low) // unit // 2 * unit
        if fits(middle):
            low = middle
        else:
            high = middle
    return low, high


def shape_of(args: argparse.Namespace, search: str, value: int) -> dict[str, int]:
    """The fsdp2_vs_zero3.py settings of a probe of `search` at `value` (tokens or hidden size)."""
    if search == "sequence":
        return {"sequences": 1, "tokens": value}
    return {
        "sequences": 1,
        "tokens": args.width_tokens,
        "hidden": value,
        "intermediate": args.mlp_ratio * value,
    }


def run_search(args: argparse.Namespace, search: str, row: str, start: int) -> dict:
    """One search of `row` (tp1 or tp2): the answer, the smallest failing value and every probe."""
    unit = args.seq_resolution if search == "sequence" else args.width_resolution
    probes: dict[int, dict] = {}

    def fits(value: int) -> bool:
        settings = {**vars(args), **shape_of(args, search, value), "steps": 1}
        result = probes[value] = run_row(argparse.Namespace(**settings), row)
        print(
            f"  {search} {row} {value:>6}: peak {result['peak_mib']:7.1f} MiB/rank "
            f"(state {result['state_mib']:6.1f}) {'fits' if result['peak_mib'] <= args.budget_mb else 'over'}",
            flush=True,
        )
        return result["peak_mib"] <= args.budget_mb

    low, high = largest_fitting(fits, start, unit, args.max_probes)
    crossing = None  # where the peak meets the budget, linear between the two bracketing probes
    if low is not None and high is not None:
        below, above = probes[low]["peak_mib"], probes[high]["peak_mib"]
        crossing = low + (high - low) * (args.budget_mb - below) / max(above - below, 1e-9)
    return {"low": low, "high": high, "crossing": crossing, "best": probes.get(low), "probes": len(probes)}


def describe(args: argparse.Namespace) -> dict[str, str]:
    """What each search holds fixed, for the table."""
    return {
        "sequence": f"hidden {args.hidden}, MLP {args.intermediate}",
        "width": f"1 x {args.width_tokens} tokens, MLP {args.mlp_ratio}H",
    }


def print_table(args: argparse.Namespace, results: dict[str, dict[str, dict]]) -> None:
    header = (
        f"{'search':<8} {'fixed':<26} {'row':<4} {'largest':>8} {'fails at':>8} {'interp.':>8} "
        f"{'peak MiB/rank':>13} {'state MiB/rank':>14} {'probes':>6}"
    )
    print(header)
    print("-" * len(header))
    fixed = describe(args)
    for search, rows in results.items():
        for row, found in rows.items():
            best = found["best"] or {"peak_mib": float("nan"), "state_mib": float("nan")}
            low = f"{found['low']:,}" if found["low"] is not None else "none"
            high = f"{found['high']:,}" if found["high"] is not None else "-"
            crossing = f"{found['crossing']:,.0f}" if found["crossing"] is not None else "-"
            print(
                f"{search:<8} {fixed[search]:<26} {row:<4} {low:>8} {high:>8} {crossing:>8} "
                f"{best['peak_mib']:>13.1f} {best['state_mib']:>14.1f} {found['probes']:>6}"
            )
    for search, rows in results.items():
        one, two = rows["tp1"]["low"], rows["tp2"]["low"]
        if one and two:
            unit = "tokens" if search == "sequence" else "hidden size"
            line = f"tp2 / tp1, longest {search} ({unit}): {two:,} / {one:,} = {two / one:.2f}x"
            one, two = rows["tp1"]["crossing"], rows["tp2"]["crossing"]
            if one and two:
                line += f" (interpolated {two:,.0f} / {one:,.0f} = {two / one:.2f}x)"
            print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-mb", type=float, default=256.0, help="peak memory per rank, MiB")
    parser.add_argument("--searches", nargs="+", choices=SEARCHES, default=list(SEARCHES))
    for name, default in (
        ("hidden", 256),
        ("layers", 4),
        ("intermediate", 1024),
        ("heads", 8),
        ("kv-heads", 4),
        ("vocab", 1024),
        ("width-tokens", 512),
        ("mlp-ratio", 4),
        ("start-tokens", 512),
        ("start-hidden", 256),
        ("seq-resolution", 64),
        ("width-resolution", 16),
        ("max-probes", 10),
    ):
        parser.add_argument(f"--{name}", type=int, default=default)
    args = parser.parse_args()
    if args.width_resolution % (2 * args.heads):
        raise SystemExit(
            f"--width-resolution {args.width_resolution}: must be a multiple of 2 × --heads "
            f"({2 * args.heads}) so that every head has an even (rotary) dimension"
        )
    with open("/proc/loadavg") as load:
        print(f"load average before: {load.read().split()[0]}")
    print(
        f"Qwen2 x {args.layers} layers, {args.heads}/{args.kv_heads} heads, vocab {args.vocab}, fp32, sdpa, "
        f"torch {torch.__version__}, gloo, 1 thread per rank; budget {args.budget_mb:g} MiB peak per rank "
        "above the imported libraries"
    )
    results: dict[str, dict[str, dict]] = {}
    for search in args.searches:
        start = args.start_tokens if search == "sequence" else args.start_hidden
        tp1 = run_search(args, search, "tp1", start)
        tp2 = run_search(args, search, "tp2", tp1["low"] or start)
        results[search] = {"tp1": tp1, "tp2": tp2}
    print_table(args, results)
    with open("/proc/loadavg") as load:
        print(f"load average after: {load.read().split()[0]}")


if __name__ == "__main__":
    main()
