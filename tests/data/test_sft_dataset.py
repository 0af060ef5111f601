"""Tests of rl_data.datasets.sft: rows to token ids and loss masks, bad rows, overlong rows."""

from __future__ import annotations

import json

import pytest
import torch

from rl_data.datasets.sft import SFTDataset, SFTSample
from rl_data.errors import DataError
from rl_data.templates import assistant_token_texts, tokenize_conversation


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def selected_mask(tokens, span_numbers):
    mask = [False] * len(tokens.input_ids)
    for number in span_numbers:
        first, last = tokens.assistant_spans[number]
        mask[first:last] = [True] * (last - first)
    return mask


ROWS = [
    {"prompt": "What is 1 + 1?", "response": "The answer is 2."},
    {"prompt": "Say hi.", "response": "Hello!"},
    {"prompt": "What is 3 * 3?", "response": "<think>three threes</think>9"},
]


def test_rows_from_a_jsonl_file_match_tokenize_conversation(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "train.jsonl", ROWS)
    dataset = SFTDataset(path, tokenizer, cache_dir=tmp_path / "hf-cache")
    assert len(dataset) == 3
    assert dataset.stats.kept == 3
    for position, row in enumerate(ROWS):
        expected = tokenize_conversation(
            tokenizer,
            [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row["response"]}],
        )
        sample = dataset[position]
        assert isinstance(sample, SFTSample)
        assert sample.input_ids.dtype == torch.int64
        assert sample.loss_mask.dtype == torch.bool
        assert sample.input_ids.tolist() == expected.input_ids
        assert sample.loss_mask.tolist() == expected.loss_mask
        assert (sample.index, sample.source, sample.row) == (position, str(path), position)
    assert dataset.lengths == [len(sample.input_ids) for sample in dataset]


def test_rows_in_memory_with_a_system_prompt(tmp_path, make_tokenizer):
    tokenizer = make_tokenizer("header")
    dataset = SFTDataset(ROWS, tokenizer, system_prompt="Be brief.", cache_dir=tmp_path / "hf-cache")
    sample = dataset[1]
    expected = tokenize_conversation(
        tokenizer,
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Say hi."},
            {"role": "assistant", "content": "Hello!"},
        ],
    )
    assert sample.input_ids.tolist() == expected.input_ids
    assert sample.loss_mask.tolist() == expected.loss_mask
    assert (sample.index, sample.source, sample.row) == (1, "<in-memory>", 1)
    trained = tokenizer.decode(sample.input_ids[sample.loss_mask].tolist())
    assert trained == "Hello!<|endoftext|>"


def test_messages_key_trains_every_assistant_turn_exactly(tmp_path, make_tokenizer):
    tokenizer = make_tokenizer("chatml-think")
    conversation = [
        {"role": "user", "content": "2 + 2?"},
        {"role": "assistant", "content": "<think>add</think>4"},
        {"role": "user", "content": "and 3 + 3?"},
        {"role": "assistant", "content": "<think>add again</think>6"},
    ]
    path = write_jsonl(tmp_path / "chats.jsonl", [{"messages": conversation}])
    dataset = SFTDataset(path, tokenizer, messages_key="messages", cache_dir=tmp_path / "hf-cache")
    expected = tokenize_conversation(tokenizer, conversation)
    assert dataset[0].input_ids.tolist() == expected.input_ids
    assert dataset[0].loss_mask.tolist() == expected.loss_mask
    assert assistant_token_texts(tokenizer, expected) == [
        "4<|im_end|>",
        "<think>add again</think>6<|im_end|>",
    ]


def test_prompt_messages_are_context_and_only_the_response_is_trained(tmp_path, tokenizer):
    prompt = [
        {"role": "user", "content": "1 + 1?"},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "2 + 2?"},
    ]
    dataset = SFTDataset([{"prompt": prompt, "response": "4"}], tokenizer, cache_dir=tmp_path / "hf-cache")
    expected = tokenize_conversation(tokenizer, [*prompt, {"role": "assistant", "content": "4"}])
    sample = dataset[0]
    assert sample.input_ids.tolist() == expected.input_ids
    assert sample.loss_mask.tolist() == selected_mask(expected, [1])
    assert tokenizer.decode(sample.input_ids[sample.loss_mask].tolist()) == "4<|im_end|>"


