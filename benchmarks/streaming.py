"""Long-tailed rollouts: synchronous vs whole-step async vs partial rollout + streaming, side by side.

The workload. The arithmetic preset's SFT-warm-started policy (`rl_launch.presets`), with one
change: the row of its end-of-turn token (`<|im_end|>`, the EOS) in the output projection is
scaled by `--eos-scale` (0.2), so the EOS logit is a fifth of what the warm start learned. The
policy still writes its answer first, then often goes on writing digits and letters before it
ends: at temperature 1 with up to 512 new tokens the lengths come from the model and run from 2
tokens to the cap (on the preset's first 64 prompts x 8: mean 28, median 11, p90 63, p99 195,
max 512; mean reward 0.09, since a digit written right after the answer changes the number).
GRPO with the preset's reward (1 for the right number) then teaches it to end after the answer,
so the reward rises and the tail shrinks as it trains: a small-scale picture of a reasoning
model's long-tailed lengths. Every mode trains the same model on the same prompts with the same
settings (`--prompts` prompts x `--n` samples per step, `--steps` steps, lr `--lr`, one update
per batch, no KL, token-mean), one vLLM engine (in the actor's process) and one DeepSpeed
policy learner, through `rl-launch ppo` in a subprocess:

- `sync`: generate, then train, then sync (rollout.async_train false);
- `async`: whole-step async, depth 1: step t + 1's generation runs while step t trains, on the
  weights before step t's sync (an engine serves it after the generation queued before it);
- `stream`: rollout.async_train + rollout.partial_rollout + rollout.streaming, depth 1: a pool
  of 2 x `--prompts` groups in flight, a step trains on the first `--prompts` groups to finish,
  each sync lands between two decoding steps; `--modes stream-s1` is the same with
  rollout.max_staleness 1 (a group whose first token is more than one version behind the
  learner is dropped and another takes its place); `--modes stream-over` adds oversampling
  (rollout.generate_batch_size = 2 x prompts: a pool of 4 x prompts groups).

Reported per run (read from its metrics.jsonl): steady samples/s = samples of steps 2..N / the
sum of their step times (less any checkpoint), and response tokens/s the same way (the modes'
policies drift to different lengths, so samples are not the same work); the engine's idle fraction (time/engine_idle_fraction,
measured in the engine actor: time with no generate call in flight / wall time, steps 2..N); the
staleness (health/policy_lag: mean policy versions between the sampler's first token and the
learner, and async/token_staleness_mean per token); the mean response length; and the reward
curve (reward/mean per step, shown as means over step ranges, and the mean of the last third).
With `--repeats R` the modes run R times, alternating, and the ratios against `async` and the
spread of the last-third reward over the repeats are printed. The load average is printed
before and after every run (the machine may be shared).

    python benchmarks/streaming.py [--steps 24] [--prompts 16] [--n 4] [--max-new-tokens 512]
        [--repeats 2] [--modes sync async stream] [--eos-scale 0.2] [--lr 5e-4] [--option KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import grpo_vs_trl  # the sibling benchmark: the run settings every benchmark shares

ENVIRONMENT = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "DS_ACCELERATOR": "cpu",
    "TOKENIZERS_PARALLELISM": "false",
}
MODES: dict[str, dict[str, str]] = {
    "sync": {"rollout.async_train": "false"},
    "async": {"rollout.async_train": "true", "rollout.async_depth": "1"},
    "stream": {
        "rollout.async_train": "true",
        "rollout.async_depth": "1",
        "rollout.partial_rollout": "true",
        "rollout.streaming": "true",
    },
    "stream-s1": {  # streaming with a staleness bound of one version (groups further behind dropped)
        "rollout.async_train": "true",
        "rollout.async_depth": "1",
        "rollout.partial_rollout": "true",
        "rollout.streaming": "true",
        "rollout.max_staleness": "1",
    },
    "stream-s2": {  # streaming with a staleness bound of two versions
        "rollout.async_train": "true",
        "rollout.async_depth": "1",
        "rollout.partial_rollout": "true",
        "rollout.streaming": "true",
        "rollout.max_staleness": "2",
    },
    "stream-over": {
        "rollout.async_train": "true",
        "rollout.async_depth": "1",
        "rollout.partial_rollout": "true",
        "rollout.streaming": "true",
        "rollout.generate_batch_size": "2x",  # 2 x --prompts
    },
}


def load_average() -> str:
    with open("/proc/loadavg") as handle:
        return handle.read().split()[0]


def eos_shy_model(preset: Any, scale: float, folder: str) -> str:
    """The preset's policy with its end-of-turn row of the output projection scaled by `scale`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(preset.model_path)
    model = AutoModelForCausalLM.from_pretrained(preset.model_path, dtype=torch.float32)
    if model.config.tie_word_embeddings:
        raise RuntimeError(
            "the preset's model ties its embeddings: scaling the EOS row would change its input too"
        )
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    with torch.no_grad():
        model.lm_head.weight[eos] *= scale
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def overrides(
    args: argparse.Namespace, mode: str, model: str, preset: Any, output_dir: str, ray_dir: str
) -> dict:
    settings = {
        "preset": "none",
        "model.pretrain": model,
        "data.prompt_data": preset.train_path,
        "data.apply_chat_template": "true" if preset.apply_chat_template else "false",
        **grpo_vs_trl.GRPO_RUN,
        "rollout.engine": "vllm",
        "rollout.n_samples_per_prompt": str(args.n),
        "rollout.rollout_batch_size": str(args.prompts),
        "rollout.generate_max_len": str(args.max_new_tokens),
        "rollout.temperature": "1.0",
        "rollout.seed": str(args.seed),
        "train.seed": str(args.seed),
        "train.max_steps": str(args.steps),
        "train.train_batch_size": str(args.prompts * args.n),
        "train.actor_learning_rate": repr(args.lr),
        "model.dtype": "fp32",
        "log.output_dir": output_dir,
        "ray.temp_dir": ray_dir,
    }
    for key, value in MODES[mode].items():
        settings[key] = str(2 * args.prompts) if value == "2x" else value
    for item in args.option:  # every mode alike: --option reward.overlong_buffer_len=448
        key, _, value = item.partition("=")
        settings[key.removeprefix("--")] = value
    return settings


