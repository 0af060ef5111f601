"""Tests of rl_data.datasets.common: every file format, location columns, errors that say where."""

from __future__ import annotations

import json

import datasets
import msgspec
import pytest

from rl_data.datasets.common import (
    IN_MEMORY,
    ROW_COLUMN,
    SOURCE_COLUMN,
    DatasetStats,
    as_dataset,
    check_choice,
    concatenate_sources,
    load_dataset_source,
    location,
    read_messages,
    read_text,
    require_columns,
)
from rl_data.errors import DataError

ROWS = [
    {"prompt": "What is 2 + 3?", "label": 5},
    {"prompt": "Say «hello», then stop.", "label": 7},
    {"prompt": "A line\nwith a newline", "label": -1},
]


@pytest.fixture
def cache(tmp_path):
    return tmp_path / "hf-cache"


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    return path


def user_rows(dataset):
    """The rows without the location columns."""
    return [
        {key: value for key, value in row.items() if key not in (SOURCE_COLUMN, ROW_COLUMN)}
        for row in dataset
    ]


# --------------------------------------------------------------------------- formats


def write_in_format(tmp_path, kind):
    """Write ROWS in one of the supported forms; returns the path to load."""
    plain = datasets.Dataset.from_list(ROWS)
    if kind == "jsonl":
        return write_jsonl(tmp_path / "data.jsonl", ROWS)
    if kind == "json":
        path = tmp_path / "data.json"
        path.write_text(json.dumps(ROWS, ensure_ascii=False), encoding="utf-8")
        return path
    if kind == "parquet":
        plain.to_parquet(str(tmp_path / "data.parquet"))
        return tmp_path / "data.parquet"
    if kind == "csv":
        plain.to_csv(str(tmp_path / "data.csv"), index=False)
        return tmp_path / "data.csv"
    if kind == "arrow":
        plain.save_to_disk(str(tmp_path / "saved"))
        (arrow,) = (tmp_path / "saved").glob("*.arrow")
        return arrow
    if kind == "saved":
        plain.save_to_disk(str(tmp_path / "saved"))
        return tmp_path / "saved"
    if kind == "saved-dict":
        datasets.DatasetDict({"train": plain, "test": plain.select([0])}).save_to_disk(str(tmp_path / "dict"))
        return tmp_path / "dict"
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["jsonl", "json", "parquet", "csv", "arrow", "saved", "saved-dict"])
def test_every_format_loads_the_same_rows_with_location_columns(tmp_path, cache, kind):
    path = write_in_format(tmp_path, kind)
    dataset = load_dataset_source(path, cache_dir=cache)
    assert user_rows(dataset) == ROWS
    assert dataset[SOURCE_COLUMN] == [str(path)] * len(ROWS)
    assert dataset[ROW_COLUMN] == [0, 1, 2]
    assert dataset.column_names[-2:] == [SOURCE_COLUMN, ROW_COLUMN]


def test_jsonl_blank_lines_are_ignored_and_rows_are_numbered_without_them(tmp_path, cache):
    path = tmp_path / "gaps.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"prompt": "b"}\n   \n', encoding="utf-8")
    dataset = load_dataset_source(path, cache_dir=cache)
    assert dataset["prompt"] == ["a", "b"]
    assert dataset[ROW_COLUMN] == [0, 1]


def test_a_resaved_dataset_names_the_new_file_as_its_source(tmp_path, cache):
    first = load_dataset_source(write_jsonl(tmp_path / "first.jsonl", ROWS), cache_dir=cache)
    shuffled = first.shuffle(seed=0, keep_in_memory=True)
    shuffled.to_json(str(tmp_path / "second.jsonl"))
    second = load_dataset_source(tmp_path / "second.jsonl", cache_dir=cache)
    assert second[SOURCE_COLUMN] == [str(tmp_path / "second.jsonl")] * 3
    assert second[ROW_COLUMN] == [0, 1, 2]
    assert user_rows(second) == user_rows(shuffled)


# --------------------------------------------------------------------------- load errors


def test_a_missing_file_raises_file_not_found_with_its_path(tmp_path, cache):
    with pytest.raises(FileNotFoundError, match=r"nothing\.jsonl: dataset file or folder does not exist"):
        load_dataset_source(tmp_path / "nothing.jsonl", cache_dir=cache)


