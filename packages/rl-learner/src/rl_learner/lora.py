"""LoRA adapters (through `peft`, an optional extra: `pip install rl-learner[peft]`).

`apply_lora(model, LoraOptions(rank=16))` wraps a causal LM or a value model so that only the
low-rank adapters train (W' = W + (alpha / rank)·B·A, B initialised to 0 so the adapted model
starts equal to the base). A value model's scalar `score` head is new or task-specific, so it is
kept fully trainable (peft `modules_to_save`). `rank=0` turns LoRA off and returns the model
unchanged. After training, `model.merge_and_unload()` folds the adapters into plain weights.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec
import torch

__all__ = ["LoraOptions", "apply_lora", "linear_module_names"]

_HEADS = ("lm_head", "score")


class LoraOptions(msgspec.Struct, frozen=True, kw_only=True):
    """LoRA adapter options."""

    rank: int = 0
    """Adapter rank r; 0 turns LoRA off (full fine-tuning)."""
    alpha: float = 16.0
    """Scaling numerator: the adapter output is multiplied by alpha / rank."""
    target_modules: str | list[str] = "all-linear"
    """"all-linear" (every linear layer but the output heads) or module names such as ["q_proj", "v_proj"]."""
    dropout: float = 0.0
    """Dropout on the adapter input, in [0, 1)."""

    def __post_init__(self) -> None:
        owner = type(self).__name__
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise ValueError(f"{owner}.rank: {self.rank!r} is not an integer >= 0")
        if not isinstance(self.alpha, (int, float)) or not math.isfinite(self.alpha) or self.alpha <= 0:
            raise ValueError(f"{owner}.alpha: {self.alpha!r} is not a number > 0")
        if not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise ValueError(f"{owner}.dropout: {self.dropout!r} is not in [0, 1)")
        if isinstance(self.target_modules, str):
            if self.target_modules != "all-linear":
                raise ValueError(
                    f"{owner}.target_modules: {self.target_modules!r} is neither 'all-linear' nor a list of module names"
                )
        elif not self.target_modules or not all(isinstance(n, str) and n for n in self.target_modules):
            raise ValueError(
                f"{owner}.target_modules: {self.target_modules!r} must be a non-empty list of names"
            )


def linear_module_names(model: torch.nn.Module) -> list[str]:
    """Distinct short names (last path component) of the linear layers, output heads excluded."""
    names = []
    for path, module in model.named_modules():
        short = path.rsplit(".", 1)[-1]
        if isinstance(module, torch.nn.Linear) and short not in _HEADS and short not in names:
            names.append(short)
    return names


def apply_lora(model: Any, options: LoraOptions) -> Any:
    """Wrap `model` with LoRA adapters (a `peft.PeftModel`), or return it as is when rank is 0.

    Raises:
      ValueError naming the targets and listing the model's linear layers when a name in
      `target_modules` matches no linear layer; ImportError when peft is not installed.
    """
    if not isinstance(options, LoraOptions):
        raise TypeError(f"options must be a LoraOptions, got {type(options).__name__}")
    if options.rank == 0:
        return model
    try:
        import peft
    except ImportError as error:  # pragma: no cover - peft is installed in the test environment
        raise ImportError("LoRA needs peft: pip install 'rl-learner[peft]'") from error

    available = linear_module_names(model)
    if not isinstance(options.target_modules, str):
        missing = [name for name in options.target_modules if name not in available]
        if missing:
            raise ValueError(
                f"target_modules: {missing} match no linear layer of {type(model).__name__} "
                f"(targets {list(options.target_modules)}); its linear layers are {available[:12]}"
            )
    has_score = isinstance(getattr(model, "score", None), torch.nn.Module)
    config = peft.LoraConfig(
        r=options.rank,
        lora_alpha=options.alpha,
        lora_dropout=options.dropout,
        target_modules="all-linear"
        if isinstance(options.target_modules, str)
        else list(options.target_modules),
        exclude_modules=["score"] if has_score else None,
        modules_to_save=["score"] if has_score else None,
        bias="none",
    )
    if getattr(model, "is_gradient_checkpointing", False):
        # With frozen embeddings no input requires grad, and checkpointed blocks would get none.
        model.enable_input_require_grads()
    return peft.get_peft_model(model, config)
