"""The built-in CPU preset: add one to a number, learned by GRPO from a lazy teacher.

`rl-launch ppo` without arguments runs this preset: a small Qwen2 model built locally with
`rl_data.tiny` (no hub access), warm-started by a short supervised run on a lazy teacher's
answers, then trained with GRPO on a rule reward. It is sized so that a new user sees the model
learn within a couple of minutes on 2 CPU cores: greedy accuracy on held-out problems goes from
about 0.05 to above 0.8 in about five GRPO steps, and ends at about 0.92.

The task. Prompts are "What is n + 1?" with 0 ≤ n ≤ `max_number` (999); the label is n + 1 as a
string. The answer is the bare number followed by the end-of-turn token (digits tokenise one per
token, so 2-5 tokens). A problem belongs to the eval split when a stable hash of n falls in the
`eval_fraction` bucket, so train and eval never share a problem, whatever the seed. The rule
(copy the digits, increment the last one, carry a 9) is one that a 2-layer transformer learns
from the train numbers and applies to numbers it never saw: on this task the eval accuracy
follows the train accuracy, so the eval curve measures learning, not memorisation.

The warm start, and why a lazy teacher. The demonstrations give each train problem three
times: once with the right answer (n + 1) and `lazy_answers` = 2 times with n, as a teacher who
usually forgets to add would. The model learns both behaviours: sampled at temperature 1 it
answers n + 1 about a third of the time (pass@8 ≈ 0.9 on eval problems) but its greedy answer is
n (greedy eval accuracy ≈ 0.02). GRPO's reward (1 for the right number) then has a consistent
direction on every prompt, "add rather than copy", and greedy eval accuracy climbs to ≈ 0.92-0.95.
This is RL choosing, by reward, among behaviours the model already has; it does not teach the
model a skill that no demonstration showed. A plain warm start does not make a good demo: in the
in-process tuning check (GRPO on the warm-started model with HF sampling, 32 prompts x 8, PPO
loss with one AdamW step per batch) an under-trained SFT on right answers only (greedy eval
≈ 0.2-0.3, pass@8 ≈ 0.8 on a + b with a ≤ 99 or a ≤ 19, b ≤ 9) moved the greedy eval accuracy by
-0.05 to +0.1 in 20 steps at lr 2e-4 to 5e-4, and collapsed it at lr 1e-3; the same under a
near-cliff SFT of this task (greedy 0.1, pass@8 0.2). Those errors are problem by problem, so the
policy gradient has no common direction; the lazy answer is one shared behaviour, so it does.
The previous single-digit a ± b task memorised its 183 train problems and its eval reward did
not move. See `SETTINGS` for the measured curves.

The reward (`arithmetic_reward`, OpenRLHF signature): 1.0 when the first integer in the
response (the query with the prompt removed) equals the label, else 0.0.

The prompt is rendered with the tokenizer's ChatML template (`apply_chat_template=True`):
`rl_data.render_prompt(tokenizer, prompt)` gives the text the model was warm-started on.

A teacher for on-policy distillation (`build_teacher`): the preset's lazy model fine-tuned a
few dozen more steps on the right answers only. Its greedy eval accuracy is ≈ 0.94-0.97 (20-50
steps) where the student's is ≈ 0.02, with the same tokenizer and architecture; `rl-launch ppo
--model.teacher_pretrain <its folder>` then distils it into the preset's model, with or
without the rule reward (algo.distill).

Building is cached. `build_preset(root)` writes into `root/arithmetic-<hash>/`, where the hash
covers every argument and `RECIPE_VERSION`; a finished build has a `preset_build.json` marker
(written last, after an atomic rename of the whole folder), and calling again with the same
arguments only reads it. A folder without a marker (an interrupted build) is rebuilt.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import random
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from rl_rollout.rewards import response_text

from .cache import cached_build, recipe_hash

__all__ = [
    "RECIPE_NAME",
    "RECIPE_VERSION",
    "SETTINGS",
    "PresetArtifacts",
    "arithmetic_reward",
    "build_preset",
    "build_teacher",
    "demonstrations",
    "make_problems",
    "problem_split",
    "score_response",
    "settings",
]

RECIPE_NAME = "arithmetic"
RECIPE_VERSION = 3
"""Bump when the build changes in a way the arguments do not capture (task text, SFT loop)."""

SPLITS: tuple[str, ...] = ("train", "eval")
MARKER = "preset_build.json"
DEFAULT_SFT_STEPS = 400

SETTINGS: dict[str, Any] = {
    "algo": {
        "advantage": {"estimator": "grpo"},
        "policy": {"loss": "ppo"},
        "kl": {"init_kl_coef": 0.0},
    },
    "rollout": {
        "n_samples_per_prompt": 8,
        "rollout_batch_size": 32,
        "generate_max_len": 6,
        "temperature": 1.0,
        "top_p": 1.0,
    },
    "train": {
        "max_steps": 16,
        "actor_learning_rate": 5e-4,
        "adam_betas": [0.9, 0.95],
        "lr_warmup_ratio": 0.1,
        "max_norm": 1.0,
    },
    "data": {"prompt_max_len": 64},
    "eval": {"eval_steps": 1},
    "ckpt": {"save_steps": -1},
    "log": {"output_dir": "runs/ppo-arithmetic"},
    # The learner trains while the engine waits (one update per batch, no async): two threads.
    # On 2 cores this took the steady step from 519 to 599 samples/s (benchmarks/grpo_vs_trl.py).
    "ray": {"policy": {"num_cpus_per_actor": 2.0}},
}
"""The preset's run settings, sections as in `rl_launch.config.PPOConfig` (the one source: the
CLI layers them under the user's file and flags).

