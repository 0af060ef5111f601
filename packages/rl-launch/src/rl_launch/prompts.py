"""The prompt datasets of a run: training and evaluation prompts, tokenized, filtered, counted."""

from __future__ import annotations

from typing import Any

from .config import PPOConfig
from .preflight import PreflightError, Resolved

__all__ = ["describe_data", "load_prompts"]


class _Subset:
    """The first `limit` items of a dataset (data.max_samples)."""

    def __init__(self, data: Any, limit: int) -> None:
        self.data, self.limit = data, limit

    def __len__(self) -> int:
        return self.limit

    def __getitem__(self, index: int) -> Any:
        if not 0 <= index < self.limit:
            raise IndexError(index)
        return self.data[index]


def load_prompts(config: PPOConfig, inputs: Resolved, tokenizer: Any) -> tuple[Any, Any | None]:
    """(training prompts, evaluation prompts or None); PreflightError naming the option on a bad file."""
    from rl_data.datasets import PromptDataset

    data = config.data

    def dataset(source: str, option: str, limit: int | None) -> Any:
        try:
            prompts = PromptDataset(
                source,
                tokenizer,
                input_key=data.input_key,
                label_key=data.label_key,
                apply_chat_template=inputs.apply_chat_template,
                max_length=data.prompt_max_len,
            )
        except (FileNotFoundError, KeyError, ValueError) as error:
            raise PreflightError(f"{option}: {error}") from None
        if len(prompts) == 0:
            raise PreflightError(f"{option}: {source!r} has no usable prompts")
        return prompts if limit is None or len(prompts) <= limit else _Subset(prompts, limit)

    train = dataset(inputs.prompt_data, "data.prompt_data", data.max_samples)
    if len(train) < config.rollout.rollout_batch_size:
        raise PreflightError(
            f"data.prompt_data: {len(train)} prompts, fewer than rollout.rollout_batch_size "
            f"= {config.rollout.rollout_batch_size}"
        )
    evaluation = None
    if inputs.eval_data is not None and config.eval.eval_steps != -1:
        evaluation = dataset(inputs.eval_data, "data.eval_dataset", data.eval_max_samples)
    return train, evaluation


def _stats(data: Any) -> str:
    stats = getattr(getattr(data, "data", data), "stats", None)  # through _Subset
    return stats.summary() if stats is not None else "no statistics"


def describe_data(train: Any, evaluation: Any | None) -> str:
    """One start-up line: prompts kept for training and eval, and what the filters dropped."""
    line = f"data: {len(train)} training prompts ({_stats(train)})"
    if evaluation is not None:
        line += f", {len(evaluation)} eval prompts ({_stats(evaluation)})"
    return line
