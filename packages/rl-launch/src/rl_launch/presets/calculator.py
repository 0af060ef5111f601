"""The calculator task: a tiny model that cannot add 3-digit numbers learns, by RL, to call a tool.

The task. Prompts are "What is a + b?" with 500 ≤ a, b ≤ 999; the label is a + b (always four
digits, so every digit the model copies sits at a fixed distance from its source). A 2-layer
model does not learn 3-digit addition from a short warm start, but it can copy digits: the
expression into a tool call, and the tool's result into its answer. The tool is
`calculator(expression)` (`calculator_tools.py`, whose `TOOLS` is what
`rollout.executor_options.tools` names). A problem belongs to the eval split when a stable hash
of (a, b) falls in the `eval_fraction` bucket.

The prompt format. The tokenizer's template is `rl_data.tiny`'s "chatml-tools": with `tools=`
it writes one short system line, "Tools: calculator(expression)", before the ChatML
conversation, and tool results are turns of role "tool". Qwen's own tools prompt (the JSON
schema of every tool plus a paragraph of instructions, a few hundred tokens) would be most of a
tiny model's context and teach it nothing it needs; the call format itself is Qwen's (hermes):

    <|im_start|>system\nTools: calculator(expression)<|im_end|>\n
    <|im_start|>user\nWhat is 123 + 456?<|im_end|>\n<|im_start|>assistant\n
    <tool_call>{"name": "calculator", "arguments": {"expression": "123 + 456"}}</tool_call><|im_end|>\n
    <|im_start|>tool\n579<|im_end|>\n<|im_start|>assistant\n579<|im_end|>

`<tool_call>` and `</tool_call>` are added tokens (as in Qwen's vocabulary) and the tokenizer's
BPE corpus holds call lines, so a call is about 25 tokens.

The warm start, a lazy teacher (as in the arithmetic preset). For each train problem the
demonstrations hold one tool-using answer (the call; then, after the tool's turn, which is in the
context but not in the loss, the copied result) and `guesses` direct answers that are a guess (a
random number of the sum's size).
Sampled at temperature 1 the model calls the tool on about 1/(1 + guesses) of its answers and
answers right almost only then, so the reward (1 for the right number) has one direction on
every prompt: "call the tool". RL raises the tool-call rate and the reward with it.

Measured (the defaults: 500 steps at lr 5e-3, intermediate size 256; seed 0; 32 held-out
problems, 4 samples each at temperature 1): the model calls the tool on 0.44 of its answers, every
call copies the operands and every answer after a call copies the result (all earn the reward);
greedy, it never calls (it guesses, and is never right). The loss reaches its floor (~0.25 a
token: the guessed digits and the call-or-guess choice) by step ~200, once the copying is
learned. Through `rl-launch ppo` (GRPO, 16 prompts x 8, `rollout.engine hf`, the two runs of
tests/launch/test_tool_calling_e2e.py): with `rollout.executor tool_call` at lr 5e-4 the call rate
and the reward went 0.45 -> 0.78 in 8 steps (equal at every step: calls stayed right); through
the agent server at lr 3e-4 the mean of the last two steps minus the first two's was +0.18 reward,
+0.17 call rate (with train.seed 1, rollout.seed 1007: +0.35; +0.082 / +0.078). The previous
defaults, 1000 steps at intermediate size 512 (held out: the same 0.44, all right), in the same
runs: 0.46 -> 0.66; +0.12 / +0.12 (seeds 1 / 1007: +0.18; +0.01 / +0.01). Other recipes: 650
steps at intermediate size 256, 0.45 -> 0.70 and +0.13 / +0.13; at intermediate size 512, 500
steps at lr 8e-3 and 800 steps of batch 8 at lr 5e-3 never learn to copy (no call names the
problem's operands), nor do 800 steps at lr 3e-3 reliably (half the calls copy an operand
wrong); 1500 steps at lr 3e-3 copy well but greedy always calls, and RL's first step at lr 5e-4
dropped the reward from 0.50 to 0.37. The copying is learned abruptly, at a step that depends on
the seed: with `seed=1`, neither 1000 steps at intermediate size 512 nor 500 or 650 steps at 256
(nor 500 at lr 1e-2) learn it (the loss still falling at the end; calls copy an operand wrong);
the tests use seed 0.

Cost: the warm start is 500 steps of 16 rows of up to ~85 tokens: the whole build took 40 s on
one thread (`OMP_NUM_THREADS=1`) at a load of 0.3-0.7 on 2 cores, the previous defaults' 92 s
right after it (a step at intermediate size 256 costs ~0.8 of one at 512). Building is cached like
the arithmetic preset's: `build_calculator(root)` writes `root/calculator-<hash>/` (hash of every
argument and `RECIPE_VERSION`), marker written last.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from . import calculator_tools
from .arithmetic import arithmetic_reward
from .cache import cached_build, recipe_hash

__all__ = [
    "RECIPE_NAME",
    "RECIPE_VERSION",
    "CalculatorArtifacts",
    "build_calculator",
    "calculator_reward",
    "demonstrations",
    "make_problems",
    "tool_call_text",
]

RECIPE_NAME = "calculator"
RECIPE_VERSION = 3
"""Bump when the build changes in a way the arguments do not capture (task text, SFT loop)."""

SPLITS: tuple[str, ...] = ("train", "eval")
MARKER = "preset_build.json"
TOOL_TOKENS: tuple[str, ...] = ("<tool_call>", "</tool_call>")
TOOLS_PATH = str(Path(calculator_tools.__file__).resolve())
"""The tools file (`TOOLS = [calculator]`) for `rollout.executor_options.tools`."""

calculator_reward = arithmetic_reward
"""1.0 when the first integer of the final answer equals the label (`arithmetic.score_response`)."""


def problem_split(a: int, b: int, eval_fraction: float = 0.1) -> str:
    """ "eval" or "train" for the problem a + b, from a stable hash (independent of any seed)."""
    digest = hashlib.blake2b(f"{a} + {b}".encode(), digest_size=8).digest()
    return "eval" if int.from_bytes(digest, "big") % 10_000 < eval_fraction * 10_000 else "train"


def make_problems(
    count: int, seed: int = 0, *, split: str = "train", eval_fraction: float = 0.1
) -> list[dict[str, str]]:
    """`count` distinct problems `{"prompt": "What is a + b?", "label": "<a + b>"}` of one split,
    500 ≤ a, b ≤ 999, drawn with `random.Random(seed)`."""
    if split not in SPLITS:
        raise ValueError(f"split: {split!r} is not allowed; expected one of {SPLITS}")
    if not (isinstance(count, int) and 0 <= count <= 100_000):
        raise ValueError(f"count: {count!r} is not allowed; expected an integer in [0, 100000]")
    if not (isinstance(eval_fraction, (int, float)) and 0 < eval_fraction < 1):
        raise ValueError(f"eval_fraction: {eval_fraction!r} is not allowed; expected a number in (0, 1)")
    rng = random.Random(f"{seed}-{split}")
    seen: set[tuple[int, int]] = set()
    rows = []
    while len(rows) < count:
        a, b = rng.randint(500, 999), rng.randint(500, 999)
        if (a, b) in seen or problem_split(a, b, eval_fraction) != split:
            continue
        seen.add((a, b))
        rows.append({"prompt": f"What is {a} + {b}?", "label": str(a + b)})
    return rows


def tool_call_text(expression: str) -> str:
    """The hermes call of the calculator on `expression` (what the teacher writes)."""
    payload = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
    return f"{TOOL_TOKENS[0]}{payload}{TOOL_TOKENS[1]}"


def demonstrations(
    tokenizer: Any, problems: Sequence[dict[str, str]], *, guesses: int = 1, seed: int = 0
) -> list[tuple[str, Any]]:
    """The lazy teacher's (prompt text, response) pairs, rendered with the chat template.

    Per problem: one tool demonstration, (prompt with tools, [(call + eos, trained), (the tool's
    turn and the assistant header, not trained), (result + eos, trained)]), the tool's turn in
    the context but out of the loss as in RL; and `guesses` times (prompt with tools, guess +
    eos) with a guess drawn uniformly from [1000, 1998] (never the right sum).
    """
    if not (isinstance(guesses, int) and guesses >= 0):
        raise ValueError(f"guesses: {guesses!r} is not allowed; expected an integer >= 0")
    from rl_rollout import load_tools, openai_tool_schemas
    from rl_rollout.executors import render_after_assistant

    schemas = openai_tool_schemas(load_tools(calculator_tools.TOOLS))
    eos = tokenizer.eos_token
    rng = random.Random(seed)
    pairs: list[tuple[str, Any]] = []
    for row in problems:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": row["prompt"]}],
            tools=schemas,
            tokenize=False,
            add_generation_prompt=True,
        )
        expression = row["prompt"].removeprefix("What is ").removesuffix("?")
        result = calculator_tools.calculator(expression)
        tool_turn = render_after_assistant(tokenizer, [{"role": "tool", "content": result}]).removeprefix(eos)
        pairs.append(
            (prompt, [(tool_call_text(expression) + eos, True), (tool_turn, False), (result + eos, True)])
        )
        for _ in range(guesses):
            guess = rng.randint(1000, 1998)
            while str(guess) == row["label"]:
                guess = rng.randint(1000, 1998)
            pairs.append((prompt, f"{guess}{eos}"))
    return pairs


def _tokenizer_corpus(seed: int) -> list[str]:
    from rl_data.tiny import default_corpus

    rng = random.Random(seed)
    lines = default_corpus()
    for _ in range(500):
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        lines.append(
            f"Tools: calculator(expression) What is {a} + {b}? {tool_call_text(f'{a} + {b}')} {a + b}"
        )
    return lines


class CalculatorArtifacts(msgspec.Struct, frozen=True, kw_only=True):
    """What `build_calculator` made: the warm-started model, train / eval JSONL ("prompt",
    "label"), the tools file and the reward (`reward.function`: "arithmetic", the registered
    first-integer reward, which is `calculator_reward`)."""

    path: str
    model_path: str
    train_path: str
    eval_path: str
    tools_path: str
    reward: str
    sft_metrics: dict[str, float]


def _artifacts(folder: Path, marker: dict[str, Any]) -> CalculatorArtifacts:
    return CalculatorArtifacts(
        path=str(folder),
        model_path=str(folder / "model"),
        train_path=str(folder / "train.jsonl"),
        eval_path=str(folder / "eval.jsonl"),
        tools_path=TOOLS_PATH,
        reward="arithmetic",
        sft_metrics=dict(marker["sft_metrics"]),
    )


def build_calculator(
    root: str | os.PathLike[str],
    *,
    seed: int = 0,
    train_problems: int = 1024,
    eval_problems: int = 64,
    guesses: int = 1,
    sft_steps: int = 500,
    sft_batch_size: int = 16,
    sft_lr: float = 5e-3,
    hidden_size: int = 128,
    num_layers: int = 2,
    intermediate_size: int = 256,
) -> CalculatorArtifacts:
    """Build (or reuse) the calculator task under `root`: tokenizer, warm-started model, JSONL files.

    A Qwen2 model (`hidden_size`, `num_layers`, `intermediate_size`) on a tiny tokenizer with the
    "chatml-tools" template, fine-tuned (`rl_launch.warm_start.sft_warm_start`) for `sft_steps` on
    the lazy teacher's `demonstrations` of `train_problems` problems; saved with `save_pretrained`
    (loadable by transformers and vLLM). Cached by a hash of the arguments and `RECIPE_VERSION`.
    """
    recipe = {
        "recipe": RECIPE_NAME,
        "version": RECIPE_VERSION,
        "seed": seed,
        "train_problems": train_problems,
        "eval_problems": eval_problems,
        "guesses": guesses,
        "sft_steps": sft_steps,
        "sft_batch_size": sft_batch_size,
        "sft_lr": sft_lr,
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "intermediate_size": intermediate_size,
    }
    digest = recipe_hash(recipe)
    folder = Path(root) / f"{RECIPE_NAME}-{digest}"

    def build(staging: Path) -> dict[str, Any]:
        import torch

        from rl_data.tiny import build_tiny_model, build_tiny_tokenizer

        from ..warm_start import sft_warm_start

        train = make_problems(train_problems, seed, split="train")
        evaluation = make_problems(eval_problems, seed, split="eval")
        tokenizer = build_tiny_tokenizer(corpus=_tokenizer_corpus(seed), chat_template="chatml-tools")
        tokenizer.add_tokens(list(TOOL_TOKENS))
        model = build_tiny_model(
            tokenizer,
            hidden_size=hidden_size,
            num_layers=num_layers,
            num_heads=max(4, hidden_size // 32),
            num_kv_heads=max(2, hidden_size // 64),
            intermediate_size=intermediate_size,
            seed=seed,
            dtype=torch.float32,
        )
        for name, rows in (("train", train), ("eval", evaluation)):
            (staging / f"{name}.jsonl").write_text(
                "".join(json.dumps(row, sort_keys=True) + "\n" for row in rows)
            )
        examples = demonstrations(tokenizer, train, guesses=guesses, seed=seed)
        metrics = sft_warm_start(
            model, tokenizer, examples, steps=sft_steps, batch_size=sft_batch_size, lr=sft_lr, seed=seed
        )
        model.save_pretrained(staging / "model")
        tokenizer.save_pretrained(staging / "model")
        return {"recipe_hash": digest, "recipe": recipe, "sft_metrics": metrics}

    return _artifacts(folder, cached_build(folder, MARKER, build))
