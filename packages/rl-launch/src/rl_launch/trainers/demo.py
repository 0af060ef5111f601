"""The `arithmetic` demo of `rl-launch sft|rm|dpo|kto`: "What is n + 1?" on a tiny model built here.

A Qwen2 model of 2 layers (hidden size 64) with a tokenizer trained locally (`rl_data.tiny`,
ChatML template, digits one per token), randomly initialised: nothing is downloaded. Rows, for
every n in 0..`max_number`:

    sft.jsonl    {"prompt": "What is n + 1?", "response": "<n + 1>"}
    pairs.jsonl  {"prompt": "What is n + 1?", "chosen": "<n + 1>", "rejected": "<10·(n + 1)>"}
    unpaired.jsonl  each pair as two labelled completions (KTO):
                 {"prompt": ..., "completion": "<n + 1>", "label": true},
                 {"prompt": ..., "completion": "<10·(n + 1)>", "label": false}

The rejected answer is off by a factor of ten (a stray 0 at the end): one consistent wrong
behaviour that a tiny random model can learn to tell apart within a few dozen steps. (The
"lazy" answer n, which differs from n + 1 in its last digit only, needs a comparison with the
prompt: in 80 steps the reward model's accuracy stayed at 0.5 and DPO's margin at 0.02.) SFT's loss falls from about log(vocab); the
reward model's pair accuracy rises from chance; DPO's reward margin rises from 0 (the
reference is the same random model).

Built once per argument set under `root/supervised-<hash>/` (a `preset_build.json` marker is
written last; a folder without it is rebuilt), in about a second.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ..presets.cache import cached_build, recipe_hash

__all__ = ["DEMO_VERSION", "build_demo", "demo_rows"]

DEMO_VERSION = 3
MARKER = "preset_build.json"


def demo_rows(max_number: int) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """(sft rows, pair rows) for n = 0..max_number, in order."""
    sft, pairs = [], []
    for number in range(max_number + 1):
        prompt = f"What is {number} + 1?"
        sft.append({"prompt": prompt, "response": str(number + 1)})
        pairs.append({"prompt": prompt, "chosen": str(number + 1), "rejected": str(10 * (number + 1))})
    return sft, pairs


def build_demo(
    root: str | os.PathLike[str] | None = None,
    *,
    seed: int = 0,
    max_number: int = 199,
    hidden_size: int = 64,
    num_layers: int = 2,
    vocab_size: int = 512,
) -> dict[str, str]:
    """Build (or reuse) the demo under `root`; returns {"model", "sft", "pairs", "unpaired"} paths."""
    root = Path(root or os.path.join(os.path.expanduser("~"), ".cache", "rl-launch", "presets"))
    recipe = {
        "recipe": "supervised",
        "version": DEMO_VERSION,
        "seed": seed,
        "max_number": max_number,
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "vocab_size": vocab_size,
    }
    digest = recipe_hash(recipe)
    folder = root / f"supervised-{digest}"
    paths = {
        "model": str(folder / "model"),
        "sft": str(folder / "sft.jsonl"),
        "pairs": str(folder / "pairs.jsonl"),
        "unpaired": str(folder / "unpaired.jsonl"),
    }

    def build(staging: Path) -> dict[str, Any]:
        import torch

        from rl_data.tiny import build_tiny_model, build_tiny_tokenizer

        tokenizer = build_tiny_tokenizer(vocab_size=vocab_size, chat_template="chatml")
        model = build_tiny_model(
            tokenizer,
            hidden_size=hidden_size,
            num_layers=num_layers,
            num_heads=4,
            num_kv_heads=2,
            intermediate_size=4 * hidden_size,
            seed=seed,
            dtype=torch.float32,
        )
        model.save_pretrained(staging / "model")
        tokenizer.save_pretrained(staging / "model")
        sft, pairs = demo_rows(max_number)
        unpaired = [
            {"prompt": pair["prompt"], "completion": pair[side], "label": side == "chosen"}
            for pair in pairs
            for side in ("chosen", "rejected")
        ]
        for name, rows in (("sft.jsonl", sft), ("pairs.jsonl", pairs), ("unpaired.jsonl", unpaired)):
            (staging / name).write_text("".join(json.dumps(row) + "\n" for row in rows))
        return {"recipe_hash": digest, "recipe": recipe}

    cached_build(folder, MARKER, build)
    return paths
