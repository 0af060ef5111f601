"""Tests of rl_data.datasets.mixing: concatenation, probabilistic interleaving, location columns."""

from __future__ import annotations

import json
import math

import datasets
import pytest

from rl_data.datasets.common import IN_MEMORY, ROW_COLUMN, SOURCE_COLUMN
from rl_data.datasets.mixing import STOPPING_STRATEGIES, mix_datasets, parse_list, parse_probabilities
from rl_data.errors import DataError


@pytest.fixture
def cache(tmp_path):
    return tmp_path / "hf-cache"


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def rows(name, count):
    return [{"prompt": f"{name}-{index}", "label": index} for index in range(count)]


@pytest.fixture(scope="module")
def two_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("two-files")
    return write_jsonl(folder / "a.jsonl", rows("a", 2000)), write_jsonl(folder / "b.jsonl", rows("b", 2000))


# --------------------------------------------------------------------------- parsing


def test_parse_list_splits_comma_separated_strings_and_keeps_sequences():
    assert parse_list("a.jsonl, b.parquet ,c.csv") == ["a.jsonl", "b.parquet", "c.csv"]
    assert parse_list(["x", "y"]) == ["x", "y"]
    assert parse_list(("x",)) == ["x"]
    with pytest.raises(ValueError, match="empty item in the comma-separated list 'a,,b'"):
        parse_list("a,,b")
    with pytest.raises(TypeError, match="got int"):
        parse_list(3)


def test_parse_probabilities_reads_numbers_and_strings():
    assert parse_probabilities("0.7,0.3") == [0.7, 0.3]
    assert parse_probabilities([1, 0]) == [1.0, 0.0]
    with pytest.raises(ValueError, match=r"probabilities\[1\]: 'x' is not a number"):
        parse_probabilities("0.5,x")


# --------------------------------------------------------------------------- concatenation


def test_without_probabilities_sources_are_concatenated_in_order(tmp_path, cache):
    first = write_jsonl(tmp_path / "first.jsonl", rows("a", 3))
    second = write_jsonl(tmp_path / "second.jsonl", rows("b", 2))
    mixed = mix_datasets([first, second], cache_dir=cache)
    assert mixed["prompt"] == ["a-0", "a-1", "a-2", "b-0", "b-1"]
    assert mixed[SOURCE_COLUMN] == [str(first)] * 3 + [str(second)] * 2
    assert mixed[ROW_COLUMN] == [0, 1, 2, 0, 1]


def test_a_comma_separated_string_of_paths_is_read_like_a_list(tmp_path, cache):
    first = write_jsonl(tmp_path / "first.jsonl", rows("a", 2))
    second = write_jsonl(tmp_path / "second.jsonl", rows("b", 1))
    mixed = mix_datasets(f"{first},{second}", cache_dir=cache)
    assert mixed["prompt"] == ["a-0", "a-1", "b-0"]


def test_datasets_and_row_lists_mix_with_files(tmp_path, cache):
    path = write_jsonl(tmp_path / "file.jsonl", rows("f", 1))
    mixed = mix_datasets([datasets.Dataset.from_list(rows("d", 1)), rows("r", 1), path], cache_dir=cache)
    assert mixed["prompt"] == ["d-0", "r-0", "f-0"]
    assert mixed[SOURCE_COLUMN] == [IN_MEMORY, IN_MEMORY, str(path)]
    assert mix_datasets(datasets.Dataset.from_list(rows("d", 2)))["prompt"] == ["d-0", "d-1"]


def test_concatenating_sources_with_other_columns_fails_naming_both(tmp_path, cache):
    first = write_jsonl(tmp_path / "first.jsonl", rows("a", 2))
    other = write_jsonl(tmp_path / "other.jsonl", [{"question": "q"}])
    with pytest.raises(DataError, match=r"other.jsonl: columns .* differ from .* of .*first.jsonl"):
        mix_datasets([first, other], cache_dir=cache)


# --------------------------------------------------------------------------- interleaving