Chosen by an in-process check (HF sampling at temperature 1, GRPO advantages, PPO-clip loss with
one AdamW step per rollout batch, token-mean, this schedule: 10% warm-up, cosine to 0.1 x lr)
on a model built by this recipe (the same arguments; only the order of the SFT examples
differed, so not bit-identical weights). Greedy accuracy on the 127 held-out problems, GRPO
seeds 0-4, at steps 0 / 2 / 4 / 6 / 8 / 20: 0.02 / 0.27-0.43 / 0.62-0.77 / 0.81-0.94 /
0.91-0.94 / 0.94-0.97; a model built with another seed (1), GRPO seeds 0-1: 0.00 at step 0,
0.98 at step 16. Through the full stack (`rl-launch ppo`, 6 seed pairs, 2 CPU cores):
0.02-0.11 after step 1, 0.84-0.91 at step 5, 0.92-0.93 at step 16; about 45 s a run with the
preset built. The climb is over by step ~10, so 16 steps show it with a plateau; every
step is evaluated (127 greedy answers of at most 6 tokens cost little) so the curve starts at
the first step. Learning rates of 1e-3 and above were unstable in the earlier checks."""

_FIRST_INTEGER = re.compile(r"-?\d+")


def settings() -> dict[str, Any]:
    """A deep copy of `SETTINGS` (callers may change it)."""
    return copy.deepcopy(SETTINGS)


# ----------------------------------------------------------------------------------------------
# Task


def _check_max_number(max_number: int) -> int:
    if not (isinstance(max_number, int) and not isinstance(max_number, bool) and 1 <= max_number <= 99_999):
        raise ValueError(f"max_number: {max_number!r} is not allowed; expected an integer in [1, 99999]")
    return max_number


def _check_fraction(eval_fraction: float) -> float:
    if not (isinstance(eval_fraction, (int, float)) and 0 < eval_fraction < 1):
        raise ValueError(f"eval_fraction: {eval_fraction!r} is not allowed; expected a number in (0, 1)")
    return float(eval_fraction)


def problem_split(number: int, eval_fraction: float = 0.1) -> str:
    """ "eval" or "train" for the problem "number + 1", from a stable hash (independent of any seed)."""
    digest = hashlib.blake2b(f"{number} + 1".encode(), digest_size=8).digest()
    return "eval" if int.from_bytes(digest, "big") % 10_000 < eval_fraction * 10_000 else "train"


def _problem(number: int) -> dict[str, str]:
    return {"prompt": f"What is {number} + 1?", "label": str(number + 1)}


def make_problems(
    count: int | None,
    seed: int = 0,
    *,
    split: str = "train",
    max_number: int = 999,
    eval_fraction: float = 0.1,
) -> list[dict[str, str]]:
    """`count` problems `{"prompt": "What is n + 1?", "label": "<n + 1>"}` of one split.

    The split's distinct problems (0 ≤ n ≤ `max_number`) are shuffled with `random.Random(seed)`;
    when `count` exceeds their number, further shuffled passes follow (every problem appears once
    per pass), so a problem repeats only after all others have appeared. `count=None` gives each
    problem once.

    Raises:
        ValueError: a bad argument (named), or a split that holds no problem.
    """
    if split not in SPLITS:
        raise ValueError(f"split: {split!r} is not allowed; expected one of {SPLITS}")
    if count is not None and not (isinstance(count, int) and count >= 0):
        raise ValueError(f"count: {count!r} is not allowed; expected an integer >= 0 or None")
    fraction = _check_fraction(eval_fraction)
    pool = [n for n in range(_check_max_number(max_number) + 1) if problem_split(n, fraction) == split]
    if not pool:
        raise ValueError(
            f"split {split!r} holds no problem for max_number={max_number}, eval_fraction={eval_fraction}"
        )
    rng = random.Random(seed)
    target = len(pool) if count is None else count
    chosen: list[int] = []
    while len(chosen) < target:
        order = list(pool)
        rng.shuffle(order)
        chosen.extend(order[: target - len(chosen)])
    return [_problem(n) for n in chosen]


def demonstrations(problems: Sequence[dict[str, str]], lazy_answers: int = 2) -> list[tuple[str, str]]:
    """The lazy teacher's (question, answer) pairs: each problem once right, `lazy_answers` times n.

    For "What is 41 + 1?" with `lazy_answers=2`: ("What is 41 + 1?", "42"), then twice
    ("What is 41 + 1?", "41"). Questions are the raw prompts (render them before training).

    Raises:
        ValueError: `lazy_answers` < 0, or a label that is not an integer (names the index).
    """
    if not (isinstance(lazy_answers, int) and lazy_answers >= 0):
        raise ValueError(f"lazy_answers: {lazy_answers!r} is not allowed; expected an integer >= 0")
    pairs = []
    for index, row in enumerate(problems):
        try:
            number = int(row["label"]) - 1
        except ValueError as error:
            raise ValueError(f"problems[{index}]: label {row['label']!r} is not an integer") from error
        pairs.append((row["prompt"], row["label"]))
        pairs.extend((row["prompt"], str(number)) for _ in range(lazy_answers))
    return pairs


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
    `rl_data.render_prompt(tokenizer, prompt)` (True here). The run settings are `SETTINGS`.
    """

    recipe: str
    recipe_hash: str
    path: str
    model_path: str
    train_path: str
    eval_path: str
    reward: str
    apply_chat_template: bool
    sft_metrics: dict[str, float]

    @classmethod
    def of_build(cls, folder: Path, marker: dict[str, Any], recipe: str, reward: str) -> PresetArtifacts:
        """The artifacts of a preset build in `folder` (model/, train.jsonl, eval.jsonl), from its marker."""
        return cls(
            recipe=recipe,
            recipe_hash=marker["recipe_hash"],
            path=str(folder),
            model_path=str(folder / "model"),
            train_path=str(folder / "train.jsonl"),
            eval_path=str(folder / "eval.jsonl"),
            reward=reward,
            apply_chat_template=True,
            sft_metrics=dict(marker["sft_metrics"]),
        )


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    """One JSON object a line, keys sorted."""
    path.write_text("".join(json.dumps(row, sort_keys=True) + "\n" for row in rows))


