"""The presets' supervised warm start: a short in-process fine-tuning of a causal LM on
(prompt, response) pairs, on CPU. (The `rl-launch sft` command is another thing:
`rl_launch.trainers.sft`, supervised fine-tuning of a dataset on DeepSpeed learners.)

RL from a randomly initialised model never sees a reward: it first has to learn the answer
format. Presets therefore fine-tune their model for a few dozen steps on demonstrations before
the RL run starts. This module is that loop, generic over the task: it knows texts and tokens,
not arithmetic.

Each example is a prompt text (already rendered, e.g. by a chat template) or its token ids, and the
response text that follows it, end-of-sequence marker included. A vision-language model's examples
come with their images (`images`: one `rl_data.ImageInputs` per example, the prompt ids holding
the expanded placeholder runs of `rl_data.vision`). Prompt and response are tokenised separately
and concatenated, so the boundary between them is exact; the loss is the token-mean negative
log-likelihood of the response tokens only (`rl_algos.sft_loss`):

    L = −Σ_{b,t} m_{b,t}·log π(y_{b,t} | y_{b,<t}) / Σ m,   m = 1 on trained response tokens.

Optimiser: AdamW (betas 0.9, 0.95, no weight decay), linear warm-up over the first 5% of the
steps, cosine decay to 10% of `lr`, gradient norm clipped to 1.0. Batches are drawn without
replacement from a permutation of the examples (a fresh permutation per pass) made with a
generator seeded by `seed`, and the global torch seed is forked, so a run is deterministic and
leaves the caller's random state alone.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import torch

from rl_algos import logprobs_from_logits, sft_loss

__all__ = ["sft_warm_start", "tokenize_examples"]

WARMUP_FRACTION = 0.05
MIN_LR_RATIO = 0.1
MAX_GRAD_NORM = 1.0


def tokenize_examples(
    tokenizer: Any, examples: Sequence[tuple[str, Any]]
) -> list[tuple[list[int], list[int], list[bool]]]:
    """Token ids of each (prompt, response) pair and the response's loss mask.

    The response is a string (every token trained) or a list of (text, trained) segments, e.g.
    a tool demonstration [(call, True), (tool turn, False), (answer, True)]: the tool's turn
    stays in the context but out of the loss, as environment tokens are in RL. Prompt and each
    segment are tokenised separately, no special tokens added; special tokens written in the
    text (e.g. "<|im_end|>") map to their ids.

    Raises:
        ValueError: an example that is not a (prompt, response) pair of that form, or whose
            response has no trained token (names the index).
    """
    tokenized = []
    for index, example in enumerate(examples):
        if not (
            isinstance(example, (tuple, list)) and len(example) == 2 and isinstance(example[0], (str, list))
        ):
            raise ValueError(
                f"examples[{index}]: expected a (prompt, response) pair of strings, got {example!r}"
            )
        prompt, response = example
        segments = [(response, True)] if isinstance(response, str) else response
        if not (
            isinstance(segments, (list, tuple))
            and all(
                isinstance(s, (tuple, list))
                and len(s) == 2
                and isinstance(s[0], str)
                and isinstance(s[1], bool)
                for s in segments
            )
        ):
            raise ValueError(
                f"examples[{index}]: the response must be a string or a list of (text, trained) pairs, "
                f"got {response!r}"
            )
        prompt_ids = (
            prompt if isinstance(prompt, list) else tokenizer(prompt, add_special_tokens=False)["input_ids"]
        )
        response_ids: list[int] = []
        mask: list[bool] = []
        for text, trained in segments:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            response_ids.extend(ids)
            mask.extend([trained] * len(ids))
        if not any(mask):
            raise ValueError(f"examples[{index}]: the response {response!r} has no tokens; nothing to learn")
        tokenized.append((list(prompt_ids), response_ids, mask))
    return tokenized


def _collate(
    rows: Sequence[tuple[list[int], list[int], list[bool]]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded `[B, S]` input ids, attention mask and response (loss) mask."""
    length = max(len(p) + len(r) for p, r, _ in rows)
    input_ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    attention = torch.zeros((len(rows), length), dtype=torch.long)
    response = torch.zeros((len(rows), length), dtype=torch.float32)
    for i, (prompt_ids, response_ids, mask) in enumerate(rows):
        ids = prompt_ids + response_ids
        input_ids[i, : len(ids)] = torch.tensor(ids)
        attention[i, : len(ids)] = 1
        response[i, len(prompt_ids) : len(ids)] = torch.tensor(mask, dtype=torch.float32)
    return input_ids, attention, response


