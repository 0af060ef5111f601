"""Our GRPO step against the sum of its bare parts, at the demo and the long workload of grpo_vs_trl.

A step of `rl-launch ppo` (GRPO, one update per batch) generates the step's prompts x n
samples, scores them, trains once on them and sends the new weights to the engine. The floor
for that work on this machine is the sum of three bare parts doing the same work in one plain
process, each timed after a warm-up round:

- generation: `vllm.LLM.generate` of the same prompts (the preset's first `prompts` training
  prompts, as token ids) x n, the same sampling (temperature 1, `max_new_tokens`, `min_tokens`
  = max_new_tokens at the long workload, log-probs of the sampled tokens), the engine started as ours starts it
  (fp32, prefix caching, whole prefills, `max_num_seqs` = the step's samples);
- training: a bare torch forward + backward + AdamW step of the same model on the sequences
  that bare generation produced (prompt + response, right-padded into one [samples, max len]
  batch, per-token log-probs of the response tokens, the clipped PPO objective at ratio 1 with
  random advantages, token-mean), gradient clipping as `train.max_norm`;
- sync: one memcpy of the model's weights into a preallocated buffer of the same bytes.

`ours` is one `rl-launch ppo` run of `--steps` steps at the workload's settings
(`grpo_vs_trl.run_ours`); its step time and phases are medians over steps 2..N of
metrics.jsonl (time/step less any checkpoint; time/generation, experience, training, sync).
Printed: each phase against its bare part, the step against the sum, the ratio (target
<= 1.15x at the long workload), and where the rest of our step goes.

    python benchmarks/step_limit.py [--workload demo|long|both] [--steps 6] [--rounds 3] [--repeats 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import grpo_vs_trl  # the sibling benchmark: workloads and our side's runner


def bare_parts(spec: dict[str, Any]) -> dict[str, Any]:
    """Time the bare parts of one step (in this process: `--variant bare`)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import LLM
    from vllm import SamplingParams as VllmSamplingParams

    tokenizer = AutoTokenizer.from_pretrained(spec["model_path"])
    dataset = grpo_vs_trl.prompt_dataset(spec, tokenizer)
    prompts = [dataset[i].prompt_ids.tolist() for i in range(spec["prompts"])]
    samples = spec["prompts"] * spec["n"]
    llm = LLM(
        spec["model_path"],
        dtype="float32",
        max_model_len=spec["prompt_max_len"] + spec["max_new_tokens"],
        seed=spec["seed"],
        enable_prefix_caching=True,
        enable_chunked_prefill=False,
        max_num_seqs=samples,
        logprobs_mode="processed_logprobs",
        disable_log_stats=True,
    )
    requests = [{"prompt_token_ids": prompt} for prompt in prompts]
    generated: list[tuple[list[int], list[int]]] = []
    generation = []
    for round_ in range(spec["rounds"] + 1):
        params = VllmSamplingParams(
            n=spec["n"],
            temperature=1.0,
            top_p=1.0,
            max_tokens=spec["max_new_tokens"],
            min_tokens=spec["max_new_tokens"] if spec["fixed_length"] else 0,
            logprobs=0,
            detokenize=False,
            seed=spec["seed"] + round_,
        )
        began = time.perf_counter()
        outputs = llm.generate(requests, params, use_tqdm=False)
        generation.append(time.perf_counter() - began)
        generated = [
            (prompt, list(sample.token_ids))
            for prompt, out in zip(prompts, outputs)
            for sample in out.outputs
        ]
    llm.llm_engine.engine_core.shutdown()
    del llm

    model = AutoModelForCausalLM.from_pretrained(spec["model_path"], dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=spec["lr"], betas=tuple(spec["betas"]), eps=1e-8, weight_decay=0.0
    )
    lengths = [len(p) + len(r) for p, r in generated]
    width = max(lengths)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    input_ids = torch.full((len(generated), width), pad, dtype=torch.long)
    attention = torch.zeros((len(generated), width), dtype=torch.long)
    response = torch.zeros((len(generated), width), dtype=torch.bool)
    for row, (prompt, answer) in enumerate(generated):
        input_ids[row, : len(prompt) + len(answer)] = torch.tensor(prompt + answer)
        attention[row, : len(prompt) + len(answer)] = 1
        response[row, len(prompt) : len(prompt) + len(answer)] = True
    generator = torch.Generator().manual_seed(spec["seed"])
    advantages = torch.randn(len(generated), 1, generator=generator)
    target_mask = response[:, 1:]

    def train_once() -> None:
        logits = model(input_ids=input_ids, attention_mask=attention).logits[:, :-1].float()
        logprobs = torch.log_softmax(logits / spec["temperature"], dim=-1)
        logprobs = logprobs.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
        ratio = torch.exp(logprobs - logprobs.detach())
        clipped = torch.clamp(ratio, 1 - spec["eps_clip"], 1 + spec["eps_clip"])
        loss = -torch.minimum(ratio * advantages, clipped * advantages)
        loss = (loss * target_mask).sum() / target_mask.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec["max_norm"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    training = []
    for _ in range(spec["rounds"] + 1):
        began = time.perf_counter()
        train_once()
        training.append(time.perf_counter() - began)

    parameters = [p.detach() for p in model.parameters()]
    buffer = torch.empty(sum(p.numel() for p in parameters), dtype=torch.float32)
    sync = []
    for _ in range(spec["rounds"] + 1):
        began = time.perf_counter()
        offset = 0
        for p in parameters:
            buffer[offset : offset + p.numel()].copy_(p.reshape(-1))
            offset += p.numel()
        sync.append(time.perf_counter() - began)
    return {
        "generation": generation[1:],
        "training": training[1:],
        "sync": sync[1:],
        "tokens": sum(lengths),
        "response_tokens": sum(len(r) for _, r in generated),
        "padded_tokens": len(generated) * width,
        "weight_bytes": buffer.numel() * 4,
        "torch_threads": torch.get_num_threads(),
    }


def median_phases(raw: dict[str, Any]) -> dict[str, float]:
    """Medians over steps 2..N of our step time and its phases."""
    steps = raw["steps"][1:] or raw["steps"]
    out = {"step": statistics.median(step["seconds"] for step in steps)}
    for name in grpo_vs_trl.PHASES:
        out[name] = statistics.median(step["phases"][name] for step in steps)
    out["other"] = statistics.median(step["seconds"] - sum(step["phases"].values()) for step in steps)
    return out


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def measure(args: argparse.Namespace, workload: str, preset: Any, scratch: str) -> list[float]:
    from rl_launch.cli import resolve_ppo_config
    from rl_launch.presets.arithmetic import settings

    tuned = settings()
    run_args = argparse.Namespace(**vars(args))
    shape = grpo_vs_trl.WORKLOADS[workload]
    run_args.steps = args.steps
    run_args.n = shape.get("n", tuned["rollout"]["n_samples_per_prompt"])
    run_args.prompts = shape.get("prompts", tuned["rollout"]["rollout_batch_size"])
    run_args.max_new_tokens = shape.get("max_new_tokens", tuned["rollout"]["generate_max_len"])
    run_args.lr = tuned["train"]["actor_learning_rate"]
    run_args.fixed_length = shape["fixed_length"]
    run_args.device, run_args.dtype, run_args.model_path = "cpu", "fp32", None  # the bare parts' own
    config = resolve_ppo_config(
        None, grpo_vs_trl.our_overrides(run_args, os.path.join(scratch, "x"), "/tmp/unused", preset)
    )
    spec = {
        "model_path": config.model.pretrain,
        "train_path": config.data.prompt_data,
        "input_key": config.data.input_key,
        "label_key": config.data.label_key,
        "apply_chat_template": config.data.apply_chat_template,
        "prompt_max_len": config.data.prompt_max_len,
        "prompts": run_args.prompts,
        "n": run_args.n,
        "max_new_tokens": run_args.max_new_tokens,
        "fixed_length": run_args.fixed_length,
        "temperature": config.rollout.temperature,
        "lr": config.train.actor_learning_rate,
        "betas": list(config.train.adam_betas),
        "max_norm": config.train.max_norm,
        "eps_clip": config.algo.policy.options.get("epsilon_low", 0.2),
        "seed": args.seed,
        "rounds": args.rounds,
    }
    print(
        f"\n## workload {workload}: {run_args.prompts} prompts x n={run_args.n}, "
        f"{'exactly' if run_args.fixed_length else '<='} {run_args.max_new_tokens} new tokens"
    )
    ratios = []
    for repeat in range(1, args.repeats + 1):
        print(f"run {repeat}: load average {load()}")
        raw = grpo_vs_trl.run_ours(run_args, os.path.join(scratch, f"{workload}{repeat}"), preset)
        ours = median_phases(raw)
        spec_path = os.path.join(scratch, "bare_spec.json")
        with open(spec_path, "w") as handle:
            json.dump(spec, handle)
        done = subprocess.run(
            [sys.executable, __file__, "--variant", "bare", "--spec", spec_path],
            capture_output=True,
            text=True,
            timeout=args.timeout,
            env=dict(os.environ, **grpo_vs_trl.ENVIRONMENT),
        )
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode != 0 or not lines:
            raise RuntimeError(f"bare parts: exited {done.returncode}\n{done.stderr[-3000:]}")
        bare = json.loads(lines[-1].removeprefix("RESULT "))
        floor = {name: statistics.median(bare[name]) for name in ("generation", "training", "sync")}
        total = sum(floor.values())
        print(
            f"  bare parts ({args.rounds} rounds after a warm-up, torch threads {bare['torch_threads']}; "
            f"{bare['response_tokens']} response tokens, {bare['tokens']} tokens, padded to "
            f"{bare['padded_tokens']}, {bare['weight_bytes'] / 2**20:.1f} MiB of weights); load average {load()}"
        )
        print(f"  {'part':<12} {'ours (median s)':>16} {'bare (median, min-max s)':>28} {'ours/bare':>10}")
        for name in ("generation", "training", "sync"):
            print(
                f"  {name:<12} {ours[name]:>16.3f} {spread(bare[name]):>28} "
                f"{grpo_vs_trl.ratio(ours[name], floor[name]):>10}"
            )
        print(f"  {'experience':<12} {ours['experience']:>16.3f} {'(scoring, advantages)':>28}")
        print(f"  {'other':<12} {ours['other']:>16.3f} {'(driver outside phases)':>28}")
        print(
            f"  {'step':<12} {ours['step']:>16.3f} {total:>28.3f} {grpo_vs_trl.ratio(ours['step'], total):>10}"
            "   <- step / sum of bare parts"
        )
        ratios.append(ours["step"] / total)
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=(*grpo_vs_trl.WORKLOADS, "both"), default="both")
    parser.add_argument("--steps", type=int, default=6, help="steps of our run (medians over 2..N)")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds of each bare part")
    parser.add_argument("--repeats", type=int, default=1, help="our run + bare parts, this many times")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--preset-root", default=None)
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument(
        "--ours-option", action="append", default=[], metavar="KEY=VALUE", help="extra dotted option of ours"
    )
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args()
    for name, value in grpo_vs_trl.ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    if args.variant == "bare":
        with open(args.spec) as handle:
            print("RESULT " + json.dumps(bare_parts(json.load(handle))), flush=True)
        return
    if args.steps < 2 or args.rounds < 1 or args.repeats < 1:
        parser.error(f"--steps {args.steps} (>= 2), --rounds {args.rounds}, --repeats {args.repeats} (>= 1)")
    from rl_launch.presets.arithmetic import build_preset

    args.preset_root = args.preset_root or os.path.join(
        os.path.expanduser("~"), ".cache", "rl-launch", "presets"
    )
    args.only = None
    preset = build_preset(args.preset_root, seed=args.seed)
    workloads = tuple(grpo_vs_trl.WORKLOADS) if args.workload == "both" else (args.workload,)
    results = {}
    with tempfile.TemporaryDirectory(prefix="step-limit-") as scratch:
        for workload in workloads:
            results[workload] = measure(args, workload, preset, scratch)
    print(f"\nload average at the end: {load()}")
    for workload, ratios in results.items():
        print(
            f"{workload}: our step / sum of bare parts {', '.join(f'{r:.2f}x' for r in ratios)}"
            + (" (target <= 1.15x)" if workload == "long" else "")
        )


if __name__ == "__main__":
    main()