def test_plain_text_mode_masks_exactly_the_response_and_eos(tmp_path, tokenizer):
    dataset = SFTDataset(
        ROWS[:1],
        tokenizer,
        input_template="Question: {}\nAnswer:",
        apply_chat_template=True,
        cache_dir=tmp_path / "c",
    )
    prompt_ids = tokenizer("Question: What is 1 + 1?\nAnswer:", add_special_tokens=False)["input_ids"]
    response_ids = tokenizer("The answer is 2.<|im_end|>", add_special_tokens=False)["input_ids"]
    sample = dataset[0]
    assert sample.input_ids.tolist() == prompt_ids + response_ids
    assert sample.loss_mask.tolist() == [False] * len(prompt_ids) + [True] * len(response_ids)

    raw = SFTDataset(ROWS[:1], tokenizer, apply_chat_template=False, cache_dir=tmp_path / "c")[0]
    raw_prompt_ids = tokenizer("What is 1 + 1?", add_special_tokens=False)["input_ids"]
    assert raw.input_ids.tolist() == raw_prompt_ids + response_ids
    assert tokenizer.decode(raw.input_ids[raw.loss_mask].tolist()) == "The answer is 2.<|im_end|>"


def test_missing_value_names_the_file_the_row_and_the_key(tmp_path, tokenizer):
    rows = [*ROWS[:2], {"prompt": "no response here"}]
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    with pytest.raises(DataError, match=r"train\.jsonl, row 2, key 'response': missing or null") as caught:
        SFTDataset(path, tokenizer, cache_dir=tmp_path / "hf-cache")
    assert (caught.value.source, caught.value.row, caught.value.key) == (str(path), 2, "response")


@pytest.mark.parametrize(
    ("rows", "match"),
    [
        (
            [{"prompt": 3, "response": "x"}],
            r"<in-memory>, row 0, key 'prompt': expected a string or a non-empty list",
        ),
        ([{"prompt": "  ", "response": "x"}], r"row 0, key 'prompt': empty string"),
        ([{"prompt": "p", "response": ""}], r"row 0, key 'response': empty string"),
        ([{"prompt": "p", "response": ["x"]}], r"row 0, key 'response': message 0: expected a dict"),
        (
            [{"prompt": [{"role": "user"}], "response": "x"}],
            r"key 'prompt': message 0: 'content' must be a string",
        ),
    ],
)
def test_bad_values_raise_data_error_with_their_location(tmp_path, tokenizer, rows, match):
    with pytest.raises(DataError, match=match):
        SFTDataset(rows, tokenizer, cache_dir=tmp_path / "hf-cache")


def test_conversation_without_assistant_turn_is_a_bad_row(tmp_path, tokenizer):
    rows = [{"messages": [{"role": "user", "content": "hi"}]}]
    with pytest.raises(DataError, match=r"row 0, key 'messages': messages: no 'assistant' message"):
        SFTDataset(rows, tokenizer, messages_key="messages", cache_dir=tmp_path / "hf-cache")


def test_skip_counts_bad_rows_and_keeps_the_others_with_their_positions(tmp_path, tokenizer):
    rows = [
        ROWS[0],
        {"prompt": "", "response": "x"},
        ROWS[1],
        {"prompt": "p", "response": None},
        ROWS[2],
    ]
    path = write_jsonl(tmp_path / "mixed.jsonl", rows)
    dataset = SFTDataset(path, tokenizer, on_bad_row="skip", cache_dir=tmp_path / "hf-cache")
    assert len(dataset) == 3
    assert [sample.row for sample in dataset] == [0, 2, 4]
    assert [sample.index for sample in dataset] == [0, 2, 4]
    assert dataset.stats.kept == 3
    assert dataset.stats.skipped == {"bad_row": 2}
    assert "row 1, key 'prompt': empty string" in dataset.stats.examples[0]
    assert "row 3, key 'response': missing or null" in dataset.stats.examples[1]


def test_a_list_of_files_keeps_each_rows_file_and_row(tmp_path, tokenizer):
    first = write_jsonl(tmp_path / "a.jsonl", ROWS[:2])
    second = write_jsonl(tmp_path / "b.jsonl", ROWS[2:])
    dataset = SFTDataset([first, second], tokenizer, cache_dir=tmp_path / "hf-cache")
    assert [(s.index, s.source, s.row) for s in dataset] == [
        (0, str(first), 0),
        (1, str(first), 1),
        (2, str(second), 0),
    ]


def full_lengths(tokenizer):
    return [
        len(
            tokenize_conversation(
                tokenizer,
                [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["response"]}],
            ).input_ids
        )
        for r in ROWS
    ]


