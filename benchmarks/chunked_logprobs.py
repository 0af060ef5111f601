"""Memory and time of the chunked log-probs / entropy of `rl_algos.logprobs` against the naive code.

The naive code is what most RL frameworks write:

    torch.log_softmax(logits, -1, dtype=torch.float32).gather(-1, labels[..., None]).squeeze(-1)
    logp = torch.log_softmax(logits, -1, dtype=torch.float32); -(logp.exp() * logp).sum(-1)

(with `--temperature T`, on ``logits.float().div_(T)``: the reference the tests use).

Each variant runs in a fresh subprocess that allocates the logits (fixed seed), notes its
memory, runs the variant a few times and reports the peak memory above that point: the
resident set's high-water mark (`ru_maxrss`) on CPU, `torch.cuda.max_memory_allocated` on
CUDA. Separate processes keep one variant's freed pages or cached blocks from hiding the next
one's peak. "fwd" runs under `torch.no_grad()`; "fwd+bwd" also back-propagates a random
upstream gradient into the logits (the bf16 gradient, the size of the logits, counts for both).

    python benchmarks/chunked_logprobs.py [--batch 4 --seq 4096 --vocab 151936 --dtype bf16]

On CPU the naive code needs 3.8x the logits' size on top of them for the forward pass and 5.7x
with the backward, so the defaults (5.0 GB of bf16 logits) want about 36 GB of free memory; a
child that the kernel kills for memory is reported as "failed" and the others still run.
`--modes fwd` skips the backward; `--batch 2 --seq 256 --vocab 32000` is a quick check.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import torch

from rl_algos.logprobs import default_chunk_size, entropy_from_logits, logprobs_from_logits

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SAMPLED_ROWS = 4  # gradient rows kept from each end of the batch to compare naive and ours


def naive_log_softmax(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    if temperature == 1.0:
        return torch.log_softmax(logits, -1, dtype=torch.float32)
    # Divided in float32 (dividing the bf16 logits would round z to bf16), in place on the
    # float32 copy that log_softmax(dtype=float32) makes anyway: no more memory than at T = 1.
    return torch.log_softmax(logits.float().div_(temperature), -1)


def naive_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float) -> torch.Tensor:
    return naive_log_softmax(logits, temperature).gather(-1, labels[..., None]).squeeze(-1)


def naive_entropy(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    logp = naive_log_softmax(logits, temperature)
    return -(logp.exp() * logp).sum(-1)


def make_inputs(
    args: argparse.Namespace, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits, labels and an upstream gradient, the same in every process for a given seed."""
    generator = torch.Generator().manual_seed(args.seed)
    rows = args.batch * args.seq
    logits = torch.empty(args.batch, args.seq, args.vocab, dtype=DTYPES[args.dtype], device=device)
    flat = logits.view(rows, args.vocab)
    # Filled a slab at a time from CPU so that no full-size float32 temporary inflates the baseline.
    slab = max(1, 2**16 // args.vocab)
    for start in range(0, rows, slab):
        block = torch.randn(min(slab, rows - start), args.vocab, generator=generator)
        flat[start : start + slab] = (2.0 * block).to(flat.dtype)
    labels = torch.randint(0, args.vocab, (args.batch, args.seq), generator=generator).to(device)
    upstream = torch.randn(args.batch, args.seq, generator=generator).to(device)
    return logits, labels, upstream


def variant(args: argparse.Namespace) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    kind, impl = args.child.split(":")
    temperature, chunk_size = args.temperature, args.chunk_size

    def logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if impl == "naive":
            return naive_logprobs(logits, labels, temperature)
        return logprobs_from_logits(logits, labels, temperature=temperature, chunk_size=chunk_size)

    def entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if impl == "naive":
            return naive_entropy(logits, temperature)
        return entropy_from_logits(logits, temperature=temperature, chunk_size=chunk_size)

    return logprobs if kind == "logprobs" else entropy


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_once(
    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    logits: torch.Tensor,
    labels: torch.Tensor,
    upstream: torch.Tensor,
    backward: bool,
) -> tuple[float, dict]:
    """Seconds for one call (and its backward), and the output plus a few gradient rows."""
    logits.grad = None
    sync(logits.device)
    start = time.perf_counter()
    with torch.set_grad_enabled(backward):
        out = fn(logits, labels)
        if backward:
            out.backward(upstream)
    sync(logits.device)
    seconds = time.perf_counter() - start
    result = {"out": out.detach().cpu()}
    if backward:
        rows = logits.grad.view(-1, logits.shape[-1])
        result["grad"] = torch.cat([rows[:SAMPLED_ROWS], rows[-SAMPLED_ROWS:]]).float().cpu()
    # Drop this run's gradient now, or it would still be alive during the next run.
    logits.grad = None
    return seconds, result


def child(args: argparse.Namespace) -> None:
    """Run one variant and print one JSON line: median seconds and peak extra bytes."""
    device = torch.device(args.device)
    fn = variant(args)
    backward = args.mode == "fwd+bwd"
    logits, labels, upstream = make_inputs(args, device)
    logits.requires_grad_(backward)
    # A first call pages in code (libtorch is resident set too) and sets up autograd: do it on a
    # few rows before the baseline so that the peak counts tensors only.
    tiny = logits.detach()[:1, :2].clone().requires_grad_(backward)
    run_once(fn, tiny, labels[:1, :2], upstream[:1, :2], backward)
    del tiny
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        baseline = torch.cuda.memory_allocated(device)
    else:
        baseline = peak_rss_bytes()

    times, result = [], {}
    for _ in range(args.repeats + 1):  # the first full-size run warms the allocator up
        seconds, result = run_once(fn, logits, labels, upstream, backward)
        times.append(seconds)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) - baseline
    else:
        peak = peak_rss_bytes() - baseline
    torch.save(result, args.result)
    print(json.dumps({"seconds": statistics.median(times[1:]), "peak_bytes": peak}))


