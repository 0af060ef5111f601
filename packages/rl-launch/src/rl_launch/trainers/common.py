"""Pieces the three supervised commands share: reading rows and building a learner."""

from __future__ import annotations

from typing import Any

__all__ = ["build_learner", "load_preferences", "read_rows"]


def read_rows(data: Any, path: str) -> Any:
    """The rows of `data.dataset` (a file or a save_to_disk folder), the first `data.max_samples`."""
    from rl_data.datasets import as_dataset

    rows = as_dataset(path)
    if data.max_samples is not None and data.max_samples < len(rows):
        rows = rows.select(range(data.max_samples))
    return rows


def load_preferences(config: Any, tokenizer: Any, path: str) -> Any:
    """The (prompt, chosen, rejected) pairs of `data.dataset` (RM and DPO), with `data.margin_key`
    when the data section has one (RM)."""
    from rl_data.datasets import PreferenceDataset

    data = config.data
    return PreferenceDataset(
        read_rows(data, path),
        tokenizer,
        prompt_key=data.prompt_key,
        chosen_key=data.chosen_key,
        rejected_key=data.rejected_key,
        margin_key=getattr(data, "margin_key", None),
        apply_chat_template=data.apply_chat_template,
        max_length=data.max_len,
    )


def pair_tokens(pair: Any) -> int:
    """Tokens of a preference pair (chosen + rejected): its size for the micro-batch token budget."""
    return int(pair.chosen_ids.numel() + pair.rejected_ids.numel())


def build_learner(learner_class: type, config: Any, model_path: str, total_steps: int, *, value: bool) -> Any:
    """A trained learner of `model_path`: causal LM, or (`value`) a reward model with a score head;
    with LoRA adapters when `model.lora_rank` > 0."""
    from rl_learner import apply_lora, load_causal_lm, load_value_model

    from .loop import learner_options, model_options

    settings = learner_options(config)
    options = model_options(config, settings.deepspeed)
    if value:
        model = load_value_model(model_path, head_seed=config.train.seed, **options)
    else:
        model = load_causal_lm(model_path, **options)
    if settings.lora is not None:  # export_hf merges the adapters (a reward model's score head trains whole)
        model = apply_lora(model, settings.lora)
    return learner_class(
        model, deepspeed=settings.deepspeed, optimizer=settings.optimizer, total_steps=total_steps
    )
