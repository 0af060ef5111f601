"""The prompt datasets of a run: training and evaluation prompts, loaded, rendered, filtered, mixed.

Every dataset that `data.prompt_data` or `data.eval_dataset` names is read on its own
(`load_source`): a local file or `save_to_disk` folder through rl_data, the chosen split of a
`save_to_disk` DatasetDict, and a folder of data files or a Hugging Face dataset name through
`datasets.load_dataset(name, subset, split=split)`; a reasoning-gym task
`reasoning_gym:<task>?size=N&seed=S` is generated offline (`rl_rollout.reasoning_gym`), and a verifiers
taskset `verifiers:<module or file.py>?limit=N&field=value` gives its tasks' prompts as chat messages
(`rl_rollout.verifiers_env`). Each becomes one rl_data `PromptDataset`
(input template or chat template with the system prompt, `data.prompt_max_len`, bad rows), so
each dataset counts its own dropped prompts.

Training datasets D₁ … D_k are then combined over their kept prompts. With `data.prompt_probs`
p₁ … p_k, item j of the training list comes from dataset i with probability pᵢ, taking that
dataset's prompts in order and starting it again when it runs out, until every dataset was read
in full (`rl_data.datasets.mix_datasets` over prompt indices: `datasets.interleave_datasets`,
"all_exhausted", seeded by `train.seed`). Mixing after filtering keeps the proportions of the
prompts actually used at p, whatever each dataset lost to the filters. Without probabilities
the datasets are concatenated in order. Evaluation datasets are concatenated, each capped at
`data.eval_max_samples`.

A prompt keeps the dataset it came from in `PromptSample.source` (the name as given, or the
resolved local path), which the executor copies into `record.extra["source"]`; `Prompts.labels`
gives each source a short name for metrics (`eval/<name>/...`).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import msgspec
import torch

from .config import PPOConfig
from .preflight import PreflightError, Resolved

__all__ = ["Prompts", "describe_data", "load_prompts", "load_source", "source_labels"]

# Extensions of the files rl_data reads itself (rl_data.datasets.common.FORMATS).
_FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv", ".arrow")


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0", "false", "False")


def load_source(
    source: str, *, split: str, subset: str | None, option: str, split_option: str, subset_option: str
) -> Any:
    """One dataset, as what `PromptDataset` takes: the path of a file or saved Dataset (read by
    rl_data), or a `datasets.Dataset` whose rows are located as `source`.

    Raises PreflightError naming `option` (or `split_option` / `subset_option` when the split or
    subset is what is wrong); with HF_HUB_OFFLINE set, a hub name missing from the local cache
    says so instead of a connection error.
    """
    import datasets

    from rl_data.datasets.common import with_location

    path = Path(source)
    if path.is_file() or (path.is_dir() and (path / "state.json").is_file()):
        return source  # one split: rl_data reads it and locates its rows by file and row
    if path.is_dir() and (path / "dataset_dict.json").is_file():
        splits = datasets.load_from_disk(source)
        if split not in splits:
            raise PreflightError(
                f"{split_option}: {split!r} is not a split of {option} {source!r} (splits: {', '.join(splits)})"
            )
        return with_location(splits[split], source)
    try:
        loaded = datasets.load_dataset(source, subset, split=split)
    except Exception as error:  # datasets raises many types: say which option, what and why
        text = str(error)
        if "Unknown split" in text:
            raise PreflightError(
                f"{split_option}: {split!r} is not a split of {option} {source!r}: {text}"
            ) from None
        if "BuilderConfig" in text or "Config name is missing" in text:
            raise PreflightError(f"{subset_option}: {subset!r} for {option} {source!r}: {text}") from None
        if _offline() and not path.exists():
            raise PreflightError(
                f"{option}: {source!r} is not a local file or folder and not in the Hugging Face datasets "
                "cache, and HF_HUB_OFFLINE is set: download it once online (or unset HF_HUB_OFFLINE), or "
                "give a local file or folder"
            ) from None
        raise PreflightError(
            f"{option}: could not load {source!r} with datasets.load_dataset (split {split!r}, subset "
            f"{subset!r}): {type(error).__name__}: {text}"
        ) from None
    if isinstance(loaded, datasets.IterableDataset) or len(loaded) == 0:
        raise PreflightError(f"{option}: {source!r} split {split!r} has no rows")
    return with_location(loaded, source)


def _reasoning_gym_rows(source: str, option: str, data: Any) -> Any:
    """The items of a reasoning-gym task as a `datasets.Dataset` located as `source`
    (`rl_rollout.reasoning_gym`: the question under data.input_key, the label under data.label_key)."""
    import datasets

    from rl_data.datasets.common import with_location
    from rl_rollout.reasoning_gym import reasoning_gym_rows

    if data.label_key is None:
        raise PreflightError(f"{option}: {source!r} needs data.label_key (its verifier reads the label)")
    try:
        rows = reasoning_gym_rows(source, input_key=data.input_key, label_key=data.label_key)
    except (ImportError, ValueError) as error:
        raise PreflightError(f"{option}: {error}") from None
    return with_location(datasets.Dataset.from_list(rows), source)


def _verifiers_rows(source: str, option: str, data: Any) -> Any:
    """The tasks of a verifiers taskset as a `datasets.Dataset` located as `source`
    (`rl_rollout.verifiers_env`: the prompt messages under data.input_key, the label under
    data.label_key)."""
    import datasets

    from rl_data.datasets.common import with_location
    from rl_rollout.verifiers_env import LOAD_ERRORS, verifiers_rows

    if data.label_key is None:
        raise PreflightError(f"{option}: {source!r} needs data.label_key (the label names the task)")
    try:
        rows = verifiers_rows(source, input_key=data.input_key, label_key=data.label_key)
    except LOAD_ERRORS as error:
        raise PreflightError(f"{option}: {error}") from None
    return with_location(datasets.Dataset.from_list(rows), source)


def source_labels(sources: list[str]) -> dict[str, str]:
    """A short, unique metric name for each dataset: a file's stem (`math` for /d/math.jsonl), a
    folder's or hub dataset's last part (`gsm8k` for openai/gsm8k); characters other than letters,
    digits, `_`, `.`, `-` become `_`; a repeated name gets `-2`, `-3`, ... in order."""
    from rl_rollout.reasoning_gym import is_reasoning_gym_source, parse_reasoning_gym_source
    from rl_rollout.verifiers_env import is_verifiers_source, parse_verifiers_source

    labels: dict[str, str] = {}
    for source in sources:
        path = Path(source.rstrip("/"))
        name = path.stem if path.suffix.lower() in _FILE_SUFFIXES else path.name
        if is_reasoning_gym_source(source):  # the task: reasoning_gym:leg_counting?size=8 -> leg_counting
            name = parse_reasoning_gym_source(source)[0]
        if is_verifiers_source(source):  # verifiers:envs/arith.py?limit=8 -> arith, verifiers:a.b -> b
            taskset = parse_verifiers_source(source)[0]
            name = Path(taskset).stem if taskset.endswith(".py") else taskset.rpartition(".")[2]
        label = base = re.sub(r"[^\w.-]", "_", name) or "data"
        count = 1
        while label in labels.values():
            count += 1
            label = f"{base}-{count}"
        labels[source] = label
    return labels


class Prompts:
    """Prompts of one or more `PromptDataset`s in a fixed order: item j is `parts[part_j][row_j]`.

    `len` and `[j]` are all a `PromptLoader` needs; `[j]` is that dataset's `PromptSample` with
    `index = j`. `labels` maps each dataset's source to its metric name; `probabilities` are the
    mixing probabilities (None: concatenated).
    """

    def __init__(
        self,
        parts: list[Any],
        part_ids: torch.Tensor,
        rows: torch.Tensor,
        *,
        probabilities: list[float] | None = None,
    ) -> None:
        self.parts, self.part_ids, self.rows = parts, part_ids, rows
        self.probabilities = probabilities
        self.sources = [part[0].source for part in parts]
        self.labels = source_labels(self.sources)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> Any:
        if not 0 <= index < len(self.rows):
            raise IndexError(index)
        sample = self.parts[int(self.part_ids[index])][int(self.rows[index])]
        return msgspec.structs.replace(sample, index=index)

    def counts(self) -> dict[str, int]:
        """Items per dataset (by label), in the datasets' order."""
        per_part = torch.bincount(self.part_ids.long(), minlength=len(self.parts)).tolist()
        return {self.labels[source]: count for source, count in zip(self.sources, per_part)}

    def dropped(self) -> dict[str, dict[str, int]]:
        """Rows each dataset left out, by reason (too_long, bad_prompt, bad_label), by label."""
        return {
            self.labels[source]: dict(part.stats.skipped) for source, part in zip(self.sources, self.parts)
        }

    def describe(self, kind: str) -> str:
        """`32 training prompts (24 math + 8 code, mixed 0.75/0.25; dropped 2: math too_long 2)`."""
        details = []
        if len(self.parts) > 1:
            mix = " + ".join(f"{count} {label}" for label, count in self.counts().items())
            if self.probabilities is not None:
                mix += ", mixed " + "/".join(f"{p:g}" for p in self.probabilities)
            details.append(mix)
        dropped = self.dropped()
        reasons = [
            (f"{label} " if len(self.parts) > 1 else "") + f"{reason} {count}"
            for label, skipped in dropped.items()
            for reason, count in sorted(skipped.items())
        ]
        total = sum(sum(skipped.values()) for skipped in dropped.values())
        details.append(f"dropped {total}" + (": " + ", ".join(reasons) if reasons else ""))
        return f"{len(self)} {kind} prompts ({'; '.join(details)})"