def run_child(args: argparse.Namespace, variant: str, mode: str, result: str) -> dict | None:
    """The child's report and outputs, or None (with a note on stderr) if it failed."""
    command = [
        sys.executable,
        os.path.abspath(__file__),
        "--child",
        variant,
        "--mode",
        mode,
        "--result",
        result,
    ]
    for name in ("batch", "seq", "vocab", "dtype", "device", "temperature", "repeats", "seed"):
        command += [f"--{name}", str(getattr(args, name))]
    if args.chunk_size is not None:
        command += ["--chunk-size", str(args.chunk_size)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        # A child killed by the kernel's OOM killer exits with -9 and no traceback.
        reason = "killed, out of memory?" if done.returncode == -9 else done.stderr.strip()[-2000:]
        print(f"{variant} {mode} failed (exit {done.returncode}): {reason}", file=sys.stderr)
        return None
    report = json.loads(done.stdout.strip().splitlines()[-1])
    report.update(torch.load(result))
    return report


def max_diff(a: dict, b: dict, key: str) -> float:
    return float((a[key].double() - b[key].double()).abs().max())


def table_row(kind: str, mode: str, naive: dict | None, ours: dict | None) -> str:
    def ms(report: dict | None) -> str:
        return "failed" if report is None else f"{1e3 * report['seconds']:.1f}"

    def mb(report: dict | None) -> str:
        return "failed" if report is None else f"{report['peak_bytes'] / 2**20:.1f}"

    time_ratio = memory_ratio = value_diff = grad_diff = "-"
    if naive is not None and ours is not None:
        time_ratio = f"{ours['seconds'] / naive['seconds']:.2f}x"
        memory_ratio = f"{naive['peak_bytes'] / max(ours['peak_bytes'], 2**17):.1f}x"
        value_diff = f"{max_diff(naive, ours, 'out'):.1e}"
        if mode == "fwd+bwd":
            grad_diff = f"{max_diff(naive, ours, 'grad'):.1e}"
    return (
        f"{kind:<9} {mode:<8} {ms(naive):>9} {ms(ours):>9} {time_ratio:>10} {mb(naive):>9} {mb(ours):>8} "
        f"{memory_ratio:>10} {value_diff:>9} {grad_diff:>9}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--chunk-size", type=int, default=None, help="rows per chunk (default: automatic)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per variant, after one warm-up")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--modes", nargs="+", choices=["fwd", "fwd+bwd"], default=["fwd", "fwd+bwd"])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="fwd", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return

    rows = args.batch * args.seq
    logits_gb = rows * args.vocab * DTYPES[args.dtype].itemsize / 1e9
    chunk = args.chunk_size or default_chunk_size(args.vocab, args.device)
    print(
        f"logits [{args.batch}, {args.seq}, {args.vocab}] {args.dtype} ({logits_gb:.2f} GB) on {args.device}, "
        f"temperature {args.temperature}, chunk {chunk} rows, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, median of {args.repeats}"
    )
    header = (
        f"{'function':<9} {'pass':<8} {'naive ms':>9} {'ours ms':>9} {'ours/naive':>10} "
        f"{'naive MB':>9} {'ours MB':>8} {'naive/ours':>10} {'max|diff|':>9} {'grad diff':>9}"
    )
    print(header)
    print("-" * len(header))
    with tempfile.TemporaryDirectory() as scratch:
        for kind in ("logprobs", "entropy"):
            for mode in args.modes:
                naive = run_child(args, f"{kind}:naive", mode, os.path.join(scratch, "naive.pt"))
                ours = run_child(args, f"{kind}:ours", mode, os.path.join(scratch, "ours.pt"))
                print(table_row(kind, mode, naive, ours), flush=True)


if __name__ == "__main__":
    main()
