"""Tests of rl_data.datasets.preference: pairs (DPO) and unpaired labels (KTO)."""

from __future__ import annotations

import json

import pytest
import torch

from rl_data.datasets.preference import (
    PreferenceDataset,
    PreferencePair,
    UnpairedPreferenceDataset,
    UnpairedSample,
)
from rl_data.errors import DataError
from rl_data.templates import tokenize_conversation


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def conversation(tokenizer, prompt, response):
    messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
    return tokenize_conversation(tokenizer, messages)


PAIRS = [
    {"prompt": "What is 2 + 2?", "chosen": "The answer is 4.", "rejected": "The answer is 5.", "margin": 1.5},
    {"prompt": "Say hi.", "chosen": "Hello!", "rejected": "No.", "margin": 2},
]

UNPAIRED = [
    {"prompt": "What is 2 + 2?", "completion": "The answer is 4.", "label": True},
    {"prompt": "What is 2 + 2?", "completion": "The answer is 5.", "label": False},
    {"prompt": "Say hi.", "completion": "Hello!", "label": 1},
    {"prompt": "Say hi.", "completion": "Go away.", "label": 0},
]


def test_pairs_from_a_jsonl_file_match_tokenize_conversation(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    dataset = PreferenceDataset(path, tokenizer, margin_key="margin", cache_dir=tmp_path / "hf-cache")
    assert len(dataset) == 2
    for position, row in enumerate(PAIRS):
        pair = dataset[position]
        assert isinstance(pair, PreferencePair)
        chosen, rejected = (
            conversation(tokenizer, row["prompt"], row["chosen"]),
            conversation(tokenizer, row["prompt"], row["rejected"]),
        )
        assert pair.chosen_ids.tolist() == chosen.input_ids
        assert pair.chosen_mask.tolist() == chosen.loss_mask
        assert pair.rejected_ids.tolist() == rejected.input_ids
        assert pair.rejected_mask.tolist() == rejected.loss_mask
        assert pair.chosen_ids.dtype == torch.int64
        assert pair.chosen_mask.dtype == torch.bool
        assert pair.margin == float(row["margin"])
        assert (pair.index, pair.source, pair.row) == (position, str(path), position)
    assert (
        tokenizer.decode(dataset[0].chosen_ids[dataset[0].chosen_mask].tolist())
        == "The answer is 4.<|im_end|>"
    )


def test_pairs_from_dicts_without_margin_key_have_zero_margin(tmp_path, tokenizer):
    dataset = PreferenceDataset(PAIRS, tokenizer, cache_dir=tmp_path / "hf-cache")
    assert [pair.margin for pair in dataset] == [0.0, 0.0]
    assert [pair.source for pair in dataset] == ["<in-memory>"] * 2


def test_whole_conversations_without_prompt_key_train_only_the_last_assistant_turn(tmp_path, tokenizer):
    history = [
        {"role": "user", "content": "1 + 1?"},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "2 + 2?"},
    ]
    row = {
        "chosen": [*history, {"role": "assistant", "content": "4"}],
        "rejected": [*history, {"role": "assistant", "content": "5"}],
    }
    pair = PreferenceDataset([row], tokenizer, prompt_key=None, cache_dir=tmp_path / "hf-cache")[0]
    expected = tokenize_conversation(tokenizer, row["chosen"])
    assert pair.chosen_ids.tolist() == expected.input_ids
    first, last = expected.assistant_spans[1]
    assert pair.chosen_mask.nonzero().flatten().tolist() == list(range(first, last))
    assert tokenizer.decode(pair.rejected_ids[pair.rejected_mask].tolist()) == "5<|im_end|>"


def test_response_message_lists_are_appended_to_the_prompt(tmp_path, tokenizer):
    row = {
        "prompt": "2 + 2?",
        "chosen": [{"role": "assistant", "content": "4"}],
        "rejected": [{"role": "assistant", "content": "22"}],
    }
    pair = PreferenceDataset([row], tokenizer, cache_dir=tmp_path / "hf-cache")[0]
    expected = conversation(tokenizer, "2 + 2?", "22")
    assert pair.rejected_ids.tolist() == expected.input_ids
    assert pair.rejected_mask.tolist() == expected.loss_mask


def test_plain_text_pairs_mask_the_response_and_eos(tmp_path, tokenizer):
    pair = PreferenceDataset(
        PAIRS[:1], tokenizer, input_template="Q: {}\nA:", cache_dir=tmp_path / "hf-cache"
    )[0]
    prompt_ids = tokenizer("Q: What is 2 + 2?\nA:", add_special_tokens=False)["input_ids"]
    chosen_ids = tokenizer("The answer is 4.<|im_end|>", add_special_tokens=False)["input_ids"]
    assert pair.chosen_ids.tolist() == prompt_ids + chosen_ids
    assert pair.chosen_mask.tolist() == [False] * len(prompt_ids) + [True] * len(chosen_ids)