def test_the_mixture_follows_the_probabilities(two_files, cache):
    mixed = mix_datasets(list(two_files), probabilities=[0.8, 0.2], seed=0, cache_dir=cache)
    head = mixed.select(range(1000))
    share = sum(source == str(two_files[0]) for source in head[SOURCE_COLUMN]) / 1000
    # Binomial(1000, 0.8) has a standard deviation of about 0.013: five of them.
    assert abs(share - 0.8) < 0.065


def test_each_source_is_read_in_order_and_every_row_keeps_its_file_and_row(two_files, cache):
    mixed = mix_datasets(list(two_files), probabilities="0.5,0.5", seed=3, cache_dir=cache)
    for path, name in zip(two_files, "ab"):
        picked = [
            (prompt, row)
            for prompt, source, row in zip(mixed["prompt"], mixed[SOURCE_COLUMN], mixed[ROW_COLUMN])
            if source == str(path)
        ]
        assert all(prompt == f"{name}-{row}" for prompt, row in picked)
        assert [row for _, row in picked[:2000]] == list(range(2000))


def test_all_exhausted_reads_every_row_and_first_exhausted_stops_at_the_first_empty_source(two_files, cache):
    everything = mix_datasets(list(two_files), probabilities=[0.7, 0.3], seed=1, cache_dir=cache)
    assert set(everything["prompt"]) == {f"{name}-{index}" for name in "ab" for index in range(2000)}
    first = mix_datasets(
        list(two_files),
        probabilities=[0.7, 0.3],
        seed=1,
        stopping_strategy="first_exhausted",
        cache_dir=cache,
    )
    assert len(first) < 4000 < len(everything)
    once = mix_datasets(
        list(two_files),
        probabilities=[0.7, 0.3],
        seed=1,
        stopping_strategy="all_exhausted_without_replacement",
        cache_dir=cache,
    )
    assert sorted(once["prompt"]) == sorted(everything.unique("prompt"))
    assert len(once) == 4000


def test_a_source_with_probability_zero_contributes_nothing(tmp_path, two_files, cache):
    mixed = mix_datasets(list(two_files), probabilities=[1.0, 0.0], cache_dir=cache)
    assert set(mixed[SOURCE_COLUMN]) == {str(two_files[0])}
    assert len(mixed) == 2000


def test_the_same_seed_gives_the_same_mixture_and_another_seed_another(two_files, cache):
    def mix(seed, **kwargs):
        return mix_datasets(
            list(two_files), probabilities=[0.6, 0.4], seed=seed, max_samples=300, cache_dir=cache, **kwargs
        )

    assert mix(5)["prompt"] == mix(5)["prompt"]
    assert mix(5)["prompt"] != mix(6)["prompt"]
    assert mix(5, shuffle=True)["prompt"] == mix(5, shuffle=True)["prompt"]
    assert mix(5, shuffle=True)["prompt"] != mix(6, shuffle=True)["prompt"]


def test_interleaving_aligns_columns_given_in_another_order(tmp_path, cache):
    first = write_jsonl(tmp_path / "a.jsonl", rows("a", 3))
    swapped = write_jsonl(tmp_path / "b.jsonl", [{"label": 9, "prompt": "b-0"}])
    mixed = mix_datasets([first, swapped], probabilities=[0.5, 0.5], cache_dir=cache)
    assert mixed.column_names == ["prompt", "label", SOURCE_COLUMN, ROW_COLUMN]
    assert {"prompt": "b-0", "label": 9} in [{"prompt": r["prompt"], "label": r["label"]} for r in mixed]


