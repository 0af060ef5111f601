"""Pieces the three supervised commands share: reading rows and building a learner."""

from __future__ import annotations

from typing import Any

__all__ = ["build_learner", "load_preferences", "read_rows"]


def read_rows(config: Any, sources: Any) -> Any:
    """The rows of `sources` (`data.dataset`, or the preset's file): each dataset read as `rl-launch
    ppo` reads prompts (`prompts.load_source`: files, save_to_disk folders, hub names with
    `data.dataset_split` / `data.dataset_subset`), mixed by `data.dataset_probs` (interleaved with
    `train.seed`) or concatenated, then the first `data.max_samples`.

    Raises PreflightError naming the option for a dataset that cannot be read.
    """
    from rl_data import DataError
    from rl_data.datasets import as_dataset, mix_datasets

    from ..config import data_sources
    from ..preflight import PreflightError
    from ..prompts import load_source

    data = config.data
    parts = [
        load_source(
            source,
            split=data.dataset_split,
            subset=data.dataset_subset,
            option="data.dataset",
            split_option="data.dataset_split",
            subset_option="data.dataset_subset",
        )
        for source in data_sources(sources)
    ]
    try:
        if len(parts) == 1:
            rows = as_dataset(parts[0])
        else:
            rows = mix_datasets(parts, probabilities=data.dataset_probs, seed=config.train.seed)
    except (FileNotFoundError, DataError, ValueError) as error:
        raise PreflightError(f"data.dataset: {error}") from None
    if data.max_samples is not None and data.max_samples < len(rows):
        rows = rows.select(range(data.max_samples))
    return rows


def load_preferences(config: Any, tokenizer: Any, path: Any) -> Any:
    """The (prompt, chosen, rejected) pairs of `data.dataset` (RM and DPO), with `data.margin_key`
    when the data section has one (RM)."""
    from rl_data.datasets import PreferenceDataset

    data = config.data
    return PreferenceDataset(
        read_rows(config, path),
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


def build_reference(config: Any, model_path: str) -> Any:
    """The frozen reference of DPO and KTO: `model_path` whole (never LoRA), in the learner's
    inference settings (DeepSpeed or FSDP2: `train.backend`), with no optimizer."""
    from rl_learner import PolicyLearner, load_causal_lm

    from .loop import learner_options, model_options

    deepspeed = learner_options(config).inference
    model = load_causal_lm(model_path, **model_options(config, deepspeed, trained=False))
    return PolicyLearner(model, deepspeed=deepspeed)