def test_an_unsupported_extension_lists_the_supported_ones(tmp_path, cache):
    path = tmp_path / "data.txt"
    path.write_text("hello\n")
    with pytest.raises(
        DataError, match=r"data.txt: unsupported file extension '\.txt'; supported: \['\.arrow'"
    ):
        load_dataset_source(path, cache_dir=cache)


def test_a_folder_that_is_not_a_saved_dataset_is_refused(tmp_path, cache):
    (tmp_path / "folder").mkdir()
    with pytest.raises(DataError, match="folder: folder is not a `save_to_disk` dataset"):
        load_dataset_source(tmp_path / "folder", cache_dir=cache)


def test_a_dataset_dict_folder_without_train_names_its_splits(tmp_path, cache):
    plain = datasets.Dataset.from_list(ROWS)
    datasets.DatasetDict({"validation": plain}).save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(DataError, match=r"has no 'train' split \(splits: \['validation'\]\)"):
        load_dataset_source(tmp_path / "dict", cache_dir=cache)


def test_a_malformed_jsonl_line_is_reported_with_its_line_number(tmp_path, cache):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"prompt": "b",}\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"broken.jsonl, line 3: malformed JSON line") as caught:
        load_dataset_source(path, cache_dir=cache)
    assert (caught.value.source, caught.value.line) == (str(path), 3)


def test_a_malformed_json_array_is_reported_with_its_line(tmp_path, cache):
    path = tmp_path / "broken.json"
    path.write_text('[\n{"prompt": "a"},\n{"prompt": }\n]', encoding="utf-8")
    with pytest.raises(DataError, match=r"broken.json, line 3: malformed JSON"):
        load_dataset_source(path, cache_dir=cache)


@pytest.mark.parametrize(
    ("content", "where"), [('{"a": 1}\n[1, 2]\n', "line 2"), ('[{"a": 1}, "text"]', "row 1")]
)
def test_a_json_row_that_is_not_an_object_is_refused(tmp_path, cache, content, where):
    path = tmp_path / "rows.json"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(
        DataError, match=rf"rows.json, {where}: expected a JSON object per (line|row), got (list|str)"
    ):
        load_dataset_source(path, cache_dir=cache)


@pytest.mark.parametrize(
    ("rows", "pattern"),
    [
        (
            [{"label": 1}, {"label": 2}, {"label": "three"}],
            r"row 2, key 'label': value is str here but number in row 0",
        ),
        ([{"label": "1"}, {"label": 2}], r"row 1, key 'label': value is number here but str in row 0"),
        (
            [{"x": "a", "label": [1]}, {"x": "b", "label": {"a": 1}}],
            r"row 1, key 'label': value is dict here but list",
        ),
    ],
)
def test_a_key_that_changes_type_between_rows_names_the_row_and_the_key(tmp_path, cache, rows, pattern):
    path = write_jsonl(tmp_path / "mixed.jsonl", rows)
    with pytest.raises(DataError, match=pattern):
        load_dataset_source(path, cache_dir=cache)


def test_integers_and_floats_in_one_key_are_one_number_type(tmp_path, cache):
    dataset = load_dataset_source(write_jsonl(tmp_path / "n.jsonl", [{"x": 1}, {"x": 2.5}]), cache_dir=cache)
    assert dataset["x"] == [1.0, 2.5]


@pytest.mark.parametrize(("name", "content"), [("empty.jsonl", ""), ("empty.csv", ""), ("empty.parquet", "")])
def test_an_empty_file_is_refused(tmp_path, cache, name, content):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(DataError, match=rf"{name}: empty file"):
        load_dataset_source(path, cache_dir=cache)


@pytest.mark.parametrize(
    ("name", "content", "pattern"), [("blank.jsonl", "\n  \n", "no rows"), ("none.json", "[]", "no rows")]
)
def test_a_json_file_without_rows_is_refused(tmp_path, cache, name, content, pattern):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(DataError, match=rf"{name}: .*{pattern}"):
        load_dataset_source(path, cache_dir=cache)


