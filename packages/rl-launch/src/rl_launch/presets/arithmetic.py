"""The built-in CPU preset: small-number arithmetic with a verifiable reward.

`rl-launch ppo` without arguments runs this preset: a small Qwen2 model, built locally with
`rl_data.tiny` (no hub access), warm-started by a short supervised run so that it answers in
the right format, then trained with GRPO on a rule reward. Everything here is sized so that the
whole run fits in a few minutes on 2 CPU cores and the reward rises clearly.

The task. Prompts are "What is a + b?" or "What is a - b?" with 0 ≤ a, b ≤ `max_operand`; the
label is the integer result as a string ("-3", "17"). The answer the model is taught is the bare
number followed by the end-of-turn token, so responses are 2-4 tokens long (digits tokenise one
per token). A problem belongs to the eval split when a stable hash of "a op b" falls in the
`eval_fraction` bucket, so train and eval never share a problem, whatever the seed.

The reward (`arithmetic_reward`, OpenRLHF signature): 1.0 when the first integer in the
response (the query with the prompt removed) equals the label, else 0.0. There is no format
credit: after the warm start nearly every response is already a bare number, so a format term
would only add a constant and dilute the signal.

The prompt is rendered with the tokenizer's ChatML template (`apply_chat_template=True`):
`rl_data.render_prompt(tokenizer, prompt)` gives the text the model was warm-started on.

Building is cached. `build_preset(root)` writes into `root/arithmetic-<hash>/`, where the hash
covers every argument and `RECIPE_VERSION`; a finished build has a `preset_build.json` marker
(written last, after an atomic rename of the whole folder), and calling again with the same
arguments only reads it. A folder without a marker (an interrupted build) is rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from rl_rollout.rewards import response_text

__all__ = [
    "DEFAULT_RL_SETTINGS",
    "OPERATIONS",
    "RECIPE_NAME",
    "RECIPE_VERSION",
    "PresetArtifacts",
    "arithmetic_reward",
    "build_preset",
    "make_problems",
    "problem_split",
    "score_response",
]

RECIPE_NAME = "arithmetic"
RECIPE_VERSION = 1
"""Bump when the build changes in a way the arguments do not capture (task text, SFT loop)."""

OPERATIONS: tuple[str, ...] = ("+", "-")
SPLITS: tuple[str, ...] = ("train", "eval")
MARKER = "preset_build.json"

DEFAULT_RL_SETTINGS: dict[str, Any] = {
    "advantage_estimator": "grpo",
    "policy_loss": "ppo",
    "clip_epsilon": 0.2,
    "n_samples_per_prompt": 8,
    "prompts_per_step": 64,
    "max_new_tokens": 6,
    "temperature": 1.0,
    "top_p": 1.0,
    "actor_learning_rate": 5e-4,
    "adam_betas": (0.9, 0.95),
    "lr_schedule": "cosine",
    "lr_warmup_ratio": 0.03,
    "max_grad_norm": 1.0,
    "kl_coef": 0.0,
    "optimizer_steps_per_rollout": 1,
    "num_steps": 40,  # 60 steps of 512 samples took ~8 min in CI on 2 shared cores; 40 keep the run under 10
}
"""RL settings that raised the reward in an in-process GRPO check (HF sampling at temperature 1,
GRPO advantages, PPO-clip loss, one AdamW step per rollout batch, cosine schedule, 3% warm-up).
With these (64 prompts x 8 samples, lr 5e-4) the mean rollout reward of the last 5 of 60
steps was 0.520 / 0.506 against 0.375 / 0.341 for the first 5 (seeds 0 / 1: +0.15, +0.17).
Half the samples (32 prompts, lr 3e-4) gave +0.08 to +0.10 over seeds 0, 1, 2. The first
steps often dip (Adam's first, sign-like steps on a noisy policy gradient); learning rates of
1e-3 and above collapse the reward."""

_FIRST_INTEGER = re.compile(r"-?\d+")


# ----------------------------------------------------------------------------------------------
# Task


def _check_operations(operations: Sequence[str]) -> tuple[str, ...]:
    ops = tuple(operations)
    if not ops or any(op not in OPERATIONS for op in ops) or len(set(ops)) != len(ops):
        raise ValueError(
            f"operations: {operations!r} is not allowed; expected distinct items of {OPERATIONS}"
        )
    return ops


def _check_operand(max_operand: int) -> int:
    if not (isinstance(max_operand, int) and not isinstance(max_operand, bool) and 1 <= max_operand <= 999):
        raise ValueError(f"max_operand: {max_operand!r} is not allowed; expected an integer in [1, 999]")
    return max_operand


def _check_fraction(eval_fraction: float) -> float:
    if not (isinstance(eval_fraction, (int, float)) and 0 < eval_fraction < 1):
        raise ValueError(f"eval_fraction: {eval_fraction!r} is not allowed; expected a number in (0, 1)")
    return float(eval_fraction)


def problem_split(a: int, op: str, b: int, eval_fraction: float = 0.1) -> str:
    """ "eval" or "train" for the problem `a op b`, from a stable hash (independent of any seed)."""
    digest = hashlib.blake2b(f"{a} {op} {b}".encode(), digest_size=8).digest()
    return "eval" if int.from_bytes(digest, "big") % 10_000 < eval_fraction * 10_000 else "train"


def _pool(split: str, max_operand: int, operations: tuple[str, ...], eval_fraction: float) -> list[tuple]:
    return [
        (a, op, b)
        for a in range(max_operand + 1)
        for b in range(max_operand + 1)
        for op in operations
        if problem_split(a, op, b, eval_fraction) == split
    ]


def _problem(a: int, op: str, b: int) -> dict[str, str]:
    result = a + b if op == "+" else a - b
    return {"prompt": f"What is {a} {op} {b}?", "label": str(result)}


def make_problems(
    count: int | None,
    seed: int = 0,
    *,
    split: str = "train",
    max_operand: int = 9,
    operations: Sequence[str] = OPERATIONS,
    eval_fraction: float = 0.1,
) -> list[dict[str, str]]:
    """`count` problems `{"prompt": "What is a op b?", "label": "<integer>"}` of one split.

    The split's distinct problems are shuffled with `random.Random(seed)`; when `count` exceeds
    their number, further shuffled passes follow (every problem appears once per pass), so a
    problem repeats only after all others have appeared. `count=None` gives each problem once.

    Raises:
        ValueError: a bad argument (named), or a split that holds no problem.
    """
    if split not in SPLITS:
        raise ValueError(f"split: {split!r} is not allowed; expected one of {SPLITS}")
    if count is not None and not (isinstance(count, int) and count >= 0):
        raise ValueError(f"count: {count!r} is not allowed; expected an integer >= 0 or None")
    ops = _check_operations(operations)
    pool = _pool(split, _check_operand(max_operand), ops, _check_fraction(eval_fraction))
    if not pool:
        raise ValueError(
            f"split {split!r} holds no problem for max_operand={max_operand}, eval_fraction={eval_fraction}"
        )
    rng = random.Random(seed)
    target = len(pool) if count is None else count
    chosen: list[tuple] = []
    while len(chosen) < target:
        order = list(pool)
        rng.shuffle(order)
        chosen.extend(order[: target - len(chosen)])
    return [_problem(*item) for item in chosen]


# ----------------------------------------------------------------------------------------------
# Reward


def score_response(response: str, label: str | int) -> float:
    """1.0 when the first integer in `response` equals the integer `label`, else 0.0.

    "17", " 17.", "17 apples" and "17<|im_end|>" score 1.0 for label "17"; "18", "1 7", "" and
    "seventeen" score 0.0. Only the first integer counts, so listing many numbers does not help.
    """
    try:
        reference = int(str(label).strip())
    except ValueError as error:
        raise ValueError(f"label {label!r} is not an integer") from error
    match = _FIRST_INTEGER.search(response)
    return 1.0 if match is not None and int(match.group()) == reference else 0.0


def arithmetic_reward(queries: list[str], prompts: list[str], labels: list[str]) -> list[float]:
    """OpenRLHF-style reward function: `score_response` of each response against its label.

    `queries[i]` is the prompt text followed by the decoded response; the response is what
    follows `prompts[i]` (`rl_rollout.rewards.response_text`).

    Raises:
        ValueError: lists of different lengths, or a label that is not an integer (names the index).
    """
    if not (len(queries) == len(prompts) == len(labels)):
        raise ValueError(
            f"queries, prompts, labels: lengths {len(queries)}, {len(prompts)}, {len(labels)} differ"
        )
    rewards = []
    for index, (query, prompt, label) in enumerate(zip(queries, prompts, labels, strict=True)):
        try:
            rewards.append(score_response(response_text(query, prompt), label))
        except ValueError as error:
            raise ValueError(f"labels[{index}]: {error}") from error
    return rewards


# ----------------------------------------------------------------------------------------------
# Build


class PresetArtifacts(msgspec.Struct, frozen=True, kw_only=True):
    """What `build_preset` made: paths to the warm-started model and the datasets, and how to use them.

    `train_path` / `eval_path` are JSONL files with keys "prompt" and "label". `reward` names
    the reward function as "module:function". `apply_chat_template`: render prompts with
    `rl_data.render_prompt(tokenizer, prompt)` (True here). `rl_settings`: the tuned RL knobs.
    """

    recipe: str
    recipe_hash: str
    path: str
    model_path: str
    train_path: str
    eval_path: str
    reward: str
    apply_chat_template: bool
    max_new_tokens: int
    sft_metrics: dict[str, float]
    rl_settings: dict[str, Any]


def _recipe_hash(recipe: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


def _write_jsonl(path: Path, rows: list[dict[str, str]]) -> None:
    path.write_text("".join(json.dumps(row, sort_keys=True) + "\n" for row in rows))


def _artifacts(folder: Path, marker: dict[str, Any]) -> PresetArtifacts:
    return PresetArtifacts(
        recipe=RECIPE_NAME,
        recipe_hash=marker["recipe_hash"],
        path=str(folder),
        model_path=str(folder / "model"),
        train_path=str(folder / "train.jsonl"),
        eval_path=str(folder / "eval.jsonl"),
        reward=f"{__name__}:arithmetic_reward",
        apply_chat_template=True,
        max_new_tokens=int(DEFAULT_RL_SETTINGS["max_new_tokens"]),
        sft_metrics=dict(marker["sft_metrics"]),
        # From the code, not the marker: the RL settings do not change what is built.
        rl_settings=dict(DEFAULT_RL_SETTINGS),
    )


def build_preset(
    root: str | os.PathLike[str],
    *,
    seed: int = 0,
    sft_steps: int | None = None,
    sft_batch_size: int = 32,
    sft_lr: float = 3e-3,
    max_operand: int = 9,
    operations: Sequence[str] = OPERATIONS,
    eval_fraction: float = 0.1,
    num_train: int = 2048,
    hidden_size: int = 128,
    num_layers: int = 2,
    vocab_size: int = 1024,
) -> PresetArtifacts:
    """Build (or reuse) the preset under `root`: tokenizer, warm-started model, train/eval JSONL.

    Steps: `rl_data.tiny.build_tiny_tokenizer` (ChatML template, digits one per token) and
    `build_tiny_model` (Qwen2, `hidden_size`, `num_layers`, seeded); `num_train` train problems
    and every eval problem (`make_problems`); `sft_warm_start` on every distinct train problem
    (prompt rendered with the chat template, response "<label><|im_end|>") for `sft_steps`
    steps (None: the tuned default, 200); then `save_pretrained` of model and tokenizer into
    `model/` (safetensors), loadable by transformers and vLLM.

    Cached by a hash of all arguments and `RECIPE_VERSION`: the build goes to
    `root/arithmetic-<hash>/`; a finished folder (with its marker) is returned as is.
    Deterministic for a seed on a given machine (same weights, same files).
    """
    if not (isinstance(seed, int) and seed >= 0):
        raise ValueError(f"seed: {seed!r} is not allowed; expected an integer >= 0")
    steps = DEFAULT_SFT_STEPS if sft_steps is None else sft_steps
    if not (isinstance(steps, int) and steps >= 1):
        raise ValueError(f"sft_steps: {sft_steps!r} is not allowed; expected an integer >= 1 or None")
    if not (isinstance(num_train, int) and num_train >= 1):
        raise ValueError(f"num_train: {num_train!r} is not allowed; expected an integer >= 1")
    ops = _check_operations(operations)
    _check_operand(max_operand)
    _check_fraction(eval_fraction)
    recipe = {
        "recipe": RECIPE_NAME,
        "version": RECIPE_VERSION,
        "seed": seed,
        "sft_steps": steps,
        "sft_batch_size": sft_batch_size,
        "sft_lr": sft_lr,
        "max_operand": max_operand,
        "operations": list(ops),
        "eval_fraction": eval_fraction,
        "num_train": num_train,
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "vocab_size": vocab_size,
    }
    digest = _recipe_hash(recipe)
    root = Path(root)
    folder = root / f"{RECIPE_NAME}-{digest}"
    marker_path = folder / MARKER
    if marker_path.is_file():
        return _artifacts(folder, json.loads(marker_path.read_text()))
    if folder.exists():  # an interrupted build: no marker
        shutil.rmtree(folder)

    import torch

    from rl_data import render_prompt
    from rl_data.tiny import build_tiny_model, build_tiny_tokenizer

    from ..sft import sft_warm_start

    root.mkdir(parents=True, exist_ok=True)
    staging = root / f".{RECIPE_NAME}-{digest}.tmp-{os.getpid()}"
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir()
    try:
        tokenizer = build_tiny_tokenizer(vocab_size=vocab_size, chat_template="chatml")
        model = build_tiny_model(
            tokenizer,
            hidden_size=hidden_size,
            num_layers=num_layers,
            num_heads=max(4, hidden_size // 32),
            num_kv_heads=max(2, hidden_size // 64),
            intermediate_size=4 * hidden_size,
            seed=seed,
            dtype=torch.float32,
        )
        common = dict(max_operand=max_operand, operations=ops, eval_fraction=eval_fraction)
        _write_jsonl(staging / "train.jsonl", make_problems(num_train, seed, split="train", **common))
        _write_jsonl(staging / "eval.jsonl", make_problems(None, seed, split="eval", **common))
        distinct = make_problems(None, seed, split="train", **common)
        examples = [
            (render_prompt(tokenizer, row["prompt"]), row["label"] + tokenizer.eos_token) for row in distinct
        ]
        metrics = sft_warm_start(
            model, tokenizer, examples, steps=steps, batch_size=sft_batch_size, lr=sft_lr, seed=seed
        )
        model.save_pretrained(staging / "model")
        tokenizer.save_pretrained(staging / "model")
        marker = {
            "recipe_hash": digest,
            "recipe": recipe,
            "sft_metrics": metrics,
            "rl_settings": DEFAULT_RL_SETTINGS,
        }
        staging.rename(folder)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    # The marker goes last: a folder without it is an interrupted build.
    marker_path.write_text(json.dumps(marker, indent=2, sort_keys=True))
    return _artifacts(folder, json.loads(marker_path.read_text()))


DEFAULT_SFT_STEPS = 200
