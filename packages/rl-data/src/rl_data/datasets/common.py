"""Loading local dataset files and reading their rows with errors that say where.

Every dataset here is a Hugging Face `datasets.Dataset` with two extra columns, `__source__`
(the file the row came from) and `__row__` (its 0-based position in that file). They survive
shuffling, mixing and filtering, so any later check can name the file and the row.

Supported sources: `.jsonl` / `.json` (JSON lines or one JSON array), `.parquet`, `.csv`,
`.arrow` files, and folders written by `Dataset.save_to_disk`. A malformed JSON line is reported
with its line number; a key whose values change type between rows is reported with the row.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from ..errors import DataError, type_name

SOURCE_COLUMN = "__source__"
ROW_COLUMN = "__row__"
FORMATS: dict[str, str] = {
    ".jsonl": "json",
    ".json": "json",
    ".parquet": "parquet",
    ".csv": "csv",
    ".arrow": "arrow",
}
ROW_POLICIES: tuple[str, ...] = ("error", "skip")
IN_MEMORY = "<in-memory>"


def check_choice(name: str, value: Any, allowed: Sequence[Any]) -> None:
    """Raise ValueError naming the argument and the allowed values unless `value` is one of them."""
    if value not in allowed:
        raise ValueError(f"{name}: {value!r} is not one of {tuple(allowed)}")


class DatasetStats(msgspec.Struct):
    """What a dataset kept, truncated and skipped while it was built (counted, never silent)."""

    kept: int = 0
    truncated: int = 0
    skipped: dict[str, int] = msgspec.field(default_factory=dict)
    examples: list[str] = msgspec.field(default_factory=list)

    MAX_EXAMPLES = 5

    @property
    def total_skipped(self) -> int:
        return sum(self.skipped.values())

    def skip(self, reason: str, error: BaseException | str | None = None) -> None:
        """Count one skipped row under `reason`; keep the first few messages as examples."""
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        if error is not None and len(self.examples) < self.MAX_EXAMPLES:
            self.examples.append(str(error))

    def summary(self) -> str:
        """One line for logs: `kept 980, truncated 3, skipped 20 (too_long 15, bad_row 5)`."""
        parts = [f"kept {self.kept}", f"truncated {self.truncated}", f"skipped {self.total_skipped}"]
        if self.skipped:
            parts[-1] += (
                " (" + ", ".join(f"{reason} {count}" for reason, count in sorted(self.skipped.items())) + ")"
            )
        return ", ".join(parts)


def load_dataset_source(
    path: str | os.PathLike[str], *, cache_dir: str | os.PathLike[str] | None = None
) -> Any:
    """Load one local file or `save_to_disk` folder as a `datasets.Dataset` with location columns.

    Args:
        path: a `.jsonl`, `.json`, `.parquet`, `.csv` or `.arrow` file, or a folder written by
            `Dataset.save_to_disk` (a `DatasetDict` folder must hold a "train" split).
        cache_dir: where `datasets` may write its Arrow cache (its default cache otherwise).

    Raises:
        FileNotFoundError: the path does not exist.
        DataError: unsupported extension, unreadable content (with the line for JSON), no rows.
    """
    import datasets

    path = Path(path)
    source = str(path)
    if not path.exists():
        raise FileNotFoundError(f"{source}: dataset file or folder does not exist")
    if path.is_dir():
        if not ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file()):
            raise DataError(
                "folder is not a `save_to_disk` dataset (no state.json or dataset_dict.json); "
                f"point at a file with one of the extensions {sorted(FORMATS)}",
                source=source,
            )
        loaded = datasets.load_from_disk(source)
        if isinstance(loaded, datasets.DatasetDict):
            if "train" not in loaded:
                raise DataError(
                    f"DatasetDict folder has no 'train' split (splits: {sorted(loaded)})", source=source
                )
            loaded = loaded["train"]
        dataset = loaded
    else:
        builder = FORMATS.get(path.suffix.lower())
        if builder is None:
            raise DataError(
                f"unsupported file extension {path.suffix!r}; supported: {sorted(FORMATS)}", source=source
            )
        if path.stat().st_size == 0:
            raise DataError("empty file; a dataset needs at least one row", source=source)
        if builder == "json":
            check_json_file(path)
        cache = None if cache_dir is None else str(cache_dir)
        try:
            dataset = datasets.load_dataset(builder, data_files=source, split="train", cache_dir=cache)
        except Exception as error:
            if builder == "json":
                diagnose_json_types(path)
            raise DataError(f"could not be read as {builder}: {error}", source=source) from error
        # datasets >= 4 stores a key whose type changes between rows as a `Json` column instead of
        # failing, and decodes strings such as "1" in it as numbers: refuse it, naming the row.
        if builder == "json" and has_json_feature(dataset.features):
            diagnose_json_types(path)
    if len(dataset) == 0:
        raise DataError("dataset has no rows", source=source)
    # A file written from one of our datasets carries old location columns: this file is the source now.
    stale = [name for name in (SOURCE_COLUMN, ROW_COLUMN) if name in dataset.column_names]
    return with_location(dataset.remove_columns(stale) if stale else dataset, source)


def check_json_file(path: Path) -> None:
    """Every line of a JSON-lines file (or the whole of a JSON array file) parses to objects.

    Raises DataError with the 1-based line number of the first malformed line.
    """
    source = str(path)
    with path.open("rb") as handle:
        head = handle.read(64).lstrip()
    if head.startswith(b"["):
        try:
            rows = json.loads(path.read_bytes())
        except json.JSONDecodeError as error:
            raise DataError(
                f"malformed JSON: {error.msg} (column {error.colno})", source=source, line=error.lineno
            ) from None
        if not isinstance(rows, list) or not rows:
            raise DataError("the JSON array holds no rows", source=source)
        for index, row in enumerate(rows):
            if not isinstance(row, dict):
                raise DataError(
                    f"expected a JSON object per row, got {type_name(row)}", source=source, row=index
                )
        return
    seen_row = False
    with path.open("rb") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            seen_row = True
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise DataError(
                    f"malformed JSON line: {error.msg} (column {error.colno})", source=source, line=number
                ) from None
            if not isinstance(row, dict):
                raise DataError(
                    f"expected a JSON object per line, got {type_name(row)}", source=source, line=number
                )
    if not seen_row:
        raise DataError("no rows: the file holds only blank lines", source=source)


def has_json_feature(feature: Any) -> bool:
    """Whether a `datasets` feature (or a dict / list of them) holds a mixed-type `Json` column."""
    if type(feature).__name__ == "Json":
        return True
    if isinstance(feature, Mapping):
        return any(has_json_feature(value) for value in feature.values())
    if isinstance(feature, (list, tuple)):
        return any(has_json_feature(value) for value in feature)
    inner = getattr(feature, "feature", None)
    return inner is not None and has_json_feature(inner)


def diagnose_json_types(path: Path) -> None:
    """Find the first row whose value for some key has another JSON type than earlier rows.

    Arrow needs one type per column; `datasets` reports a conflict without saying where. Raises
    DataError naming the row and the key when there is such a conflict, and returns otherwise.
    """
    text = path.read_text(encoding="utf-8")
    stripped = text.lstrip()
    rows = (
        json.loads(text)
        if stripped.startswith("[")
        else [json.loads(line) for line in text.splitlines() if line.strip()]
    )
    diagnose_row_types(rows, str(path))


def diagnose_row_types(rows: Sequence[Mapping[str, Any]], source: str) -> None:
    """DataError naming the first row and key whose value changes JSON type; returns if none does."""
    seen: dict[str, tuple[str, int]] = {}
    for index, row in enumerate(rows):
        for key, value in row.items():
            if value is None:
                continue
            kind = (
                "number"
                if isinstance(value, (int, float)) and not isinstance(value, bool)
                else type_name(value)
            )
            first = seen.setdefault(key, (kind, index))
            if first[0] != kind:
                raise DataError(
                    f"value is {kind} here but {first[0]} in row {first[1]}; a key must keep one type",
                    source=source,
                    row=index,
                    key=key,
                )


def with_location(dataset: Any, source: str) -> Any:
    """Add `__source__` and `__row__` columns unless the dataset already carries them."""
    if SOURCE_COLUMN in dataset.column_names and ROW_COLUMN in dataset.column_names:
        return dataset
    dataset = dataset.add_column(SOURCE_COLUMN, [source] * len(dataset))
    return dataset.add_column(ROW_COLUMN, list(range(len(dataset))))


def as_dataset(data: Any, *, cache_dir: str | os.PathLike[str] | None = None) -> Any:
    """Anything a dataset may be built from, as a `datasets.Dataset` with location columns.

    Accepts a path, a list of paths (concatenated in order), a `datasets.Dataset`, or a list of
    dicts (rows). Rows built in memory are located as `<in-memory>`.
    """
    import datasets

    if isinstance(data, (str, os.PathLike)):
        return load_dataset_source(data, cache_dir=cache_dir)
    if isinstance(data, datasets.DatasetDict):
        raise TypeError(f"data: a DatasetDict; pass one split, e.g. data['train'] (splits: {sorted(data)})")
    if isinstance(data, datasets.Dataset):
        return with_location(data, IN_MEMORY)
    if isinstance(data, Sequence) and data and all(isinstance(item, (str, os.PathLike)) for item in data):
        parts = [load_dataset_source(item, cache_dir=cache_dir) for item in data]
        return concatenate_sources(parts)
    if isinstance(data, Sequence) and data and all(isinstance(item, Mapping) for item in data):
        rows = [dict(item) for item in data]
        try:
            dataset = datasets.Dataset.from_list(rows)
        except (TypeError, ValueError) as error:  # pyarrow's ArrowInvalid / ArrowTypeError
            diagnose_row_types(rows, IN_MEMORY)
            raise DataError(f"rows could not be converted to a dataset: {error}", source=IN_MEMORY) from error
        return with_location(dataset, IN_MEMORY)
    if isinstance(data, Sequence) and not data:
        raise DataError("data: empty; give a file, a list of files, a datasets.Dataset or a list of rows")
    raise TypeError(
        f"data: expected a path, a list of paths, a datasets.Dataset or a list of dicts, got {type_name(data)}"
    )


def concatenate_sources(parts: Sequence[Any]) -> Any:
    """Concatenate datasets that share their columns; a column mismatch names both sources."""
    import datasets

    first = parts[0]
    for part in parts[1:]:
        if set(part.column_names) != set(first.column_names):
            raise DataError(
                f"columns {sorted(part.column_names)} differ from {sorted(first.column_names)} "
                f"of {first[0][SOURCE_COLUMN]}; concatenated datasets need the same columns",
                source=part[0][SOURCE_COLUMN],
            )
    return datasets.concatenate_datasets([part.select_columns(first.column_names) for part in parts])


def check_index(position: Any, length: int, owner: str) -> int:
    """`position` as an index in [0, length): negatives count from the end; others raise, naming `owner`."""
    if isinstance(position, bool) or not isinstance(position, (int, np.integer)):
        raise TypeError(f"{owner} index: expected an int, got {type_name(position)}")
    if not -length <= position < length:
        raise IndexError(f"{owner} index {position} is out of range for {length} samples")
    return int(position) % length


def location(row: Mapping[str, Any]) -> dict[str, Any]:
    """The `source` and `row` keywords of a DataError for this row."""
    return {"source": row.get(SOURCE_COLUMN, IN_MEMORY), "row": row.get(ROW_COLUMN)}


def require_columns(dataset: Any, keys: Sequence[str | None]) -> None:
    """Every non-None key is a column; otherwise DataError naming the key, file and first row."""
    for key in keys:
        if key is not None and key not in dataset.column_names:
            available = [name for name in dataset.column_names if name not in (SOURCE_COLUMN, ROW_COLUMN)]
            first = dataset[0] if len(dataset) else {}
            raise DataError(f"missing; the rows have the keys {available}", key=key, **location(first))


def read_text(row: Mapping[str, Any], key: str, *, allow_empty: bool = False) -> str:
    """`row[key]` as a string; DataError naming file, row and key if missing, not text or empty."""
    value = row.get(key)
    if value is None:
        raise DataError("missing or null", key=key, **location(row))
    if not isinstance(value, str):
        raise DataError(f"expected a string, got {type_name(value)}", key=key, **location(row))
    if not allow_empty and not value.strip():
        raise DataError("empty string", key=key, **location(row))
    return value


def read_messages(row: Mapping[str, Any], key: str, *, parts: bool = False) -> list[dict[str, Any]]:
    """`row[key]` as chat messages: a plain string becomes one user turn.

    A messages list must be non-empty, of dicts with string `role` and `content`; the error
    names the file, the row, the key and the message index. With `parts` (VL prompts) a content
    may also be a list of parts (dicts, e.g. {"type": "image"}, {"type": "text", "text": ...}),
    kept as they are for `rl_data.vision` to check.
    """
    value = row.get(key)
    if isinstance(value, str):
        return [{"role": "user", "content": read_text(row, key)}]
    if value is None:
        raise DataError("missing or null", key=key, **location(row))
    if not isinstance(value, list) or not value:
        raise DataError(
            f"expected a string or a non-empty list of messages, got {type_name(value)}",
            key=key,
            **location(row),
        )
    messages = []
    for index, message in enumerate(value):
        if not isinstance(message, Mapping):
            raise DataError(
                f"message {index}: expected a dict, got {type_name(message)}", key=key, **location(row)
            )
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role:
            raise DataError(
                f"message {index}: 'role' must be a non-empty string, got {role!r}", key=key, **location(row)
            )
        if parts and isinstance(content, list) and all(isinstance(part, Mapping) for part in content):
            messages.append({"role": role, "content": [dict(part) for part in content]})
            continue
        if not isinstance(content, str):
            raise DataError(
                f"message {index}: 'content' must be a string{' or a list of parts' if parts else ''}, "
                f"got {type_name(content)}",
                key=key,
                **location(row),
            )
        messages.append({"role": role, "content": content})
    return messages