def test_overlong_drop_counts_the_dropped_rows(tmp_path, tokenizer):
    lengths = full_lengths(tokenizer)
    limit = sorted(lengths)[1]
    dataset = SFTDataset(ROWS, tokenizer, max_length=limit, overlong="drop", cache_dir=tmp_path / "hf-cache")
    assert [sample.index for sample in dataset] == [i for i, n in enumerate(lengths) if n <= limit]
    assert dataset.stats.skipped == {"too_long": sum(n > limit for n in lengths)}
    assert dataset.stats.truncated == 0
    assert (
        dataset.stats.examples[0] == f"<in-memory>, row 2: {lengths[2]} tokens, more than max_length {limit}"
    )


def test_overlong_truncate_keeps_the_first_tokens(tmp_path, tokenizer):
    full = SFTDataset(ROWS, tokenizer, cache_dir=tmp_path / "hf-cache")
    # Long enough for every row to keep one trained token, shorter than at least two rows.
    limit = max(int(sample.loss_mask.nonzero()[0]) for sample in full) + 1
    assert sum(n > limit for n in full.lengths) >= 2
    cut = SFTDataset(ROWS, tokenizer, max_length=limit, overlong="truncate", cache_dir=tmp_path / "hf-cache")
    assert len(cut) == 3
    assert cut.stats.truncated == sum(n > limit for n in full.lengths)
    assert cut.lengths == [min(n, limit) for n in full.lengths]
    for long, short in zip(full, cut):
        assert short.input_ids.tolist() == long.input_ids[:limit].tolist()
        assert short.loss_mask.tolist() == long.loss_mask[:limit].tolist()


def test_overlong_truncate_drops_rows_with_no_trained_token_left(tmp_path, tokenizer):
    rows = [{"prompt": "a long prompt " * 10, "response": "ok"}, ROWS[1]]
    dataset = SFTDataset(rows, tokenizer, max_length=20, overlong="truncate", cache_dir=tmp_path / "hf-cache")
    assert [sample.index for sample in dataset] == [1]
    assert dataset.stats.skipped == {"too_long": 1}


def test_overlong_error_names_the_row(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "train.jsonl", ROWS)
    with pytest.raises(
        DataError, match=r"train\.jsonl, row 0: sequence has \d+ tokens, more than max_length 5"
    ):
        SFTDataset(path, tokenizer, max_length=5, overlong="error", cache_dir=tmp_path / "hf-cache")


def test_overlong_error_is_raised_even_when_bad_rows_are_skipped(tmp_path, tokenizer):
    with pytest.raises(DataError, match="more than max_length"):
        SFTDataset(
            ROWS, tokenizer, max_length=5, overlong="error", on_bad_row="skip", cache_dir=tmp_path / "c"
        )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"overlong": "cut"}, r"overlong: 'cut' is not one of \('drop', 'truncate', 'error'\)"),
        ({"on_bad_row": "ignore"}, r"on_bad_row: 'ignore' is not one of \('error', 'skip'\)"),
        ({"max_length": 0}, "max_length: expected an integer >= 1, got 0"),
        (
            {"messages_key": "messages", "apply_chat_template": False},
            "messages_key: whole conversations need",
        ),
        ({"input_template": "no braces"}, "must contain"),
        ({"apply_chat_template": False, "system_prompt": "s"}, "system_prompt: needs the chat template"),
    ],
)
def test_bad_arguments_are_rejected_before_reading_rows(tmp_path, tokenizer, kwargs, match):
    with pytest.raises(ValueError, match=match):
        SFTDataset(ROWS, tokenizer, cache_dir=tmp_path / "hf-cache", **kwargs)


def test_missing_column_is_reported_with_the_available_keys(tmp_path, tokenizer):
    with pytest.raises(
        DataError, match=r"key 'answer': missing; the rows have the keys \['prompt', 'response'\]"
    ):
        SFTDataset(ROWS, tokenizer, output_key="answer", cache_dir=tmp_path / "hf-cache")


def test_indexing_is_bounds_checked_and_returns_independent_tensors(tmp_path, tokenizer):
    dataset = SFTDataset(ROWS, tokenizer, cache_dir=tmp_path / "hf-cache")
    assert dataset[-1].index == 2
    with pytest.raises(IndexError, match="SFTDataset index 3 is out of range for 3 samples"):
        dataset[3]
    sample = dataset[0]
    before = sample.input_ids.clone()
    sample.input_ids.zero_()
    assert torch.equal(dataset[0].input_ids, before)
