"""The longest sequence a learner trains within a fixed activation-memory budget per rank, by SP size.

One packed micro-batch holding one sequence of L tokens (a 16-token prompt, every other token an
action) runs the learners' train forward and backward: `rl_learner.models.packed_logprobs(model,
batch, with_entropy=True, only_actions=True, sequence_parallel=group)` (what
`PolicyLearner.train_step` calls), then the backward of a fixed random weighting of the per-token
log-probs and entropies. With SP = sp > 1 the sp ranks are processes of one gloo world
(`rl_learner.sequence_parallel`: each runs L / sp tokens through every token-local layer and the
full row of H / sp heads through attention, two all-to-alls a layer). For each SP size the script
finds by search the largest L (a multiple of `--resolution`) whose peak activation memory stays
within `--budget-mb` on every rank, and reports it, the peak per rank there, and the time per
token (wall time of the group's forward + backward / L, at its own largest L and at SP = 1's).

Model (`--layers`, `--hidden`, ...): a Qwen2 built from a config, float32, sdpa attention (the
packed, length-bucketed kernel: on CPU sdpa runs its flash kernel, memory linear in L), 8 query
and 4 key-value heads so that SP = 4 divides them, a 1,024-token vocabulary so that activations,
not the LM head's logits, dominate; gradient checkpointing off and on (`--checkpointing`).

Memory, how it is measured and why. On CPU there is no allocator counter like CUDA's
`max_memory_allocated`, so the peak is the process's resident-set high-water mark: Linux's VmHWM
in /proc/self/status, reset to the current RSS before each measurement by writing 5 to
/proc/self/clear_refs. The activation memory of one forward + backward at length L is VmHWM
minus the RSS just before it: everything the step touched beyond what the process already held
(weights, their gradient buffers, libraries, gloo). The gradient buffers are in that baseline
(warm-up steps allocate them and `zero_grad(set_to_none=False)` keeps them): they do not grow
with L and a learner keeps them between steps. The workers run with glibc's mmap threshold fixed
at 128 KiB (MALLOC_MMAP_THRESHOLD_, which also turns off its dynamic raise) and call
`malloc_trim(0)` before each measurement, so that a freed activation goes back to the OS and the
next measurement starts from the same floor; this lets one process measure many lengths instead
of starting a world per probe. `--check-fresh` re-measures each SP size's largest L in a fresh
world (one forward + backward at that length after the same warm-up) to show the two agree.
Peak RSS counts what torch's CPU allocator really touched, gloo's buffers and allocator slack
included, which is what the OS would run out of; a counter of live tensor bytes (torch's memory
tracker) would miss those and depend on which tensors torch chooses to keep.

Search (deterministic on every rank from the group's all-reduced peaks, so the ranks never need
to agree by message): two probes at `--start`·sp and twice that, then regula falsi on the peak
against L (close to linear) with a bisection step whenever the same end moved twice, until the
largest fitting and the smallest failing length are `--resolution` apart.

Time: each rank runs one OpenMP thread; SP = 2 on 2 cores uses both, SP = 4 oversubscribes them
(its time per token is not a speed measurement, its memory is). The fixed mmap threshold makes
every large tensor a fresh, page-faulted mapping, a cost every SP size pays alike.

    python benchmarks/sequence_parallel.py [--sp 1 2 4] [--checkpointing off on] [--budget-mb 256]
        [--layers 4 --hidden 128 --intermediate 512 --heads 8 --kv-heads 4 --vocab 1024]
        [--resolution 128] [--check-fresh]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch
from peak_memory import qwen2_model, reset_peak, status_kib

PROMPT_TOKENS = 16


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    model = qwen2_model(args, max_position_embeddings=1 << 20)
    if args.checkpointing == "on":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def one_sequence(length: int, vocab: int):
    """An `ExperienceBatch` of one sequence of `length` tokens: a 16-token prompt and its response."""
    from rl_data import Trajectory, build_experience

    generator = torch.Generator().manual_seed(length)
    ids = torch.randint(3, vocab, (length,), generator=generator)
    return build_experience([Trajectory(prompt_ids=ids[:PROMPT_TOKENS], response_ids=ids[PROMPT_TOKENS:])])


def train_forward_backward(model, length: int, group) -> float:
    """One forward + backward at `length` tokens; the seconds it took (this rank)."""
    from rl_learner.models import packed_logprobs

    batch = one_sequence(length, model.config.vocab_size)
    weights = torch.randn(length, generator=torch.Generator().manual_seed(1))
    start = time.perf_counter()
    logprobs, entropy = packed_logprobs(
        model, batch, with_entropy=True, only_actions=True, sequence_parallel=group
    )
    ((logprobs * weights).sum() + 0.01 * (entropy * weights).sum()).backward()
    return time.perf_counter() - start


class World:
    """This rank's view of its SP group: the group (None for SP 1) and all-reduces of probe results."""

    def __init__(self, sp: int) -> None:
        self.sp, self.group = sp, None
        if sp > 1:
            import torch.distributed as dist

            from rl_learner.sequence_parallel import new_sequence_parallel_group

            dist.init_process_group("gloo")
            self.group = new_sequence_parallel_group(sp)

    def gather(self, value: float) -> list[float]:
        """[value of rank 0, ..., value of rank sp−1] on every rank."""
        if self.sp == 1:
            return [value]
        import torch.distributed as dist

        values = torch.zeros(self.sp, dtype=torch.float64)
        values[self.group.rank] = value
        dist.all_reduce(values)
        return values.tolist()


