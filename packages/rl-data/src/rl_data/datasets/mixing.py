"""Mixing several datasets into one: concatenation, or sampling sources by probability.

Two ways to combine sources `D₁ … D_k`:

- no probabilities: concatenation, `D₁ ‖ D₂ ‖ … ‖ D_k`, in the order given;
- probabilities `p₁ … p_k` (Σ pᵢ = 1): each row of the mixture is drawn from source `i` with
  probability `pᵢ`, taking that source's rows in order (`datasets.interleave_datasets`). The
  stopping strategy decides the length: "first_exhausted" stops when one source runs out,
  "all_exhausted" cycles the sources that ran out until every source was read once in full
  (oversampling), "all_exhausted_without_replacement" reads every row exactly once.

Either way the result is a plain `datasets.Dataset` that keeps the `__source__` / `__row__`
location columns, so every mixed row still names its file and its row. Options follow OpenRLHF's
command line: `"a.jsonl,b.parquet"` and `"0.7,0.3"` are accepted as comma-separated strings.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

from ..errors import DataError, check_integer, type_name
from .common import IN_MEMORY, SOURCE_COLUMN, as_dataset, check_choice, concatenate_sources

__all__ = ["STOPPING_STRATEGIES", "mix_datasets", "parse_list", "parse_probabilities"]

STOPPING_STRATEGIES: tuple[str, ...] = (
    "first_exhausted",
    "all_exhausted",
    "all_exhausted_without_replacement",
)

# Probabilities are read from configs and command lines; they must add up to 1 within this.
PROBABILITY_TOLERANCE = 1e-6


def parse_list(value: str | Sequence[Any]) -> list[Any]:
    """A comma-separated string as a list of stripped, non-empty items; a sequence as a list.

    `"a.jsonl, b.parquet"` → `["a.jsonl", "b.parquet"]`. A path (`os.PathLike`) is one item.
    """
    if isinstance(value, os.PathLike):
        return [value]
    if isinstance(value, str):
        items = [item.strip() for item in value.split(",")]
        if not all(items):
            raise ValueError(f"empty item in the comma-separated list {value!r}")
        return items
    if isinstance(value, Sequence):
        return list(value)
    raise TypeError(f"expected a comma-separated string or a sequence, got {type_name(value)}")


def parse_probabilities(value: str | Sequence[float]) -> list[float]:
    """Probabilities from `"0.7,0.3"` or a sequence of numbers, checked finite and non-negative.

    The sum is checked against 1 by `mix_datasets`, which knows how many sources there are.
    """
    items = parse_list(value)
    probabilities = []
    for index, item in enumerate(items):
        try:
            number = float(item)
        except (TypeError, ValueError):
            raise ValueError(f"probabilities[{index}]: {item!r} is not a number") from None
        if isinstance(item, bool) or not math.isfinite(number) or number < 0:
            raise ValueError(f"probabilities[{index}]: {item!r} must be a finite number >= 0")
        probabilities.append(number)
    return probabilities


def mix_datasets(
    sources: str | Sequence[Any],
    *,
    probabilities: str | Sequence[float] | None = None,
    seed: int = 42,
    shuffle: bool = False,
    max_samples: int | None = None,
    stopping_strategy: str = "all_exhausted",
    cache_dir: str | os.PathLike[str] | None = None,
) -> Any:
    """Combine datasets by concatenation or by probabilistic interleaving.

    Args:
        sources: paths (files or `save_to_disk` folders), `datasets.Dataset`s or lists of row
            dicts, mixed freely; or one comma-separated string of paths, or one Dataset. Each goes through
            `as_dataset`, so it carries (or keeps) its location columns.
        probabilities: one weight per source, as numbers or as a comma-separated string, each
            finite and >= 0, summing to 1 (within 1e-6). None: concatenate in the given order.
        seed: seeds both the choice of source per row (interleaving) and the shuffle.
        shuffle: shuffle the mixed rows (deterministic given `seed`).
        max_samples: keep only the first `max_samples` rows of the mixed (and possibly shuffled)
            dataset; all rows when it has fewer. None keeps everything.
        stopping_strategy: one of `STOPPING_STRATEGIES`; used only with probabilities.
        cache_dir: Arrow cache folder for the files that are loaded.

    Returns:
        A `datasets.Dataset` with the sources' shared columns (in the first source's order),
        including `__source__` and `__row__`.

    Raises:
        ValueError: bad probabilities (count, value, sum), stopping_strategy or max_samples.
        DataError: a source cannot be read, or the sources do not share their columns.
    """
    import datasets

    check_choice("stopping_strategy", stopping_strategy, STOPPING_STRATEGIES)
    check_integer("max_samples", max_samples, 1, allow_none=True)
    items = [sources] if isinstance(sources, datasets.Dataset) else parse_list(sources)
    if not items:
        raise ValueError("sources: empty; give at least one path or dataset")
    weights = None
    if probabilities is not None:
        weights = parse_probabilities(probabilities)
        if len(weights) != len(items):
            raise ValueError(
                f"probabilities: {len(weights)} values for {len(items)} sources; give one per source"
            )
        total = math.fsum(weights)
        if abs(total - 1.0) > PROBABILITY_TOLERANCE:
            raise ValueError(f"probabilities: {weights} sum to {total!r}, not 1")

    parts = [as_dataset(item, cache_dir=cache_dir) for item in items]
    if weights is None:
        mixed = concatenate_sources(parts) if len(parts) > 1 else parts[0]
    else:
        check_same_columns(parts)
        columns = parts[0].column_names
        parts = [part.select_columns(columns) for part in parts]
        # A source that is never drawn adds nothing, and datasets' without-replacement strategy
        # would wait for it to be exhausted: leave it out.
        # The sum is 1 within the tolerance; numpy's sampler wants it closer, so rescale.
        kept = [(part, weight) for part, weight in zip(parts, weights) if weight > 0]
        total = math.fsum(weight for _, weight in kept)
        mixed = datasets.interleave_datasets(
            [part for part, _ in kept],
            probabilities=[weight / total for _, weight in kept],
            seed=seed,
            stopping_strategy=stopping_strategy,
        )
    if shuffle:
        mixed = mixed.shuffle(seed=seed, keep_in_memory=True)
    if max_samples is not None and max_samples < len(mixed):
        mixed = mixed.select(range(max_samples), keep_in_memory=True)
    return mixed


def check_same_columns(parts: Sequence[Any]) -> None:
    """Every part has the first part's columns with compatible types; DataError naming both sources."""
    first = parts[0]
    first_source = source_name(first)
    for part in parts[1:]:
        if set(part.column_names) != set(first.column_names):
            raise DataError(
                f"columns {sorted(part.column_names)} differ from {sorted(first.column_names)} of "
                f"{first_source}; mixed datasets need the same columns",
                source=source_name(part),
            )
        for name in first.column_names:
            mine, theirs = part.features[name], first.features[name]
            if mine != theirs and not (is_null(mine) or is_null(theirs)):
                raise DataError(
                    f"column type {mine} differs from {theirs} in {first_source}; mixed datasets need the same types",
                    source=source_name(part),
                    key=name,
                )


def is_null(feature: Any) -> bool:
    """A column whose values are all null: Arrow aligns it with any type."""
    return getattr(feature, "dtype", None) == "null"


def source_name(dataset: Any) -> str:
    return dataset[0][SOURCE_COLUMN] if len(dataset) else IN_MEMORY