def _predicting_window(response: torch.Tensor) -> torch.Tensor:
    """The positions whose logits the loss reads: position t predicts token t + 1, so the window
    runs from the first to the last position before a trained token of any row of the batch.

    Only these go through the LM head (`logits_to_keep`): a preset's prompts are most of each
    row (arithmetic: ~25 prompt tokens, ~4 response tokens), and the head's matmul and the
    log-softmax over the vocabulary on every position were ~30 % of a step. Each kept position's
    logits are the same as in the full forward; a batch with no trained token keeps them all.
    """
    trained = response[:, 1:].any(dim=0).nonzero().flatten()
    if trained.numel() == 0:
        return torch.arange(response.shape[1] - 1)
    return torch.arange(int(trained[0]), int(trained[-1]) + 1)


def _lr_factor(step: int, steps: int) -> float:
    """Warm-up then cosine decay to MIN_LR_RATIO; `step` counts from 0."""
    warmup = max(1, math.ceil(WARMUP_FRACTION * steps))
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * progress))


def _image_inputs(
    images: Sequence[Any], batch: list[int], input_ids: torch.Tensor, image_token_id: int | None
) -> dict[str, Any]:
    """The forward's image arguments for the batch's examples ({} when none has an image)."""
    from rl_data import ImageInputs

    pixels = ImageInputs.concat([images[i] for i in batch])
    if pixels is None:
        return {}
    return {
        "pixel_values": pixels.pixel_values,
        "image_grid_thw": pixels.grid_thw,
        "mm_token_type_ids": (input_ids == image_token_id).int(),
    }


def sft_warm_start(
    model: Any,
    tokenizer: Any,
    examples: Sequence[tuple[str, Any]],
    *,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int = 0,
    images: Sequence[Any] | None = None,
    image_token_id: int | None = None,
) -> dict[str, float]:
    """Fine-tune `model` in place on the response tokens of `examples`; returns metrics.

    Args:
        model: a `transformers` causal LM (float32 on CPU is what presets use); trained in place
            and left in eval mode.
        tokenizer: its tokenizer; `pad_token_id` (or else `eos_token_id`) pads batches.
        examples: (prompt text, response) pairs; the response is a text, or a list of (text,
            trained) segments whose untrained ones (a tool's turn) stay out of the loss; it
            should end with the end-of-sequence token text so that the model learns to stop.
        steps: optimiser steps, >= 1 (each on `batch_size` examples).
        batch_size: examples per step, >= 1 (capped at the number of examples).
        lr: peak learning rate, > 0.
        seed: seeds the batch order and the torch random state used inside.
        images: for a VL model, each example's `ImageInputs` (or None for a text example); the
            batch's are concatenated in order and given to the forward with `image_token_id`
            (its image placeholder) marking the image tokens.

    Returns:
        "first_loss" (the loss of step 1), "final_loss" (mean loss over the last
        max(1, steps // 10) steps), "steps", "examples", "response_tokens" (seen in total) and
        "seconds" (wall-clock time of the loop).
    """
    if not (isinstance(steps, int) and steps >= 1):
        raise ValueError(f"steps: {steps!r} is not allowed; expected an integer >= 1")
    if not (isinstance(batch_size, int) and batch_size >= 1):
        raise ValueError(f"batch_size: {batch_size!r} is not allowed; expected an integer >= 1")
    if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
        raise ValueError(f"lr: {lr!r} is not allowed; expected a finite number > 0")
    if not examples:
        raise ValueError("examples: empty; give at least one (prompt, response) pair")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad_id is None:
        raise ValueError("tokenizer: has neither pad_token_id nor eos_token_id to pad batches with")

    rows = tokenize_examples(tokenizer, examples)
    if images is not None and (len(images) != len(rows) or image_token_id is None):
        raise ValueError(
            f"images: one ImageInputs (or None) per example ({len(rows)}), with image_token_id; got {len(images)}"
        )
    batch_size = min(batch_size, len(rows))
    generator = torch.Generator().manual_seed(seed)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: _lr_factor(step, steps))

    losses: list[float] = []
    response_tokens = 0
    order: list[int] = []
    start = time.perf_counter()
    model.train()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for _ in range(steps):
            if len(order) < batch_size:
                order = torch.randperm(len(rows), generator=generator).tolist()
            batch, order = order[:batch_size], order[batch_size:]
            input_ids, attention, response = _collate([rows[i] for i in batch], pad_id)
            extra = _image_inputs(images, batch, input_ids, image_token_id) if images is not None else {}
            window = _predicting_window(response)
            logits = model(
                input_ids=input_ids, attention_mask=attention, logits_to_keep=window, **extra
            ).logits
            logprobs = logprobs_from_logits(logits, input_ids[:, window + 1])
            loss, _ = sft_loss(logprobs, response[:, window + 1])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)
            optimizer.step()
            scheduler.step()
            losses.append(float(loss.detach()))
            response_tokens += int(response[:, 1:].sum())
    model.eval()
    tail = losses[-max(1, steps // 10) :]
    return {
        "first_loss": losses[0],
        "final_loss": sum(tail) / len(tail),
        "steps": float(steps),
        "examples": float(len(rows)),
        "response_tokens": float(response_tokens),
        "seconds": time.perf_counter() - start,
    }