def test_interleaving_sources_whose_column_types_differ_names_the_column(tmp_path, cache):
    first = write_jsonl(tmp_path / "a.jsonl", rows("a", 3))
    texts = write_jsonl(tmp_path / "b.jsonl", [{"prompt": "b", "label": "nine"}])
    with pytest.raises(
        DataError, match=r"b.jsonl, key 'label': column type .*string.* differs from .*int64.* in .*a.jsonl"
    ):
        mix_datasets([first, texts], probabilities=[0.5, 0.5], cache_dir=cache)
    other = write_jsonl(tmp_path / "c.jsonl", [{"question": "q", "label": 1}])
    with pytest.raises(DataError, match=r"c.jsonl: columns .* differ"):
        mix_datasets([first, other], probabilities=[0.5, 0.5], cache_dir=cache)


# --------------------------------------------------------------------------- shuffle and max_samples


def test_shuffle_permutes_the_rows_without_losing_any(tmp_path, cache):
    path = write_jsonl(tmp_path / "a.jsonl", rows("a", 50))
    shuffled = mix_datasets([path], shuffle=True, seed=1, cache_dir=cache)
    assert shuffled["prompt"] != [f"a-{index}" for index in range(50)]
    assert sorted(shuffled[ROW_COLUMN]) == list(range(50))
    assert all(prompt == f"a-{row}" for prompt, row in zip(shuffled["prompt"], shuffled[ROW_COLUMN]))


def test_max_samples_keeps_the_first_rows_of_the_mixture(tmp_path, two_files, cache):
    full = mix_datasets(list(two_files), probabilities=[0.5, 0.5], seed=2, shuffle=True, cache_dir=cache)
    cut = mix_datasets(
        list(two_files), probabilities=[0.5, 0.5], seed=2, shuffle=True, max_samples=25, cache_dir=cache
    )
    assert cut["prompt"] == full["prompt"][:25]
    small = write_jsonl(tmp_path / "small.jsonl", rows("s", 3))
    assert len(mix_datasets([small], max_samples=10, cache_dir=cache)) == 3


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("probabilities", "error", "pattern"),
    [
        ([1.0], ValueError, "probabilities: 1 values for 2 sources"),
        ("0.2,0.3,0.5", ValueError, "probabilities: 3 values for 2 sources"),
        ([1.5, -0.5], ValueError, r"probabilities\[1\]: -0.5 must be a finite number >= 0"),
        ([math.nan, 1.0], ValueError, r"probabilities\[0\]: nan must be a finite number >= 0"),
        ("inf,0", ValueError, r"probabilities\[0\]: 'inf' must be a finite number >= 0"),
        ([0.5, 0.4], ValueError, r"probabilities: \[0.5, 0.4\] sum to 0.9, not 1"),
        ("0.5,0.50001", ValueError, "sum to 1.00001, not 1"),
    ],
)
def test_bad_probabilities_are_refused(two_files, cache, probabilities, error, pattern):
    with pytest.raises(error, match=pattern):
        mix_datasets(list(two_files), probabilities=probabilities, cache_dir=cache)


def test_probabilities_within_the_tolerance_of_one_are_accepted(tmp_path, cache):
    first = write_jsonl(tmp_path / "a.jsonl", rows("a", 3))
    second = write_jsonl(tmp_path / "b.jsonl", rows("b", 3))
    mixed = mix_datasets([first, second], probabilities=[1 / 3, 2 / 3 + 5e-7], cache_dir=cache)
    assert len(mixed) >= 6


def test_an_unknown_stopping_strategy_lists_the_allowed_ones(two_files, cache):
    with pytest.raises(ValueError, match=r"stopping_strategy: 'never' is not one of \('first_exhausted'"):
        mix_datasets(list(two_files), probabilities=[0.5, 0.5], stopping_strategy="never", cache_dir=cache)
    assert "all_exhausted" in STOPPING_STRATEGIES


@pytest.mark.parametrize("max_samples", [0, -3, 2.5, True])
def test_max_samples_below_one_is_refused(two_files, cache, max_samples):
    with pytest.raises(ValueError, match=r"max_samples: expected an integer >= 1 or None"):
        mix_datasets(list(two_files), max_samples=max_samples, cache_dir=cache)


def test_no_sources_is_refused():
    with pytest.raises(ValueError, match="sources: empty"):
        mix_datasets([])