def test_a_csv_with_a_header_and_no_rows_is_refused(tmp_path, cache):
    path = tmp_path / "header.csv"
    path.write_text("prompt,label\n")
    with pytest.raises(DataError, match=r"header\.csv: .*no (data|rows)"):
        load_dataset_source(path, cache_dir=cache)


# --------------------------------------------------------------------------- as_dataset


def test_as_dataset_locates_rows_built_in_memory():
    dataset = as_dataset(ROWS)
    assert user_rows(dataset) == ROWS
    assert dataset[SOURCE_COLUMN] == [IN_MEMORY] * 3
    assert dataset[ROW_COLUMN] == [0, 1, 2]


def test_as_dataset_concatenates_paths_in_order_keeping_each_files_rows(tmp_path, cache):
    first = write_jsonl(tmp_path / "first.jsonl", ROWS[:2])
    second = write_jsonl(tmp_path / "second.jsonl", ROWS[2:])
    dataset = as_dataset([first, str(second)], cache_dir=cache)
    assert user_rows(dataset) == ROWS
    assert dataset[SOURCE_COLUMN] == [str(first), str(first), str(second)]
    assert dataset[ROW_COLUMN] == [0, 1, 0]


def test_as_dataset_keeps_the_location_of_an_already_located_dataset(tmp_path, cache):
    path = write_jsonl(tmp_path / "data.jsonl", ROWS)
    loaded = load_dataset_source(path, cache_dir=cache).select([2, 0])
    again = as_dataset(loaded)
    assert again[SOURCE_COLUMN] == [str(path)] * 2
    assert again[ROW_COLUMN] == [2, 0]


def test_as_dataset_adds_location_to_a_plain_dataset():
    dataset = as_dataset(datasets.Dataset.from_list(ROWS))
    assert dataset[SOURCE_COLUMN] == [IN_MEMORY] * 3


def test_as_dataset_refuses_a_dataset_dict_naming_its_splits():
    both = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(ROWS), "test": datasets.Dataset.from_list(ROWS)}
    )
    with pytest.raises(
        TypeError, match=r"pass one split, e.g. data\['train'\] \(splits: \['test', 'train'\]\)"
    ):
        as_dataset(both)


def test_as_dataset_rows_whose_key_changes_type_name_the_row_and_the_key():
    with pytest.raises(
        DataError, match=r"<in-memory>, row 1, key 'label': value is dict here but number in row 0"
    ):
        as_dataset([{"label": 5}, {"label": {"a": 1}}])
    with pytest.raises(
        DataError, match=r"<in-memory>, row 2, key 'prompt': value is list here but str in row 0"
    ):
        as_dataset([{"prompt": "a"}, {"prompt": None}, {"prompt": [{"role": "user", "content": "b"}]}])


def test_as_dataset_refuses_empty_and_unknown_inputs():
    with pytest.raises(DataError, match="data: empty"):
        as_dataset([])
    with pytest.raises(TypeError, match="got int"):
        as_dataset(3)
    with pytest.raises(TypeError, match="got list"):
        as_dataset([{"prompt": "a"}, "file.jsonl"])


def test_concatenating_sources_with_other_columns_names_both_files(tmp_path, cache):
    first = write_jsonl(tmp_path / "first.jsonl", ROWS)
    second = write_jsonl(tmp_path / "second.jsonl", [{"question": "q", "label": 1}])
    with pytest.raises(DataError, match=r"second.jsonl: columns .* differ from .* of .*first.jsonl"):
        as_dataset([first, second], cache_dir=cache)


def test_concatenation_aligns_columns_given_in_another_order(tmp_path, cache):
    first = load_dataset_source(write_jsonl(tmp_path / "a.jsonl", ROWS[:1]), cache_dir=cache)
    second = load_dataset_source(
        write_jsonl(tmp_path / "b.jsonl", [{"label": 3, "prompt": "x"}]), cache_dir=cache
    )
    joined = concatenate_sources([first, second])
    assert joined.column_names == first.column_names
    assert joined["prompt"] == [ROWS[0]["prompt"], "x"]


# --------------------------------------------------------------------------- reading rows


