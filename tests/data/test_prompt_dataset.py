"""Tests of rl_data.datasets.prompts: rendering, token ids, labels, length limits and bad rows."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from tokenizers import processors

from rl_data.datasets import prompts
from rl_data.datasets.common import ROW_COLUMN, SOURCE_COLUMN
from rl_data.datasets.mixing import mix_datasets
from rl_data.datasets.prompts import PromptDataset
from rl_data.datasets.sampler import PromptLoader
from rl_data.errors import DataError
from rl_data.records import PromptSample
from rl_data.templates import render_prompt


@pytest.fixture
def cache(tmp_path):
    return tmp_path / "hf-cache"


@pytest.fixture(scope="module")
def bos_tokenizer(tokenizer):
    """The ChatML tokenizer, made to add a BOS (<|endoftext|>) when asked for special tokens."""
    with_bos = copy.deepcopy(tokenizer)
    bos_id = with_bos.convert_tokens_to_ids("<|endoftext|>")
    with_bos.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos_id)]
    )
    return with_bos


@pytest.fixture(scope="module")
def no_template_tokenizer(tokenizer):
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = None
    return plain


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


QUESTIONS = [
    {"prompt": "What is 2 + 3?", "label": "5"},
    {"prompt": "What is 7 * 6?", "label": "42"},
    {"prompt": "Say hello.", "label": "hello"},
]


# --------------------------------------------------------------------------- rendering and ids


@pytest.mark.parametrize("template", ["chatml", "chatml-think", "header"])
def test_prompts_are_rendered_with_the_chat_template_and_tokenised_without_extra_special_tokens(
    make_tokenizer, template
):
    tokenizer = make_tokenizer(template)
    dataset = PromptDataset(QUESTIONS, tokenizer, label_key="label")
    assert len(dataset) == 3
    for index, row in enumerate(QUESTIONS):
        sample = dataset[index]
        expected = tokenizer.apply_chat_template(
            [{"role": "user", "content": row["prompt"]}], tokenize=False, add_generation_prompt=True
        )
        assert sample.prompt == expected
        assert sample.prompt_ids.tolist() == tokenizer(expected, add_special_tokens=False)["input_ids"]
        assert sample.prompt_ids.dtype == torch.int64
        assert sample.label == row["label"]
        assert (sample.index, sample.row) == (index, index)


def test_the_header_template_bos_appears_exactly_once(make_tokenizer):
    tokenizer = make_tokenizer("header")
    bos_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    ids = PromptDataset(QUESTIONS[:1], tokenizer)[0].prompt_ids.tolist()
    assert ids[0] == bos_id
    assert ids[1] != bos_id


def test_with_the_chat_template_the_tokenizer_adds_no_bos_and_with_an_input_template_it_does(bos_tokenizer):
    bos_id = bos_tokenizer.convert_tokens_to_ids("<|endoftext|>")
    chat = PromptDataset(QUESTIONS[:1], bos_tokenizer)[0]
    assert chat.prompt_ids.tolist() == bos_tokenizer(chat.prompt, add_special_tokens=False)["input_ids"]
    assert chat.prompt_ids[0] != bos_id
    templated = PromptDataset(QUESTIONS[:1], bos_tokenizer, input_template="Q: {}\nA:")[0]
    assert templated.prompt == "Q: What is 2 + 3?\nA:"
    assert templated.prompt_ids.tolist() == [
        bos_id,
        *bos_tokenizer(templated.prompt, add_special_tokens=False)["input_ids"],
    ]


def test_message_lists_and_a_system_prompt_are_rendered_by_render_prompt(tokenizer):
    conversation = [{"role": "system", "content": "Own system."}, {"role": "user", "content": "Hi"}]
    rows = [{"prompt": conversation}, {"prompt": [{"role": "user", "content": "Hello"}]}]
    dataset = PromptDataset(rows, tokenizer, system_prompt="Be brief.")
    assert dataset[0].prompt == render_prompt(tokenizer, conversation)
    assert dataset[0].prompt.count("<|im_start|>system") == 1  # the row's own system message wins
    assert dataset[1].prompt == render_prompt(tokenizer, "Hello", system_prompt="Be brief.")
    assert dataset[1].prompt.startswith("<|im_start|>system\nBe brief.<|im_end|>\n")


def test_without_chat_template_the_prompt_is_the_text_itself(tokenizer, no_template_tokenizer):
    for chosen in (tokenizer, no_template_tokenizer):
        sample = PromptDataset(QUESTIONS, chosen, apply_chat_template=False)[1]
        assert sample.prompt == "What is 7 * 6?"
        assert sample.prompt_ids.tolist() == chosen("What is 7 * 6?")["input_ids"]


def test_an_input_template_takes_precedence_over_the_chat_template(tokenizer):
    sample = PromptDataset(QUESTIONS, tokenizer, input_template="{} Think step by step.")[2]
    assert sample.prompt == "Say hello. Think step by step."


def test_another_input_key_is_read(tokenizer):
    dataset = PromptDataset([{"question": "Why?", "prompt": 3}], tokenizer, input_key="question")
    assert dataset[0].prompt.endswith("Why?<|im_end|>\n<|im_start|>assistant\n")
    assert dataset[0].label is None


@pytest.mark.parametrize("label", ["42", 42, 2.5, {"answer": "42", "tests": ["a", "b"]}, [1, 2]])
def test_a_label_may_be_any_json_like_value(tokenizer, label):
    dataset = PromptDataset(
        [{"prompt": "Q", "label": label}, {"prompt": "R", "label": label}], tokenizer, label_key="label"
    )
    assert dataset[0].label == label
    assert dataset[1].label == label


def test_rows_are_tokenised_in_batches_across_chunk_boundaries(tokenizer, monkeypatch):
    monkeypatch.setattr(prompts, "CHUNK_ROWS", 3)
    rows = [{"prompt": f"What is {index} + {index}?" if index % 4 else ""} for index in range(11)]
    dataset = PromptDataset(rows, tokenizer, on_bad_row="skip")
    kept = [index for index in range(11) if index % 4]
    assert [sample.row for sample in (dataset[i] for i in range(len(dataset)))] == kept
    for position, row in enumerate(kept):
        text = render_prompt(tokenizer, rows[row]["prompt"])
        assert dataset[position].prompt_ids.tolist() == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert dataset.lengths.tolist() == [len(dataset[i].prompt_ids) for i in range(len(dataset))]
    assert dataset.num_tokens == int(dataset.lengths.sum())
    assert dataset.stats.skipped == {"bad_prompt": 3}


# --------------------------------------------------------------------------- locations and indexing


def test_samples_name_their_file_and_row_after_mixing(tmp_path, cache, tokenizer):
    first = write_jsonl(
        tmp_path / "first.jsonl", [{"prompt": f"a{index}", "label": index} for index in range(20)]
    )
    second = write_jsonl(
        tmp_path / "second.jsonl", [{"prompt": f"b{index}", "label": index} for index in range(20)]
    )
    mixed = mix_datasets([first, second], probabilities=[0.5, 0.5], seed=1, shuffle=True, cache_dir=cache)
    dataset = PromptDataset(mixed, tokenizer, label_key="label")
    assert len(dataset) == len(mixed)
    for index in range(len(dataset)):
        sample = dataset[index]
        name = "a" if sample.source == str(first) else "b"
        assert sample.source == mixed[index][SOURCE_COLUMN]
        assert sample.row == mixed[index][ROW_COLUMN] == sample.label
        assert f"user\n{name}{sample.row}<|im_end|>" in sample.prompt
        assert sample.index == index


def test_a_list_of_paths_is_loaded_in_order(tmp_path, cache, tokenizer):
    first = write_jsonl(tmp_path / "first.jsonl", QUESTIONS[:2])
    second = write_jsonl(tmp_path / "second.jsonl", QUESTIONS[2:])
    dataset = PromptDataset([first, second], tokenizer, label_key="label", cache_dir=cache)
    assert [(dataset[i].source, dataset[i].row) for i in range(3)] == [
        (str(first), 0),
        (str(first), 1),
        (str(second), 0),
    ]


def test_indexing_allows_negative_indexes_and_refuses_others(tokenizer):
    dataset = PromptDataset(QUESTIONS, tokenizer)
    assert dataset[-1].prompt == dataset[2].prompt
    assert dataset[-3].index == 0
    with pytest.raises(IndexError, match="PromptDataset index 3 is out of range for 3 samples"):
        dataset[3]
    with pytest.raises(IndexError, match="PromptDataset index -4 is out of range for 3 samples"):
        dataset[-4]
    with pytest.raises(TypeError, match="PromptDataset index: expected an int, got str"):
        dataset["0"]


def test_a_prompt_loader_serves_prompt_samples(tokenizer):
    dataset = PromptDataset(QUESTIONS, tokenizer, label_key="label")
    batch = next(iter(PromptLoader(dataset, batch_size=2, seed=0)))
    assert len(batch) == 2
    assert all(isinstance(sample, PromptSample) for sample in batch)
    assert {sample.label for sample in batch} <= {"5", "42", "hello"}


# --------------------------------------------------------------------------- max_length


def long_and_short_rows():
    return [{"prompt": "Hi"}, {"prompt": "What is 12 + 34? " * 5}, {"prompt": "Hello"}]


def test_overlong_drop_leaves_out_long_prompts_and_counts_them(tokenizer):
    dataset = PromptDataset(long_and_short_rows(), tokenizer, max_length=16, overlong="drop")
    assert [dataset[i].row for i in range(len(dataset))] == [0, 2]
    assert [dataset[i].index for i in range(len(dataset))] == [0, 1]
    assert dataset.stats.skipped == {"too_long": 1}
    assert dataset.stats.kept == 2
    assert "row 1, key 'prompt': prompt has" in dataset.stats.examples[0]
    assert all(length <= 16 for length in dataset.lengths.tolist())


def test_overlong_truncate_left_keeps_the_last_tokens_and_the_full_text(tokenizer):
    full = PromptDataset(long_and_short_rows(), tokenizer)
    cut = PromptDataset(long_and_short_rows(), tokenizer, max_length=16, overlong="truncate_left")
    assert len(cut) == 3
    assert cut[1].prompt_ids.tolist() == full[1].prompt_ids.tolist()[-16:]
    assert cut[1].prompt == full[1].prompt
    assert cut[1].extra == {"truncated": True, "original_length": len(full[1].prompt_ids)}
    assert cut[0].extra == {}
    assert cut.stats.truncated == 1
    assert cut.stats.summary() == "kept 3, truncated 1, skipped 0"


def test_overlong_error_names_the_file_the_row_and_the_lengths(tmp_path, cache, tokenizer):
    path = write_jsonl(tmp_path / "long.jsonl", long_and_short_rows())
    length = len(PromptDataset(long_and_short_rows(), tokenizer)[1].prompt_ids)
    with pytest.raises(
        DataError,
        match=rf"long\.jsonl, row 1, key 'prompt': prompt has {length} tokens, more than max_length 16",
    ):
        PromptDataset(path, tokenizer, max_length=16, overlong="error", cache_dir=cache)


def test_a_prompt_of_exactly_max_length_is_kept_whole(tokenizer):
    length = len(PromptDataset(QUESTIONS[:1], tokenizer)[0].prompt_ids)
    sample = PromptDataset(QUESTIONS[:1], tokenizer, max_length=length, overlong="error")[0]
    assert len(sample.prompt_ids) == length
    assert sample.extra == {}


def test_when_every_prompt_is_dropped_the_dataset_refuses_to_be_empty(tokenizer):
    with pytest.raises(
        DataError, match=r"no prompt left after filtering \(kept 0, truncated 0, skipped 3 \(too_long 3\)\)"
    ):
        PromptDataset(QUESTIONS, tokenizer, max_length=2)


# --------------------------------------------------------------------------- bad rows


BAD_ROWS = [
    ({"prompt": None, "label": "a"}, "bad_prompt", r"row 1, key 'prompt': missing or null"),
    ({"prompt": "   ", "label": "a"}, "bad_prompt", r"row 1, key 'prompt': empty string"),
    ({"label": "a"}, "bad_prompt", r"row 1, key 'prompt': missing or null"),
    ({"prompt": "fine", "label": None}, "bad_label", r"row 1, key 'label': missing or null label"),
    ({"prompt": "fine"}, "bad_label", r"row 1, key 'label': missing or null label"),
]


@pytest.mark.parametrize(("bad", "reason", "pattern"), BAD_ROWS)
def test_a_bad_row_raises_naming_the_file_row_and_key(tmp_path, cache, tokenizer, bad, reason, pattern):
    path = write_jsonl(tmp_path / "rows.jsonl", [QUESTIONS[0], bad, QUESTIONS[1]])
    with pytest.raises(DataError, match=rf"rows\.jsonl, {pattern}"):
        PromptDataset(path, tokenizer, label_key="label", cache_dir=cache)


@pytest.mark.parametrize(("bad", "reason", "pattern"), BAD_ROWS)
def test_a_bad_row_is_skipped_and_counted_by_reason(tmp_path, cache, tokenizer, bad, reason, pattern):
    path = write_jsonl(tmp_path / "rows.jsonl", [QUESTIONS[0], bad, QUESTIONS[1]])
    dataset = PromptDataset(path, tokenizer, label_key="label", on_bad_row="skip", cache_dir=cache)
    assert [(dataset[i].row, dataset[i].index, dataset[i].label) for i in range(len(dataset))] == [
        (0, 0, "5"),
        (2, 1, "42"),
    ]
    assert dataset.stats.skipped == {reason: 1}
    assert dataset.stats.kept == 2
    assert "rows.jsonl, row 1" in dataset.stats.examples[0]


def test_a_non_string_prompt_is_a_bad_row(tmp_path, cache, tokenizer):
    path = write_jsonl(tmp_path / "numbers.jsonl", [{"prompt": 1}, {"prompt": 2}])
    with pytest.raises(DataError, match=r"numbers\.jsonl, row 0, key 'prompt': expected a string, got int"):
        PromptDataset(path, tokenizer, cache_dir=cache)


@pytest.mark.parametrize(
    ("bad", "pattern"),
    [
        ([{"role": "user"}], r"message 0: 'content' must be a string, got NoneType"),
        (
            [{"role": "user", "content": "a"}, {"content": "b"}],
            r"message 1: 'role' must be a non-empty string, got None",
        ),
        ([], r"expected a string or a non-empty list of messages, got list"),
    ],
)
def test_malformed_messages_name_the_file_row_key_and_message(tmp_path, cache, tokenizer, bad, pattern):
    good = [{"role": "user", "content": "Hi"}]
    path = write_jsonl(tmp_path / "chats.jsonl", [{"prompt": good}, {"prompt": bad}])
    with pytest.raises(DataError, match=rf"chats\.jsonl, row 1, key 'prompt': {pattern}"):
        PromptDataset(path, tokenizer, cache_dir=cache)
    skipping = PromptDataset(path, tokenizer, on_bad_row="skip", cache_dir=cache)
    assert len(skipping) == 1
    assert skipping.stats.skipped == {"bad_prompt": 1}


def test_messages_without_the_chat_template_are_a_bad_row(tokenizer):
    rows = [{"prompt": [{"role": "user", "content": "Hi"}]}]
    with pytest.raises(
        DataError, match=r"<in-memory>, row 0, key 'prompt': a list of messages needs the chat template"
    ):
        PromptDataset(rows, tokenizer, input_template="Q: {}")


def test_a_chat_template_that_fails_on_a_row_names_the_row(make_tokenizer):
    failing = copy.deepcopy(make_tokenizer("chatml"))
    failing.chat_template = (
        "{{ raise_exception('no system role here') if messages[0]['role'] == 'system' else 'ok' }}"
    )
    rows = [
        {"prompt": [{"role": "user", "content": "Hi"}]},
        {"prompt": [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}]},
    ]
    with pytest.raises(DataError, match=r"<in-memory>, row 1, key 'prompt': .*no system role here"):
        PromptDataset(rows, failing)
    assert len(PromptDataset(rows, failing, on_bad_row="skip")) == 1


# --------------------------------------------------------------------------- construction checks


MISSING = "/nonexistent/prompts.jsonl"  # the option checks must fail before any file is read


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        (dict(overlong="cut"), r"overlong: 'cut' is not one of \('drop', 'truncate_left', 'error'\)"),
        (dict(on_bad_row="ignore"), r"on_bad_row: 'ignore' is not one of \('error', 'skip'\)"),
        (dict(max_length=0), r"max_length: expected an integer >= 1 or None, got 0"),
        (dict(input_key=""), r"input_key: expected a non-empty column name, got ''"),
        (
            dict(input_template="no placeholder"),
            r"input_template: 'no placeholder' must contain '\{\}' exactly once",
        ),
        (dict(input_template="{} and {}"), r"must contain '\{\}' exactly once .* found 2"),
        (dict(input_template="Q: {}", system_prompt="S"), r"system_prompt: needs the chat template"),
        (dict(apply_chat_template=False, system_prompt="S"), r"system_prompt: needs the chat template"),
    ],
)
def test_bad_options_fail_at_construction_before_reading_data(tokenizer, kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        PromptDataset(MISSING, tokenizer, **kwargs)


def test_a_tokenizer_without_chat_template_fails_at_construction(no_template_tokenizer):
    with pytest.raises(ValueError, match="has no chat template"):
        PromptDataset(MISSING, no_template_tokenizer)
    assert (
        PromptDataset(QUESTIONS, no_template_tokenizer, input_template="Q: {}")[0].prompt
        == "Q: What is 2 + 3?"
    )


@pytest.mark.parametrize(
    ("kwargs", "key"), [(dict(input_key="question"), "question"), (dict(label_key="answer"), "answer")]
)
def test_a_missing_column_names_the_key_and_the_file(tmp_path, cache, tokenizer, kwargs, key):
    path = write_jsonl(tmp_path / "data.jsonl", QUESTIONS)
    with pytest.raises(
        DataError,
        match=rf"data\.jsonl, row 0, key '{key}': missing; the rows have the keys \['prompt', 'label'\]",
    ):
        PromptDataset(path, tokenizer, cache_dir=cache, **kwargs)


def test_what_was_kept_truncated_and_skipped_is_reported_in_the_log(tokenizer, caplog):
    rows = [{"prompt": "short"}, {"prompt": "a much longer prompt " * 20}, {"prompt": ""}]
    with caplog.at_level("INFO", logger="rl_data.datasets.prompts"):
        dataset = PromptDataset(rows, tokenizer, max_length=40, overlong="drop", on_bad_row="skip")
    assert dataset.stats.kept == 1
    assert "PromptDataset: kept 1, truncated 0, skipped 2 (bad_prompt 1, too_long 1)" in caplog.text