def measure(model, length: int, world: World) -> dict:
    """Peak activation bytes of every rank and the group's seconds for one forward + backward."""
    model.zero_grad(set_to_none=False)
    if world.sp > 1:
        import torch.distributed as dist

        dist.barrier()
    floor = reset_peak()
    seconds = train_forward_backward(model, length, world.group)
    peak = status_kib("VmHWM") * 1024 - floor
    return {"length": length, "peaks": world.gather(float(peak)), "seconds": max(world.gather(seconds))}


def search(model, world: World, args: argparse.Namespace) -> tuple[dict, list[dict]]:
    """The largest fitting length's measurement and every probe (module docstring)."""
    budget = args.budget_mb * 2**20
    unit = -(-args.resolution // world.sp) * world.sp
    probes: list[dict] = []

    def probe(length: int) -> dict:
        result = measure(model, length, world)
        result["fits"] = max(result["peaks"]) <= budget
        probes.append(result)
        return result

    def peak(result: dict) -> float:
        return max(result["peaks"])

    low: dict | None = None
    high: dict | None = None
    moved: list[str] = []
    for length in (args.start * world.sp, 2 * args.start * world.sp):
        length = -(-length // unit) * unit
        result = probe(length)
        if result["fits"]:
            low = result if low is None or length > low["length"] else low
        elif high is None or length < high["length"]:
            high = result
    while len(probes) < args.max_probes:
        if low is None:  # even the first probe did not fit: halve
            length = max(unit, (high["length"] // 2) // unit * unit)
            if length == high["length"]:
                break
        elif high is None:  # extrapolate from the last two probes, aim a little past the budget
            a, b = probes[-2], probes[-1]
            slope = (peak(b) - peak(a)) / max(b["length"] - a["length"], 1)
            guess = b["length"] + (budget - peak(b)) / max(slope, 1.0)
            length = max(int(guess * 1.02) // unit * unit, low["length"] + unit)
        else:
            if high["length"] - low["length"] <= unit:
                break
            if len(moved) >= 2 and moved[-1] == moved[-2]:
                guess = (low["length"] + high["length"]) / 2
            else:
                slope = (peak(high) - peak(low)) / (high["length"] - low["length"])
                guess = low["length"] + (budget - peak(low)) / max(slope, 1e-9)
            length = int(guess) // unit * unit
            length = min(max(length, low["length"] + unit), high["length"] - unit)
        result = probe(length)
        if result["fits"]:
            low, side = result, "low"
        else:
            high, side = result, "high"
        moved.append(side)
    if low is None:
        raise SystemExit(f"sp {world.sp}: not even {unit} tokens fit in {args.budget_mb} MiB")
    return low, probes


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    world = World(args.sp)
    model = build_model(args)
    for _ in range(2):  # page in code, set up autograd and the gradient buffers
        train_forward_backward(model, 256 * args.sp, world.group)
    report: dict = {}
    if args.measure:
        report["fixed"] = [measure(model, length, world) for length in args.measure]
    else:
        best, probes = search(model, world, args)
        report["best"], report["probes"] = best, probes
        report["timed"] = [best, *(measure(model, length, world) for length in args.time_at or [])]
    if world.sp == 1 or world.group.rank == 0:
        print(json.dumps(report), flush=True)
    if world.sp > 1:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()


def model_arguments(args: argparse.Namespace) -> list[str]:
    names = ("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab")
    return [part for name in names for part in (f"--{name.replace('_', '-')}", str(getattr(args, name)))]


def run_world(args: argparse.Namespace, sp: int, checkpointing: str, extra: list[str]) -> dict:
    """Start `sp` worker processes (one gloo world), return rank 0's report."""
    from rl_data.sync.broadcast import free_port

    command = [sys.executable, os.path.abspath(__file__), "--worker", "--sp-size", str(sp)]
    command += ["--checkpointing-mode", checkpointing, *model_arguments(args)]
    command += ["--budget-mb", str(args.budget_mb), "--resolution", str(args.resolution)]
    command += ["--start", str(args.start), "--max-probes", str(args.max_probes), *extra]
    port = free_port()
    processes = []
    for rank in range(sp):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": str(sp),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            "MALLOC_MMAP_THRESHOLD_": str(128 * 1024),
        }
        processes.append(
            subprocess.Popen(
                command, env=env, stdout=subprocess.PIPE if rank == 0 else subprocess.DEVNULL, text=True
            )
        )
    output, _ = processes[0].communicate()
    codes = [processes[0].returncode] + [p.wait() for p in processes[1:]]
    if any(codes):
        raise SystemExit(f"sp {sp}, checkpointing {checkpointing}: workers exited with {codes}")
    return json.loads(output.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sp", type=int, nargs="+", default=[1, 2, 4], help="SP sizes (the first is the base)"
    )
    parser.add_argument("--checkpointing", nargs="+", choices=["off", "on"], default=["off", "on"])
    parser.add_argument("--budget-mb", type=float, default=96.0, help="activation memory per rank, MiB")
    parser.add_argument("--resolution", type=int, default=32, help="tokens; lengths are multiples of it")
    parser.add_argument("--start", type=int, default=512, help="first probe: start × sp tokens")
    parser.add_argument("--max-probes", type=int, default=12)
    parser.add_argument(
        "--check-fresh", action="store_true", help="re-measure each best length in a new world"
    )
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--intermediate", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--sp-size", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--checkpointing-mode", choices=["off", "on"], help=argparse.SUPPRESS)
    parser.add_argument("--measure", type=int, nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--time-at", type=int, nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.sp, args.checkpointing = args.sp_size, args.checkpointing_mode
        worker(args)
        return

    with open("/proc/loadavg") as load:
        print(f"load average before: {load.read().split()[0]}")
    print(
        f"forward + backward of per-token log-probs and entropies of one sequence, Qwen2 hidden {args.hidden} "
        f"x {args.layers} layers, {args.heads} heads / {args.kv_heads} KV heads, MLP {args.intermediate}, "
        f"vocabulary {args.vocab}, float32, sdpa, gloo, torch {torch.__version__}, 1 thread per rank; "
        f"budget {args.budget_mb:g} MiB of activation memory per rank, resolution {args.resolution} tokens"
    )
    header = (
        f"{'ckpt':<4} {'sp':>2} {'max tokens':>10} {'vs sp1':>7} {'peak MiB/rank':>22} "
        f"{'ms/1k tok':>9} {'ms/1k tok @ sp1 max':>19} {'probes':>6}"
    )
    if args.check_fresh:
        header += f" {'fresh MiB':>9}"
    print(header)
    print("-" * len(header))
    for checkpointing in args.checkpointing:
        base_length = None
        for sp in args.sp:
            extra = ["--time-at", str(base_length)] if base_length else []
            report = run_world(args, sp, checkpointing, extra)
            best = report["best"]
            timed = {item["length"]: item for item in report["timed"]}
            own = timed[best["length"]]["seconds"] / best["length"] * 1e6
            base_length = base_length or best["length"]
            at_base = (
                f"{timed[base_length]['seconds'] / base_length * 1e6:.1f}" if base_length in timed else "-"
            )
            peaks = "/".join(f"{peak / 2**20:.0f}" for peak in best["peaks"])
            ratio = best["length"] / base_length
            line = (
                f"{checkpointing:<4} {sp:>2} {best['length']:>10} {ratio:>6.2f}x {peaks:>22} "
                f"{own:>9.1f} {at_base:>19} {len(report['probes']):>6}"
            )
            if args.check_fresh:
                fresh = run_world(args, sp, checkpointing, ["--measure", str(best["length"])])["fixed"][0]
                line += f" {max(fresh['peaks']) / 2**20:>9.0f}"
            print(line, flush=True)
    with open("/proc/loadavg") as load:
        print(f"load average after: {load.read().split()[0]}")


if __name__ == "__main__":
    main()