def run_mode(args: argparse.Namespace, mode: str, model: str, preset: Any, scratch: str) -> dict[str, Any]:
    output_dir = tempfile.mkdtemp(prefix=f"{mode}-", dir=scratch)
    ray_dir = tempfile.mkdtemp(prefix="rls-", dir="/tmp")
    command = [sys.executable, "-m", "rl_launch.cli", "ppo"]
    for key, value in overrides(args, mode, model, preset, output_dir, ray_dir).items():
        command += [f"--{key}", value]
    env = dict(os.environ, **ENVIRONMENT, RAY_AUTH_TOKEN=secrets.token_hex(16))
    before = load_average()
    began = time.perf_counter()
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout)
    finally:
        shutil.rmtree(ray_dir, ignore_errors=True)
    wall = time.perf_counter() - began
    with open(os.path.join(scratch, f"{os.path.basename(output_dir)}.log"), "w") as log:
        log.write(done.stdout + "\n--- stderr ---\n" + done.stderr)
    metrics_path = os.path.join(output_dir, "metrics.jsonl")
    if done.returncode != 0 or not os.path.exists(metrics_path):
        raise RuntimeError(f"{mode}: rl-launch ppo exited {done.returncode}\n{done.stderr[-3000:]}")
    with open(metrics_path) as handle:
        rows = sorted(
            (row for row in map(json.loads, filter(str.strip, handle)) if "time/step" in row),
            key=lambda row: row["step"],
        )
    return summarize(mode, rows, args.prompts * args.n) | {
        "wall": wall,
        "load": f"{before} → {load_average()}",
    }