def _artifacts(folder: Path, marker: dict[str, Any]) -> PresetArtifacts:
    return PresetArtifacts.of_build(folder, marker, RECIPE_NAME, f"{__name__}:arithmetic_reward")


def build_preset(
    root: str | os.PathLike[str],
    *,
    seed: int = 0,
    sft_steps: int | None = None,
    sft_batch_size: int = 32,
    sft_lr: float = 3e-3,
    max_number: int = 999,
    eval_fraction: float = 0.1,
    lazy_answers: int = 2,
    hidden_size: int = 128,
    num_layers: int = 2,
    vocab_size: int = 1024,
) -> PresetArtifacts:
    """Build (or reuse) the preset under `root`: tokenizer, warm-started model, train/eval JSONL.

    Steps: `rl_data.tiny.build_tiny_tokenizer` (ChatML template, digits one per token) and
    `build_tiny_model` (Qwen2, `hidden_size`, `num_layers`, seeded); every train problem and
    every eval problem, each once, shuffled (`make_problems`); `sft_warm_start` on the lazy
    teacher's `demonstrations` of the train problems (prompt rendered with the chat template,
    response "<answer><|im_end|>") for `sft_steps` steps (None: the tuned default, 400: about
    17 s on 2 CPU cores, 27 s on one); then `save_pretrained` of model and tokenizer into `model/`
    (safetensors), loadable by transformers and vLLM.

    Cached by a hash of all arguments and `RECIPE_VERSION`: the build goes to
    `root/arithmetic-<hash>/`; a finished folder (with its marker) is returned as is.
    Deterministic for a seed on a given machine (same weights, same files).
    """
    if not (isinstance(seed, int) and seed >= 0):
        raise ValueError(f"seed: {seed!r} is not allowed; expected an integer >= 0")
    steps = DEFAULT_SFT_STEPS if sft_steps is None else sft_steps
    if not (isinstance(steps, int) and steps >= 1):
        raise ValueError(f"sft_steps: {sft_steps!r} is not allowed; expected an integer >= 1 or None")
    if not (isinstance(lazy_answers, int) and lazy_answers >= 0):
        raise ValueError(f"lazy_answers: {lazy_answers!r} is not allowed; expected an integer >= 0")
    _check_max_number(max_number)
    _check_fraction(eval_fraction)
    recipe = {
        "recipe": RECIPE_NAME,
        "version": RECIPE_VERSION,
        "seed": seed,
        "sft_steps": steps,
        "sft_batch_size": sft_batch_size,
        "sft_lr": sft_lr,
        "max_number": max_number,
        "eval_fraction": eval_fraction,
        "lazy_answers": lazy_answers,
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "vocab_size": vocab_size,
    }
    digest = recipe_hash(recipe)
    folder = Path(root) / f"{RECIPE_NAME}-{digest}"

    def build(staging: Path) -> dict[str, Any]:
        import torch

        from rl_data import render_prompt
        from rl_data.tiny import build_tiny_model, build_tiny_tokenizer

        from ..warm_start import sft_warm_start

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
        common = dict(max_number=max_number, eval_fraction=eval_fraction)
        train = make_problems(None, seed, split="train", **common)
        write_jsonl(staging / "train.jsonl", train)
        write_jsonl(staging / "eval.jsonl", make_problems(None, seed, split="eval", **common))
        examples = [
            (render_prompt(tokenizer, prompt), answer + tokenizer.eos_token)
            for prompt, answer in demonstrations(train, lazy_answers)
        ]
        metrics = sft_warm_start(
            model, tokenizer, examples, steps=steps, batch_size=sft_batch_size, lr=sft_lr, seed=seed
        )
        model.save_pretrained(staging / "model")
        tokenizer.save_pretrained(staging / "model")
        return {"recipe_hash": digest, "recipe": recipe, "sft_metrics": metrics}

    return _artifacts(folder, cached_build(folder, MARKER, build))


