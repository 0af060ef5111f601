"""Rollout tokens/s: `VLLMEngine` against bare `vllm.LLM` and against `HFEngine`, same model and prompts.

Three variants generate the same workload (seeded random prompts of varying length, `--n`
samples each, temperature 1, `ignore_eos` so every response has exactly `--max-new-tokens`
tokens, log-probs of the sampled tokens on):

- `bare-vllm`: `vllm.LLM.generate` on token-id prompts, `logprobs=0`, engine started with
  `logprobs_mode="processed_logprobs"`: the floor our wrapper adds overhead to;
- `VLLMEngine`: `rl_rollout.engines.vllm.VLLMEngine.generate` (vLLM's async engine on a
  background loop, results converted to `Generation`s);
- `HFEngine`: `rl_rollout.engines.hf.HFEngine.generate` (transformers, batched decoding).

Each variant runs in a fresh subprocess (one vLLM engine at a time; start-up is not timed): one
warm-up round, then `--repeats` timed rounds; the table shows the best round's generated
tokens/s and the ratio to `VLLMEngine`. Without `--model`, the tiny test checkpoint
(`rl_data.tiny`) is built in a temporary folder.

    python benchmarks/rollout_throughput.py [--prompts 64 --n 4 --max-new-tokens 64 --dtype float32]

On a GPU machine with the official vLLM, point `--model` at a real checkpoint and compare
`VLLMEngine` with `bare-vllm` (target: within 10%).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

VARIANTS = ("bare-vllm", "VLLMEngine", "HFEngine")
ENVIRONMENT = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}


def make_prompts(count: int, min_len: int, max_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """`count` prompts of random token ids (ids 3.. vocab-1), lengths uniform in [min_len, max_len]."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(min_len, max_len))] for _ in range(count)]


def run_variant(args: argparse.Namespace) -> dict:
    """Start the variant's engine, run warm-up + timed rounds, return the measurements."""
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(args.model).vocab_size
    prompts = make_prompts(args.prompts, args.min_prompt_len, args.max_prompt_len, vocab)
    expected_tokens = len(prompts) * args.n * args.max_new_tokens
    started = time.perf_counter()
    if args.variant == "bare-vllm":
        from vllm import LLM
        from vllm import SamplingParams as VllmSamplingParams

        llm = LLM(
            args.model,
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            enforce_eager=args.enforce_eager,
            seed=0,
            logprobs_mode="processed_logprobs",
            disable_log_stats=True,
        )
        params = VllmSamplingParams(
            n=args.n,
            temperature=1.0,
            max_tokens=args.max_new_tokens,
            ignore_eos=True,
            logprobs=0,
            detokenize=False,
        )
        requests = [{"prompt_token_ids": prompt} for prompt in prompts]

        def generate() -> int:
            outputs = llm.generate(requests, params, use_tqdm=False)
            return sum(len(sample.token_ids) for output in outputs for sample in output.outputs)

        close = llm.llm_engine.engine_core.shutdown
    else:
        from rl_rollout.protocol import SamplingParams

        params = SamplingParams(
            n=args.n, temperature=1.0, max_new_tokens=args.max_new_tokens, ignore_eos=True
        )
        if args.variant == "VLLMEngine":
            from rl_rollout.engines.vllm import VLLMEngine

            engine = VLLMEngine(
                args.model,
                dtype=args.dtype,
                max_model_len=args.max_model_len,
                enforce_eager=args.enforce_eager,
                seed=0,
            )
        else:
            from rl_rollout.engines.hf import HFEngine

            engine = HFEngine(args.model, dtype=args.dtype, max_model_len=args.max_model_len, seed=0)

        def generate() -> int:
            results = engine.generate(prompts, params)
            return sum(len(sample.token_ids) for per_prompt in results for sample in per_prompt)

        close = engine.close
    startup_s = time.perf_counter() - started
    generate()  # warm-up
    rounds = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        tokens = generate()
        rounds.append(time.perf_counter() - start)
        if tokens != expected_tokens:
            raise RuntimeError(f"{args.variant}: generated {tokens} tokens, expected {expected_tokens}")
    close()
    return {
        "variant": args.variant,
        "tokens": expected_tokens,
        "seconds": min(rounds),
        "startup_s": startup_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint folder (default: the tiny test model, built here)")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--min-prompt-len", type=int, default=16)
    parser.add_argument("--max-prompt-len", type=int, default=96)
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-enforce-eager", dest="enforce_eager", action="store_false")
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {VARIANTS}"
    )
    parser.add_argument("--variant", help=argparse.SUPPRESS)  # internal: run one variant, print JSON
    args = parser.parse_args()
    for name, value in ENVIRONMENT.items():  # read by transformers and vLLM at import
        os.environ.setdefault(name, value)

    if args.variant:
        print("RESULT " + json.dumps(run_variant(args)), flush=True)
        return

    variants = [name.strip() for name in args.variants.split(",") if name.strip()]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"--variants: unknown {unknown}; expected a subset of {VARIANTS}")
    with tempfile.TemporaryDirectory() as scratch:
        if args.model is None:
            from rl_data.tiny import build_tiny_checkpoint

            args.model = str(build_tiny_checkpoint(os.path.join(scratch, "tiny")))
        results = {}
        for variant in variants:
            command = [sys.executable, __file__, "--variant", variant, "--model", args.model]
            for key in (
                "prompts",
                "min_prompt_len",
                "max_prompt_len",
                "n",
                "max_new_tokens",
                "max_model_len",
            ):
                command += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
            command += ["--dtype", args.dtype, "--repeats", str(args.repeats)]
            if not args.enforce_eager:
                command.append("--no-enforce-eager")
            done = subprocess.run(command, capture_output=True, text=True, timeout=3600)
            lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
            if done.returncode != 0 or not lines:
                print(f"{variant}: failed (exit {done.returncode})\n{done.stderr[-2000:]}", file=sys.stderr)
                continue
            results[variant] = json.loads(lines[-1].removeprefix("RESULT "))

    print(
        f"workload: {args.prompts} prompts of {args.min_prompt_len}-{args.max_prompt_len} tokens x n={args.n}, "
        f"{args.max_new_tokens} new tokens each, {args.dtype}, model {args.model}"
    )
    reference = results.get("VLLMEngine")
    print(f"{'variant':<12} {'tokens/s':>10} {'seconds':>9} {'start-up s':>11} {'vs VLLMEngine':>14}")
    for variant, result in results.items():
        rate = result["tokens"] / result["seconds"]
        ratio = f"{rate / (reference['tokens'] / reference['seconds']):.2f}x" if reference else "-"
        print(
            f"{variant:<12} {rate:>10.0f} {result['seconds']:>9.2f} {result['startup_s']:>11.1f} {ratio:>14}"
        )


if __name__ == "__main__":
    main()