def summarize(mode: str, rows: list[dict[str, Any]], samples: int) -> dict[str, Any]:
    steady = rows[1:]
    seconds = [row["time/step"] - row.get("time/checkpoint", 0.0) for row in steady]

    def mean(key: str) -> float:
        values = [row[key] for row in steady if key in row]
        return statistics.fmean(values) if values else float("nan")

    rewards = [row["reward/mean"] for row in rows]
    third = max(1, len(rewards) // 3)
    return {
        "mode": mode,
        "samples_per_s": samples * len(steady) / sum(seconds),
        # the modes' policies drift to different lengths: the response tokens they produced per second too
        "tokens_per_s": samples * sum(row["response_length/mean"] for row in steady) / sum(seconds),
        "step_s": statistics.median(seconds),
        "idle": mean("time/engine_idle_fraction"),
        "lag": mean("health/policy_lag"),
        "token_lag": mean("async/token_staleness_mean"),
        "staleness_max": max((row.get("async/staleness_max", 0.0) for row in rows), default=0.0),
        "length": mean("response_length/mean"),
        "length_first": rows[0]["response_length/mean"],
        "rewards": rewards,
        "reward_last": statistics.fmean(rewards[-third:]),
    }


def curve(rewards: list[float], parts: int = 4) -> str:
    size = max(1, len(rewards) // parts)
    return " ".join(f"{statistics.fmean(rewards[i : i + size]):.2f}" for i in range(0, len(rewards), size))


def report(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(
        f"\n{args.steps} steps x {args.prompts} prompts x n={args.n}, <= {args.max_new_tokens} new tokens, "
        f"eos scale {args.eos_scale}, lr {args.lr}; steady = steps 2..{args.steps}"
    )
    header = (
        f"{'mode':<12}{'samples/s':>10}{'tokens/s':>9}{'step s':>8}{'idle':>7}{'lag':>6}{'tok lag':>8}{'max':>5}"
        f"{'len 1st':>8}{'len':>7}{'reward last':>12}  reward by quarter        load"
    )
    print(header)
    for result in results:
        print(
            f"{result['mode']:<12}{result['samples_per_s']:>10.1f}{result['tokens_per_s']:>9.0f}{result['step_s']:>8.2f}{result['idle']:>7.2f}"
            f"{result['lag']:>6.2f}{result['token_lag']:>8.2f}{result['staleness_max']:>5.0f}"
            f"{result['length_first']:>8.1f}{result['length']:>7.1f}{result['reward_last']:>12.3f}  "
            f"{curve(result['rewards']):<24} {result['load']}"
        )
    by_mode: dict[str, list[dict[str, Any]]] = {}
    for result in results:
        by_mode.setdefault(result["mode"], []).append(result)
    if "async" in by_mode:
        for mode, runs in by_mode.items():
            if mode == "async":
                continue
            for key in ("samples_per_s", "tokens_per_s"):
                ratios = [run[key] / reference[key] for run, reference in zip(runs, by_mode["async"])]
                print(f"{mode} / async {key}, run by run: " + " ".join(f"{ratio:.2f}x" for ratio in ratios))
    for mode, runs in by_mode.items():
        last = [run["reward_last"] for run in runs]
        print(f"{mode}: reward over the last third {' '.join(f'{value:.3f}' for value in last)}"
              f" (spread {max(last) - min(last):.3f})")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--eos-scale", type=float, default=0.2)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--modes", nargs="+", choices=tuple(MODES), default=["sync", "async", "stream"])
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--option", action="append", default=[], help="KEY=VALUE for every mode's run")
    parser.add_argument("--scratch", default=None, help="folder for the runs (default: a temporary one)")
    args = parser.parse_args()

    from rl_launch.presets import prepare_preset

    scratch = args.scratch or tempfile.mkdtemp(prefix="streaming-bench-")
    os.makedirs(scratch, exist_ok=True)
    preset = prepare_preset("arithmetic", None, seed=0)
    model = eos_shy_model(preset, args.eos_scale, os.path.join(scratch, "model"))
    print(f"model: {model} (the preset's policy, EOS row x {args.eos_scale}); runs in {scratch}", flush=True)
    results = []
    for repeat in range(args.repeats):
        for mode in args.modes:
            # repeat r runs every mode with seed + r (sampler and data order): the spread over the
            # repeats is the noise a reward curve is compared within
            result = run_mode(
                argparse.Namespace(**{**vars(args), "seed": args.seed + repeat}), mode, model, preset, scratch
            )
            results.append(result)
            print(
                f"run {repeat + 1} {mode}: {result['samples_per_s']:.1f} samples/s, idle {result['idle']:.2f}, "
                f"reward last third {result['reward_last']:.3f}, wall {result['wall']:.0f} s, load {result['load']}",
                flush=True,
            )
    report(results, args)


if __name__ == "__main__":
    main()