TEACHER_MARKER = "teacher_build.json"
DEFAULT_TEACHER_STEPS = 50


def build_teacher(
    root: str | os.PathLike[str],
    *,
    seed: int = 0,
    steps: int = DEFAULT_TEACHER_STEPS,
    batch_size: int = 32,
    lr: float = 3e-3,
) -> str:
    """Build (or reuse) a distillation teacher for the preset built under `root` with `seed`; its folder.

    The preset (`build_preset(root, seed=seed)`, the default recipe: the student `rl-launch ppo
    --preset arithmetic` trains) is built first if needed; its model is then fine-tuned with
    `sft_warm_start` for `steps` more steps on the train problems' right answers only
    (`demonstrations(..., lazy_answers=0)`) and saved, with the same tokenizer, into
    `root/arithmetic-<hash>-teacher-<hash>/`. Cached like the preset (a marker written last).
    """
    if not (isinstance(steps, int) and steps >= 1):
        raise ValueError(f"steps: {steps!r} is not allowed; expected an integer >= 1")
    student = build_preset(root, seed=seed)
    recipe = {
        "student": student.recipe_hash,
        "steps": steps,
        "batch_size": batch_size,
        "lr": lr,
        "seed": seed,
    }
    folder = Path(student.path + f"-teacher-{recipe_hash(recipe)}")

    def build(staging: Path) -> dict[str, Any]:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from rl_data import render_prompt

        from ..warm_start import sft_warm_start

        tokenizer = AutoTokenizer.from_pretrained(student.model_path)
        model = AutoModelForCausalLM.from_pretrained(student.model_path)
        train = [json.loads(line) for line in Path(student.train_path).read_text().splitlines()]
        examples = [
            (render_prompt(tokenizer, prompt), answer + tokenizer.eos_token)
            for prompt, answer in demonstrations(train, lazy_answers=0)
        ]
        metrics = sft_warm_start(
            model, tokenizer, examples, steps=steps, batch_size=batch_size, lr=lr, seed=seed
        )
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        return {"recipe": recipe, "sft_metrics": metrics}

    cached_build(folder, TEACHER_MARKER, build)
    return str(folder)