def _mix(parts: list[Any], probabilities: list[float] | None, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(part id, row) of each item: concatenated, or interleaved by `probabilities` (see module doc)."""
    if probabilities is None:
        part_ids = torch.cat([torch.full((len(part),), k, dtype=torch.int32) for k, part in enumerate(parts)])
        rows = torch.cat([torch.arange(len(part)) for part in parts])
        return part_ids, rows
    import datasets

    from rl_data.datasets import mix_datasets
    from rl_data.datasets.common import SOURCE_COLUMN, with_location

    indexes = [
        with_location(datasets.Dataset.from_dict({"row": list(range(len(part)))}), str(k))
        for k, part in enumerate(parts)
    ]
    mixed = mix_datasets(indexes, probabilities=probabilities, seed=seed).with_format("numpy")
    part_ids = torch.tensor([int(k) for k in mixed[SOURCE_COLUMN]], dtype=torch.int32)
    return part_ids, torch.as_tensor(mixed["row"], dtype=torch.int64)


def load_prompts(config: PPOConfig, inputs: Resolved, tokenizer: Any) -> tuple[Prompts, Prompts | None]:
    """(training prompts, evaluation prompts or None); PreflightError naming the option on a bad
    dataset, split, subset or row, or when no prompt is left."""
    from rl_data import DataError
    from rl_data.datasets import PromptDataset

    data = config.data
    processor = None
    if data.image_key is not None:  # a vision-language policy (preflight checked it)
        from rl_data.vision import VisionProcessor

        processor = VisionProcessor.from_pretrained(inputs.model_path, tokenizer)

    def dataset(source: str, option: str, split: tuple[str, str], subset: tuple[str | None, str]) -> Any:
        from rl_rollout.reasoning_gym import is_reasoning_gym_source
        from rl_rollout.verifiers_env import is_verifiers_source

        rows = (
            _reasoning_gym_rows(source, option, data)
            if is_reasoning_gym_source(source)
            else _verifiers_rows(source, option, data)
            if is_verifiers_source(source)
            else load_source(
                source,
                split=split[0],
                subset=subset[0],
                option=option,
                split_option=split[1],
                subset_option=subset[1],
            )
        )
        try:
            return PromptDataset(
                rows,
                tokenizer,
                input_key=data.input_key,
                label_key=data.label_key,
                apply_chat_template=inputs.apply_chat_template,
                input_template=data.input_template,
                system_prompt=data.system_prompt,
                max_length=data.prompt_max_len,
                overlong="drop",
                on_bad_row="skip" if data.skip_bad_rows else "error",
                image_key=data.image_key,
                processor=processor,
                max_images_per_prompt=data.max_images_per_prompt,
                image_root=data.image_root,
            )
        except (FileNotFoundError, KeyError, ValueError, TypeError) as error:
            hint = ""
            if (
                isinstance(error, DataError)
                and error.row is not None
                and not data.skip_bad_rows
                and not error.reason.startswith("missing; the rows have the keys")
            ):
                hint = "; or leave such rows out with --data.skip_bad_rows true"
            raise PreflightError(f"{option}: {error}{hint}") from None

    train_parts = [
        dataset(
            source,
            "data.prompt_data",
            (data.prompt_split, "data.prompt_split"),
            (data.prompt_subset, "data.prompt_subset"),
        )
        for source in inputs.prompt_data
    ]
    part_ids, rows = _mix(train_parts, data.prompt_probs, config.train.seed)
    if data.max_samples is not None:
        part_ids, rows = part_ids[: data.max_samples], rows[: data.max_samples]
    train = Prompts(train_parts, part_ids, rows, probabilities=data.prompt_probs)
    if len(train) < config.rollout.prompts_per_round:
        name = "generate_batch_size" if config.rollout.generate_batch_size else "rollout_batch_size"
        raise PreflightError(
            f"data.prompt_data: {len(train)} prompts, fewer than rollout.{name} "
            f"= {config.rollout.prompts_per_round}"
        )
    evaluation = None
    if inputs.eval_data is not None and config.eval.eval_steps != -1:
        eval_parts = [
            dataset(
                source,
                "data.eval_dataset",
                (config.eval.split, "eval.split"),
                (config.eval.subset, "eval.subset"),
            )
            for source in inputs.eval_data
        ]
        limit = data.eval_max_samples
        sizes = [len(part) if limit is None else min(len(part), limit) for part in eval_parts]
        evaluation = Prompts(
            eval_parts,
            torch.cat([torch.full((size,), k, dtype=torch.int32) for k, size in enumerate(sizes)]),
            torch.cat([torch.arange(size) for size in sizes]),
        )
    return train, evaluation


def describe_data(train: Prompts, evaluation: Prompts | None) -> str:
    """One start-up line: prompts kept for training and eval, per dataset, and what was dropped."""
    line = "data: " + train.describe("training")
    if evaluation is not None:
        line += ", " + evaluation.describe("eval")
    return line