ROW = {
    "prompt": "hi",
    "blank": "  ",
    "number": 3,
    "none": None,
    SOURCE_COLUMN: "data/train.jsonl",
    ROW_COLUMN: 17,
}


def test_location_reads_the_location_columns_and_defaults_to_in_memory():
    assert location(ROW) == {"source": "data/train.jsonl", "row": 17}
    assert location({"prompt": "x"}) == {"source": IN_MEMORY, "row": None}


def test_read_text_returns_the_string_and_allows_empty_on_request():
    assert read_text(ROW, "prompt") == "hi"
    assert read_text(ROW, "blank", allow_empty=True) == "  "


@pytest.mark.parametrize(
    ("key", "reason"),
    [
        ("missing", "missing or null"),
        ("none", "missing or null"),
        ("number", "expected a string, got int"),
        ("blank", "empty string"),
    ],
)
def test_read_text_errors_name_file_row_and_key(key, reason):
    with pytest.raises(DataError, match=rf"^data/train.jsonl, row 17, key '{key}': {reason}$") as caught:
        read_text(ROW, key)
    assert (caught.value.source, caught.value.row, caught.value.key) == ("data/train.jsonl", 17, key)


def test_read_messages_turns_a_string_into_one_user_turn_and_keeps_a_list():
    assert read_messages(ROW, "prompt") == [{"role": "user", "content": "hi"}]
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi", "name": "x"},
    ]
    assert read_messages({"messages": conversation}, "messages") == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
    ]


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (None, "missing or null"),
        ([], "expected a string or a non-empty list of messages, got list"),
        (5, "expected a string or a non-empty list of messages, got int"),
        ("", "empty string"),
        ([{"role": "user", "content": "a"}, "b"], "message 1: expected a dict, got str"),
        ([{"role": "", "content": "a"}], "message 0: 'role' must be a non-empty string, got ''"),
        ([{"content": "a"}], "message 0: 'role' must be a non-empty string, got None"),
        (
            [{"role": "user", "content": "a"}, {"role": "assistant", "content": 3}],
            "message 1: 'content' must be a string, got int",
        ),
    ],
)
def test_read_messages_errors_name_file_row_key_and_message(value, reason):
    row = {"messages": value, SOURCE_COLUMN: "chats.parquet", ROW_COLUMN: 4}
    with pytest.raises(DataError, match=rf"^chats.parquet, row 4, key 'messages': {reason}"):
        read_messages(row, "messages")


def test_require_columns_names_the_missing_key_the_file_and_the_first_row(tmp_path, cache):
    path = write_jsonl(tmp_path / "data.jsonl", ROWS)
    dataset = load_dataset_source(path, cache_dir=cache)
    require_columns(dataset, ["prompt", None, "label"])
    with pytest.raises(
        DataError,
        match=r"data.jsonl, row 0, key 'answer': missing; the rows have the keys \['prompt', 'label'\]",
    ):
        require_columns(dataset, ["prompt", "answer"])


# --------------------------------------------------------------------------- stats and choices


def test_dataset_stats_count_skips_by_reason_and_keep_a_few_examples():
    stats = DatasetStats(kept=980, truncated=3)
    for index in range(7):
        stats.skip("too_long", f"row {index} too long")
    stats.skip("bad_row", DataError("empty string", row=9))
    stats.skip("bad_row")
    assert stats.skipped == {"too_long": 7, "bad_row": 2}
    assert stats.total_skipped == 9
    assert stats.examples == [f"row {index} too long" for index in range(DatasetStats.MAX_EXAMPLES)]
    assert stats.summary() == "kept 980, truncated 3, skipped 9 (bad_row 2, too_long 7)"
    assert DatasetStats().summary() == "kept 0, truncated 0, skipped 0"


def test_dataset_stats_round_trip_through_msgpack():
    stats = DatasetStats(kept=2, skipped={"bad_row": 1}, examples=["x"])
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(stats), type=DatasetStats) == stats


def test_check_choice_names_the_argument_and_the_allowed_values():
    check_choice("overlong", "drop", ("drop", "error"))
    with pytest.raises(ValueError, match=r"overlong: 'cut' is not one of \('drop', 'error'\)"):
        check_choice("overlong", "cut", ("drop", "error"))