def test_missing_rejected_names_the_file_row_and_key(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "pairs.jsonl", [PAIRS[0], {"prompt": "p", "chosen": "c"}])
    with pytest.raises(DataError, match=r"pairs\.jsonl, row 1, key 'rejected': missing or null"):
        PreferenceDataset(path, tokenizer, cache_dir=tmp_path / "hf-cache")


@pytest.mark.parametrize(
    ("row", "match"),
    [
        (
            {"prompt": 7, "chosen": "c", "rejected": "r", "margin": 1.0},
            r"key 'prompt': expected a string or a non-empty",
        ),
        ({"prompt": " ", "chosen": "c", "rejected": "r", "margin": 1.0}, r"key 'prompt': empty string"),
        (
            {"prompt": "p", "chosen": "c", "rejected": "r", "margin": "big"},
            r"key 'margin': expected a number, got str",
        ),
        (
            {"prompt": "p", "chosen": "c", "rejected": "r", "margin": True},
            r"key 'margin': expected a number, got bool",
        ),
        (
            {"prompt": "p", "chosen": "c", "rejected": "r", "margin": float("nan")},
            r"key 'margin': expected a finite",
        ),
        ({"prompt": "p", "chosen": "c", "rejected": "r", "margin": None}, r"key 'margin': missing or null"),
    ],
)
def test_bad_pair_values_raise_data_error_with_their_location(tmp_path, tokenizer, row, match):
    with pytest.raises(DataError, match=r"<in-memory>, row 0, " + match):
        PreferenceDataset([row], tokenizer, margin_key="margin", cache_dir=tmp_path / "hf-cache")


def test_a_response_string_without_prompt_key_is_a_bad_row(tmp_path, tokenizer):
    with pytest.raises(
        DataError, match=r"key 'chosen': without a prompt key the value must be a whole conversation"
    ):
        PreferenceDataset(PAIRS, tokenizer, prompt_key=None, cache_dir=tmp_path / "hf-cache")


def test_skipped_pairs_are_counted_and_the_rest_kept(tmp_path, tokenizer):
    rows = [
        PAIRS[0],
        {"prompt": "p", "chosen": "c", "rejected": "r", "margin": None},
        {"prompt": "", "chosen": "c", "rejected": "r", "margin": 1.0},
        PAIRS[1],
    ]
    path = write_jsonl(tmp_path / "pairs.jsonl", rows)
    dataset = PreferenceDataset(
        path, tokenizer, margin_key="margin", on_bad_row="skip", cache_dir=tmp_path / "c"
    )
    assert [pair.row for pair in dataset] == [0, 3]
    assert [pair.margin for pair in dataset] == [1.5, 2.0]
    assert dataset.stats.skipped == {"bad_row": 2}
    assert dataset.stats.kept == 2


def test_a_pair_follows_overlong_when_either_side_is_too_long(tmp_path, tokenizer):
    short = conversation(tokenizer, "p", "ok")
    rows = [
        {"prompt": "p", "chosen": "ok", "rejected": "a much longer rejected answer " * 5},
        {"prompt": "p", "chosen": "a much longer chosen answer " * 5, "rejected": "ok"},
        {"prompt": "p", "chosen": "ok", "rejected": "no"},
    ]
    limit = len(short.input_ids) + 2
    dropped = PreferenceDataset(rows, tokenizer, max_length=limit, cache_dir=tmp_path / "c")
    assert [pair.index for pair in dropped] == [2]
    assert dropped.stats.skipped == {"too_long": 2}

    cut = PreferenceDataset(rows, tokenizer, max_length=limit, overlong="truncate", cache_dir=tmp_path / "c")
    assert len(cut) == 3
    assert cut.stats.truncated == 2
    assert cut[0].chosen_ids.tolist() == short.input_ids
    long_rejected = conversation(tokenizer, "p", rows[0]["rejected"])
    assert cut[0].rejected_ids.tolist() == long_rejected.input_ids[:limit]
    assert cut[0].rejected_mask.tolist() == long_rejected.loss_mask[:limit]

    with pytest.raises(DataError, match=r"row 0: rejected has \d+ tokens, more than max_length"):
        PreferenceDataset(rows, tokenizer, max_length=limit, overlong="error", cache_dir=tmp_path / "c")


