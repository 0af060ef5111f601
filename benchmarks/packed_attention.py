"""Time and memory of packed attention in length buckets against the dense block mask and padding.

Three ways to run the same forward + backward of S sequences through a causal LM:

    dense    the old packed forward: one row of N = ΣLᵢ tokens with a [1, 1, N, N] block-diagonal
             mask (bool for sdpa, additive float for eager): attention costs N² time and memory.
    padded   a plain right-padded [S, max L] batch with a [S, max L] padding mask: attention costs
             S·(max L)², the MLPs and the LM head also run on the padding.
    ours     `rl_learner.models.packed_logprobs`: the packed row, attention in length buckets
             (`length_buckets`, stock sdpa / eager kernels on right-padded [B_k, L_k] sub-batches):
             attention costs about ΣLᵢ², everything else runs on the N real tokens only.
    shared   ours with `share_prefix=True` (the learners' default): sequences that start with
             the same prompt run it once (`rl_learner.models.shared_prefix`), so embeddings,
             projections, MLPs and the LM head run on the Nc tokens of the compressed row.

All three compute the per-token log-probs of the same tokens with the same seeded model, then
back-propagate one fixed random upstream gradient; the table reports the median of `--repeats`
timed runs after one warm-up run, the peak memory, and the largest difference of the log-probs
from the dense path (they must agree to float32 rounding).

Memory: each variant runs in a fresh subprocess that builds the model, runs the variant once on
two short sequences (to page in code and set up autograd), notes its memory, then runs the full
batch; the peak is the high-water mark above that point: the resident set's (`ru_maxrss`) on
CPU, `torch.cuda.max_memory_allocated` on CUDA. Separate processes keep one variant's freed
pages or cached blocks from hiding the next one's peak.

Shapes (`--shapes`):
    preset  512 sequences of 15-35 tokens (uniform), the arithmetic preset's model
            (Qwen2, hidden 128, 2 layers, 4 heads, 2 KV heads, MLP 512, 1,024-token vocabulary);
    long    8 sequences of 1,500-2,500 tokens on a bigger tiny model (hidden 256, 4 layers,
            8 heads, 4 KV heads, MLP 1,024).
    grpo    GRPO groups on the preset's model: 32 prompts of 18-25 tokens x 8 responses of 2-5
            (the preset's own batch, whose ChatML prompts are ~20 tokens and answers 2-5);
    grpo-long   2 prompts of 1,000-1,499 tokens x 8 responses of 200-599, the long model;
    grpo-gpu    2 prompts of 1,024-2,047 tokens x 8 responses of 256-1,023 on a Qwen2-0.5B-wide
            model (hidden 896, 24 layers, 1,024-token vocabulary): for one GPU.

    python benchmarks/packed_attention.py [--shapes preset long grpo] [--variants ours shared]
        [--attention sdpa] [--threads 1] [--dtype float32]

The dense variant of `long` takes about a minute per run on one CPU core; `--repeats 1` is a
quicker check.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from rl_algos import logprobs_from_logits
from rl_data import ExperienceBatch, Trajectory, build_experience, packed_attention_mask
from rl_learner.models import shared_prefix

SHAPES = {
    "preset": {"sequences": 512, "min_length": 15, "max_length": 35, "hidden": 128, "layers": 2},
    "long": {"sequences": 8, "min_length": 1500, "max_length": 2500, "hidden": 256, "layers": 4},
    # GRPO groups: `prompts` prompts x `n` responses, each group's sequences start with one prompt
    "grpo": {"prompts": 32, "n": 8, "prompt": (18, 26), "response": (2, 6), "hidden": 128, "layers": 2},
    "grpo-long": {
        "prompts": 2,
        "n": 8,
        "prompt": (1000, 1500),
        "response": (200, 600),
        "hidden": 256,
        "layers": 4,
    },
    "grpo-gpu": {
        "prompts": 2,
        "n": 8,
        "prompt": (1024, 2048),
        "response": (256, 1024),
        "hidden": 896,
        "layers": 24,
    },
}
VARIANTS = ("dense", "padded", "ours", "shared")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def build_model(shape: dict, attention: str, device: torch.device, dtype: torch.dtype = torch.float32):
    from rl_data.tiny import build_tiny_model, build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer(vocab_size=1024, model_max_length=4096)
    hidden = shape["hidden"]
    model = build_tiny_model(
        tokenizer,
        hidden_size=hidden,
        num_layers=shape["layers"],
        num_heads=max(4, hidden // 32),
        num_kv_heads=max(2, hidden // 64),
        intermediate_size=4 * hidden,
        max_position_embeddings=4096,
        seed=0,
    )
    model.config._attn_implementation = attention
    return model.to(device=device, dtype=dtype).train()


def make_batch(shape: dict, vocab: int, seed: int, *, sequences: int | None = None) -> ExperienceBatch:
    """S sequences of uniform random length (half prompt, half response) and random token ids; for
    a GRPO shape, `prompts` groups of `n` (`sequences` given: that many groups of two)."""
    generator = torch.Generator().manual_seed(seed)
    if "prompts" in shape:
        records = []
        for _ in range(shape["prompts"] if sequences is None else sequences):
            prompt = torch.randint(
                3,
                vocab,
                (int(torch.randint(*shape["prompt"], (1,), generator=generator)),),
                generator=generator,
            )
            for _ in range(shape["n"] if sequences is None else 2):
                length = int(torch.randint(*shape["response"], (1,), generator=generator))
                records.append(
                    Trajectory(
                        prompt_ids=prompt,
                        response_ids=torch.randint(3, vocab, (length,), generator=generator),
                    )
                )
        return build_experience(records)
    count = shape["sequences"] if sequences is None else sequences
    lengths = torch.randint(shape["min_length"], shape["max_length"] + 1, (count,), generator=generator)
    records = []
    for length in lengths.tolist():
        ids = torch.randint(3, vocab, (length,), generator=generator)
        records.append(Trajectory(prompt_ids=ids[: length // 2], response_ids=ids[length // 2 :]))
    return build_experience(records)


def dense_logprobs(model, batch: ExperienceBatch) -> torch.Tensor:
    """The old packed forward: a [1, 1, N, N] mask, log-probs [N] with 0 at each sequence start."""
    device = model.device
    mask = packed_attention_mask(batch.cu_seqlens.to(device))[None, None]
    if model.config._attn_implementation == "eager":
        mask = torch.zeros(mask.shape, dtype=model.dtype, device=device).masked_fill_(
            ~mask, torch.finfo(model.dtype).min
        )
    input_ids = batch.input_ids.to(device)
    logits = model(
        input_ids=input_ids[None],
        position_ids=batch.position_ids.to(device)[None],
        attention_mask=mask,
        use_cache=False,
    ).logits[0]
    logprobs = torch.cat([logits.new_zeros(1), logprobs_from_logits(logits[:-1], input_ids[1:])])
    return torch.where(batch.position_ids.to(device) > 0, logprobs, 0.0)


def padded_logprobs(model, batch: ExperienceBatch) -> torch.Tensor:
    """A right-padded [S, max L] batch with a padding mask; log-probs back in packed order [N]."""
    device = model.device
    bounds = batch.cu_seqlens.tolist()
    lengths = torch.tensor([end - start for start, end in itertools.pairwise(bounds)], device=device)
    width = int(lengths.max())
    real = torch.arange(width, device=device)[None, :] < lengths[:, None]
    input_ids = torch.zeros(len(lengths), width, dtype=torch.int64, device=device)
    input_ids[real] = batch.input_ids.to(device)  # row-major order of `real` is packed order
    logits = model(input_ids=input_ids, attention_mask=real.long(), use_cache=False).logits
    step = logprobs_from_logits(logits[:, :-1], input_ids[:, 1:])
    return torch.cat([step.new_zeros(len(lengths), 1), step], dim=1)[real]


def ours_logprobs(model, batch: ExperienceBatch) -> torch.Tensor:
    from rl_learner.models import packed_logprobs

    return packed_logprobs(model, batch)


def shared_logprobs(model, batch: ExperienceBatch) -> torch.Tensor:
    from rl_learner.models import packed_logprobs

    return packed_logprobs(model, batch, share_prefix=True)


FUNCTIONS = {
    "dense": dense_logprobs,
    "padded": padded_logprobs,
    "ours": ours_logprobs,
    "shared": shared_logprobs,
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def run_once(function, model, batch: ExperienceBatch, upstream: torch.Tensor) -> tuple[float, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    sync(model.device)
    start = time.perf_counter()
    logprobs = function(model, batch)
    (logprobs * upstream).sum().backward()
    sync(model.device)
    return time.perf_counter() - start, logprobs.detach().cpu()


def child(args: argparse.Namespace) -> None:
    """Run one variant at one shape; print one JSON line (median seconds, peak extra bytes)."""
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    shape = SHAPES[args.shape]
    model = build_model(shape, args.attention, device, DTYPES[args.dtype])
    function = FUNCTIONS[args.child]
    batch = make_batch(shape, model.config.vocab_size, args.seed)
    upstream = torch.randn(batch.num_tokens, generator=torch.Generator().manual_seed(args.seed)).to(device)
    small = make_batch(shape, model.config.vocab_size, args.seed + 1, sequences=2)
    run_once(function, model, small, torch.ones(small.num_tokens, device=device))
    model.zero_grad(set_to_none=True)
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        baseline = torch.cuda.memory_allocated(device)
    else:
        baseline = peak_rss_bytes()
    times, logprobs = [], None
    for _ in range(args.repeats + 1):  # the first full-size run is the warm-up
        seconds, logprobs = run_once(function, model, batch, upstream)
        times.append(seconds)
    peak = (torch.cuda.max_memory_allocated(device) if device.type == "cuda" else peak_rss_bytes()) - baseline
    torch.save(logprobs, args.result)
    sharing = shared_prefix(batch) if args.child == "shared" else None
    tokens_run = batch.num_tokens - (sharing.saved_tokens if sharing is not None else 0)
    print(json.dumps({"seconds": statistics.median(times[1:]), "peak_bytes": peak, "tokens_run": tokens_run}))


def run_child(args: argparse.Namespace, shape: str, variant: str, result: str) -> dict | None:
    command = [sys.executable, os.path.abspath(__file__), "--child", variant, "--shape", shape]
    command += ["--result", result, "--attention", args.attention, "--device", args.device]
    command += ["--threads", str(args.threads), "--repeats", str(args.repeats), "--seed", str(args.seed)]
    command += ["--dtype", args.dtype]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        reason = "killed, out of memory?" if done.returncode == -9 else done.stderr.strip()[-2000:]
        print(f"{shape} {variant} failed (exit {done.returncode}): {reason}", file=sys.stderr)
        return None
    report = json.loads(done.stdout.strip().splitlines()[-1])
    report["logprobs"] = torch.load(result)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["preset", "long", "grpo"])
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--attention", choices=["sdpa", "eager"], default="sdpa")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch CPU threads")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per variant, after one warm-up")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--shape", choices=sorted(SHAPES), help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return

    print(
        f"forward + backward of per-token log-probs, {args.dtype}, attention {args.attention} on {args.device}, "
        f"torch {torch.__version__}, {args.threads} threads, median of {args.repeats} after 1 warm-up"
    )
    header = (
        f"{'shape':<9} {'tokens':>7} {'variant':<7} {'seconds':>8} {'vs ours':>8} {'peak MB':>8} "
        f"{'vs ours':>8} {'max|diff|':>9}"
    )
    print(header)
    print("-" * len(header))
    with tempfile.TemporaryDirectory() as scratch:
        for shape in args.shapes:
            batch = make_batch(SHAPES[shape], 1 << 30, args.seed)  # only its token count is used
            reports = {
                variant: run_child(args, shape, variant, os.path.join(scratch, f"{variant}.pt"))
                for variant in args.variants
            }
            if reports.get("shared") is not None:
                run = reports["shared"]["tokens_run"]
                print(f"{shape}: with shared prefixes the model runs {run} of the {batch.num_tokens} tokens")
            ours = reports.get("ours")
            exact = reports.get("dense") or ours  # the log-probs the others are compared with
            for variant, report in reports.items():
                if report is None:
                    print(f"{shape:<9} {batch.num_tokens:>7} {variant:<7} {'failed':>8}")
                    continue
                time_ratio = memory_ratio = diff = "-"
                if ours is not None:
                    time_ratio = f"{report['seconds'] / ours['seconds']:.2f}x"
                    memory_ratio = f"{report['peak_bytes'] / max(ours['peak_bytes'], 2**20):.2f}x"
                if exact is not None:
                    diff = f"{float((report['logprobs'] - exact['logprobs']).abs().max()):.1e}"
                print(
                    f"{shape:<9} {batch.num_tokens:>7} {variant:<7} {report['seconds']:>8.3f} {time_ratio:>8} "
                    f"{report['peak_bytes'] / 2**20:>8.1f} {memory_ratio:>8} {diff:>9}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