def test_truncation_that_leaves_a_side_without_response_tokens_drops_the_pair(tmp_path, tokenizer):
    rows = [{"prompt": "a long prompt " * 10, "chosen": "ok", "rejected": "no"}]
    dataset = PreferenceDataset(rows, tokenizer, max_length=10, overlong="truncate", cache_dir=tmp_path / "c")
    assert len(dataset) == 0
    assert dataset.stats.skipped == {"too_long": 1}


def test_preference_arguments_are_checked(tmp_path, tokenizer):
    with pytest.raises(ValueError, match="overlong: 'clip' is not one of"):
        PreferenceDataset(PAIRS, tokenizer, overlong="clip", cache_dir=tmp_path / "c")
    with pytest.raises(ValueError, match="prompt_key: plain-text mode"):
        PreferenceDataset(
            PAIRS, tokenizer, prompt_key=None, apply_chat_template=False, cache_dir=tmp_path / "c"
        )
    with pytest.raises(DataError, match=r"key 'score': missing; the rows have the keys"):
        PreferenceDataset(PAIRS, tokenizer, margin_key="score", cache_dir=tmp_path / "c")


# --- UnpairedPreferenceDataset ---------------------------------------------------------------


def test_unpaired_rows_match_tokenize_conversation_and_keep_their_label(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "kto.jsonl", UNPAIRED[:2])
    dataset = UnpairedPreferenceDataset(path, tokenizer, cache_dir=tmp_path / "hf-cache")
    assert [sample.desirable for sample in dataset] == [True, False]
    assert dataset.desirable == [True, False]
    for position, row in enumerate(UNPAIRED[:2]):
        sample = dataset[position]
        assert isinstance(sample, UnpairedSample)
        expected = conversation(tokenizer, row["prompt"], row["completion"])
        assert sample.input_ids.tolist() == expected.input_ids
        assert sample.loss_mask.tolist() == expected.loss_mask
        assert (sample.index, sample.source, sample.row) == (position, str(path), position)


def test_integer_labels_zero_and_one_are_accepted(tmp_path, tokenizer):
    dataset = UnpairedPreferenceDataset(UNPAIRED[2:], tokenizer, cache_dir=tmp_path / "hf-cache")
    assert dataset.desirable == [True, False]


@pytest.mark.parametrize(
    ("label", "match"),
    [
        ("yes", r"key 'label': expected a bool \(or 0/1\), got str 'yes'"),
        (2, r"key 'label': expected a bool \(or 0/1\), got int 2"),
        (1.0, r"key 'label': expected a bool \(or 0/1\), got float 1.0"),
        (None, r"key 'label': missing or null"),
    ],
)
def test_a_label_that_is_not_a_bool_is_a_bad_row(tmp_path, tokenizer, label, match):
    rows = [{"prompt": "p", "completion": "c", "label": label}]
    with pytest.raises(DataError, match=r"<in-memory>, row 0, " + match):
        UnpairedPreferenceDataset(rows, tokenizer, cache_dir=tmp_path / "hf-cache")


def test_unpaired_bad_rows_are_skipped_and_counted(tmp_path, tokenizer):
    rows = [
        {"prompt": "p", "completion": "good", "label": "yes"},
        {"prompt": "p", "completion": "good", "label": "true"},
        {"prompt": "p", "completion": "", "label": "x"},
    ]
    dataset = UnpairedPreferenceDataset(rows, tokenizer, on_bad_row="skip", cache_dir=tmp_path / "hf-cache")
    assert len(dataset) == 0
    assert dataset.stats.skipped == {"bad_row": 3}


def test_unpaired_overlong_rows_follow_the_policy(tmp_path, tokenizer):
    rows = [
        {"prompt": "p", "completion": "ok", "label": True},
        {"prompt": "p", "completion": "a much longer completion " * 5, "label": False},
    ]
    limit = len(conversation(tokenizer, "p", "ok").input_ids)
    dropped = UnpairedPreferenceDataset(rows, tokenizer, max_length=limit, cache_dir=tmp_path / "c")
    assert [sample.index for sample in dropped] == [0]
    assert dropped.stats.skipped == {"too_long": 1}
    cut = UnpairedPreferenceDataset(
        rows, tokenizer, max_length=limit, overlong="truncate", cache_dir=tmp_path / "c"
    )
    assert cut.lengths == [limit, limit]
    assert cut.stats.truncated == 1
    with pytest.raises(DataError, match=r"row 1: sequence has \d+ tokens, more than max_length"):
        UnpairedPreferenceDataset(
            rows, tokenizer, max_length=limit, overlong="error", cache_dir=tmp_path / "c"
        )
