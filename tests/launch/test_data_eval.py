"""Prompt data and evaluation of `rl-launch ppo` without Ray: datasets by path, folder split or
hub name (offline error), mixing by probability, input template and system prompt, dropped
prompts on the start-up line, and the pass@k / mean@k arithmetic."""

from __future__ import annotations

import collections
import json
import types

import pytest
import torch

from rl_data.datasets import PromptLoader
from rl_launch.cli import resolve_ppo_config
from rl_launch.config import ConfigError
from rl_launch.evaluation import eval_metrics, pass_at_k
from rl_launch.preflight import PreflightError, resolve_inputs
from rl_launch.prompts import describe_data, load_prompts, source_labels
from rl_rollout.episodes import segment_extra


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def questions(name, count, start=0):
    return [{"prompt": f"{name} question {i}", "label": str(i)} for i in range(start, start + count)]


def prepare(tiny_checkpoint, **overrides: str):
    """(config, resolved inputs, tokenizer) of a run on the tiny model with these dotted options."""
    from transformers import AutoTokenizer

    options = {
        "preset": "none",
        "model.pretrain": str(tiny_checkpoint),
        "rollout.rollout_batch_size": "4",
        "eval.eval_steps": "1",
        **{key.replace("__", "."): value for key, value in overrides.items()},
    }
    config = resolve_ppo_config(None, options)
    return config, resolve_inputs(config, None), AutoTokenizer.from_pretrained(tiny_checkpoint)


def load(tiny_checkpoint, **overrides: str):
    config, inputs, tokenizer = prepare(tiny_checkpoint, **overrides)
    return load_prompts(config, inputs, tokenizer)


def refused(pattern: str, **overrides: str) -> None:
    base = {"model.pretrain": "m", "data.prompt_data": "a.jsonl,b.jsonl"}
    with pytest.raises(ConfigError, match=pattern):
        resolve_ppo_config(None, {**base, **{key.replace("__", "."): v for key, v in overrides.items()}})


# ---------------------------------------------------------------------------- options


def test_prompt_probs_need_one_finite_probability_per_dataset_summing_to_one():
    refused(
        r"^data\.prompt_probs: \[1\.0\] must have one probability per data\.prompt_data dataset \(2 given\)",
        data__prompt_probs="1.0",
    )
    refused(r"^data\.prompt_probs: \[0\.7, 0\.2\] must sum to 1", data__prompt_probs="0.7,0.2")
    refused(r"^data\.prompt_probs: .* must be finite numbers >= 0", data__prompt_probs="1.5,-0.5")
    refused(r"^data\.prompt_data: .* names a\.jsonl more than once", data__prompt_data="a.jsonl, a.jsonl")
    refused(r"^data\.eval_dataset: .* without empty items", data__eval_dataset="a.jsonl,")
    config = resolve_ppo_config(
        None, {"model.pretrain": "m", "data.prompt_data": "a.jsonl,b.jsonl", "data.prompt_probs": "0.75,0.25"}
    )
    assert config.data.prompt_probs == [0.75, 0.25]


def test_input_template_needs_exactly_one_placeholder_and_excludes_a_system_prompt():
    refused(
        r"^data\.input_template: 'Question:' must contain \{\} exactly once, .*found 0",
        data__input_template="Question:",
    )
    refused(r"^data\.input_template: .*\(found 2\)", data__input_template="{} and {}")
    refused(
        r"^data\.system_prompt: .* needs the chat template, not data\.input_template",
        data__input_template="Q: {}",
        data__system_prompt="Be terse.",
    )
    refused(
        r"^data\.system_prompt: .* needs data\.apply_chat_template true",
        data__apply_chat_template="false",
        data__system_prompt="Be terse.",
    )
    refused(r"^eval\.correct_threshold: nan must be a finite number", eval__correct_threshold="nan")


# ---------------------------------------------------------------------------- sources


def test_a_load_dataset_folder_gives_the_chosen_split_and_names_its_rows(tiny_checkpoint, tmp_path):
    folder = tmp_path / "qa"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", questions("train", 6))
    write_jsonl(folder / "test.jsonl", questions("test", 3))
    train, evaluation = load(
        tiny_checkpoint,
        data__prompt_data=str(folder),
        data__eval_dataset=str(folder),
        eval__split="test",
        data__apply_chat_template="false",
    )
    assert [train[i].prompt for i in range(len(train))] == [f"train question {i}" for i in range(6)]
    assert [evaluation[i].prompt for i in range(len(evaluation))] == [f"test question {i}" for i in range(3)]
    assert {evaluation[i].source for i in range(3)} == {str(folder)}  # the dataset each prompt came from
    assert evaluation[2].row == 2
    with pytest.raises(
        PreflightError, match=r"^eval\.split: 'validation' is not a split of data\.eval_dataset"
    ):
        load(
            tiny_checkpoint,
            data__prompt_data=str(folder),
            data__eval_dataset=str(folder),
            eval__split="validation",
        )


def test_a_saved_dataset_dict_gives_the_chosen_split(tiny_checkpoint, tmp_path):
    import datasets

    splits = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list(questions("train", 4)),
            "dev": datasets.Dataset.from_list(questions("dev", 5)),
        }
    )
    splits.save_to_disk(str(tmp_path / "saved"))
    train, _ = load(
        tiny_checkpoint,
        data__prompt_data=str(tmp_path / "saved"),
        data__prompt_split="dev",
        data__apply_chat_template="false",
    )
    assert len(train) == 5
    assert train[4].prompt == "dev question 4"
    with pytest.raises(
        PreflightError, match=r"^data\.prompt_split: 'test' is not a split of .*\(splits: train, dev\)"
    ):
        load(tiny_checkpoint, data__prompt_data=str(tmp_path / "saved"), data__prompt_split="test")


def test_a_hub_name_missing_from_the_cache_offline_names_the_option_and_hf_hub_offline(
    tiny_checkpoint, monkeypatch
):
    import datasets

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # read at import; the test may run online
    with pytest.raises(PreflightError) as error:
        load(tiny_checkpoint, data__prompt_data="rl-launch-tests/no-such-dataset")
    message = str(error.value)
    assert message.startswith(
        "data.prompt_data: 'rl-launch-tests/no-such-dataset' is not a local file or folder"
    )
    assert "not in the Hugging Face datasets cache, and HF_HUB_OFFLINE is set" in message


def test_a_name_that_is_neither_a_path_nor_a_hub_id_is_refused_before_loading(tiny_checkpoint, tmp_path):
    with pytest.raises(PreflightError, match=r"^data\.eval_dataset: 'not a name!' is neither a local file"):
        prepare(tiny_checkpoint, data__prompt_data="org/name", data__eval_dataset="not a name!")
    write_jsonl(tmp_path / "a.jsonl", questions("a", 4))
    with pytest.raises(
        PreflightError, match=r"^data\.prompt_data: dataset file 'missing\.jsonl' does not exist"
    ):
        prepare(tiny_checkpoint, data__prompt_data=f"{tmp_path / 'a.jsonl'},missing.jsonl")


def test_source_labels_are_short_and_unique():
    assert source_labels(["/d/math.jsonl", "openai/gsm8k", "/e/math.parquet", "/f/my folder"]) == {
        "/d/math.jsonl": "math",
        "openai/gsm8k": "gsm8k",
        "/e/math.parquet": "math-2",
        "/f/my folder": "my_folder",
    }


# ---------------------------------------------------------------------------- mixing


def test_mixed_batches_follow_the_probabilities_and_use_every_prompt(tiny_checkpoint, tmp_path):
    first = write_jsonl(tmp_path / "first.jsonl", questions("first", 400))
    second = write_jsonl(tmp_path / "second.jsonl", questions("second", 400))
    train, _ = load(
        tiny_checkpoint,
        data__prompt_data=f"{first},{second}",
        data__prompt_probs="0.75,0.25",
        data__apply_chat_template="false",
    )
    loader = PromptLoader(train, batch_size=32, seed=3, shuffle=True)
    batches = [batch for _, batch in zip(range(100), loader)]
    counts = collections.Counter(sample.source for batch in batches for sample in batch)
    share = counts[str(first)] / sum(counts.values())
    # The mixture is fixed by train.seed, so this cannot fail by chance; its share is 0.75 within
    # about 0.011 (one standard deviation of a mixture of ~1600 draws), the loader only reorders it.
    assert abs(share - 0.75) < 0.05
    assert train.counts() == {"first": counts_in(train, str(first)), "second": counts_in(train, str(second))}
    # every prompt of both datasets is in the mixture; the one drawn more often repeats
    rows = collections.defaultdict(set)
    for index in range(len(train)):
        sample = train[index]
        assert sample.index == index
        rows[sample.source].add(sample.row)
    assert rows[str(first)] == rows[str(second)] == set(range(400))
    assert train.counts()["first"] > 400


def counts_in(prompts, source):
    return sum(prompts[i].source == source for i in range(len(prompts)))


def test_without_probabilities_datasets_are_concatenated_and_max_samples_cuts_the_list(
    tiny_checkpoint, tmp_path
):
    first = write_jsonl(tmp_path / "first.jsonl", questions("first", 5))
    second = write_jsonl(tmp_path / "second.jsonl", questions("second", 5))
    train, _ = load(
        tiny_checkpoint,
        data__prompt_data=f"{first},{second}",
        data__max_samples="7",
        data__apply_chat_template="false",
    )
    assert [train[i].prompt for i in range(len(train))] == [f"first question {i}" for i in range(5)] + [
        "second question 0",
        "second question 1",
    ]


# ---------------------------------------------------------------------------- rendering and drops


def test_input_template_fills_in_the_prompt(tiny_checkpoint, tmp_path):
    data = write_jsonl(tmp_path / "q.jsonl", questions("q", 4))
    train, _ = load(
        tiny_checkpoint, data__prompt_data=str(data), data__input_template="Question: {}\nAnswer:"
    )
    assert train[1].prompt == "Question: q question 1\nAnswer:"


def test_system_prompt_comes_first_in_the_chat_template(tiny_checkpoint, tmp_path):
    data = write_jsonl(tmp_path / "q.jsonl", questions("q", 4))
    train, _ = load(tiny_checkpoint, data__prompt_data=str(data), data__system_prompt="Be terse.")
    assert train[0].prompt == (
        "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nq question 0<|im_end|>\n<|im_start|>assistant\n"
    )


def test_dropped_prompts_are_counted_per_dataset_on_the_start_up_line(tiny_checkpoint, tmp_path):
    long_question = {"prompt": "word " * 300, "label": "0"}
    first = write_jsonl(
        tmp_path / "first.jsonl", [*questions("first", 6), long_question, {"prompt": "", "label": "1"}]
    )
    second = write_jsonl(tmp_path / "second.jsonl", [*questions("second", 6), long_question])
    options = dict(
        data__prompt_data=f"{first},{second}",
        data__prompt_max_len="64",
        data__eval_dataset=str(second),
        data__apply_chat_template="false",
    )
    with pytest.raises(
        PreflightError, match=r"empty string; or leave such rows out with --data\.skip_bad_rows true"
    ):
        load(tiny_checkpoint, **options)
    train, evaluation = load(tiny_checkpoint, **options, data__skip_bad_rows="true")
    assert describe_data(train, evaluation) == (
        "data: 12 training prompts (6 first + 6 second; dropped 3: first bad_prompt 1, first too_long 1, "
        "second too_long 1), 6 eval prompts (dropped 1: too_long 1)"
    )


# ---------------------------------------------------------------------------- pass@k and mean@k


def test_pass_at_k_is_the_unbiased_estimator():
    assert pass_at_k(4, 0, 4) == 0.0
    assert pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 − C(3,2)/C(5,2)
    assert pass_at_k(3, 3, 1) == 1.0
    with pytest.raises(ValueError, match=r"k = 5 must be in 1\.\.n = 4"):
        pass_at_k(4, 1, 5)


def record(group_id: int, reward: float, source: str, length: int = 2):
    return types.SimpleNamespace(
        group_id=group_id, reward=reward, response_ids=torch.zeros(length), extra={"source": source}
    )


def test_pass_and_mean_at_k_on_hand_made_records_overall_and_per_dataset():
    rewards = {
        0: ("/d/math.jsonl", [1.0, 0.0, 0.0, 0.0]),  # one correct of four
        1: ("/d/math.jsonl", [0.0, 0.5, 0.2, 0.0]),  # 0.5 is not above the threshold
        2: ("org/code", [1.0, 1.0, 0.9, 1.0]),
        3: ("org/code", [-1.0, 0.6, -1.0, -1.0]),
    }
    records = [
        record(group, reward, source) for group, (source, values) in rewards.items() for reward in values
    ]
    labels = source_labels(["/d/math.jsonl", "org/code"])
    metrics = eval_metrics(records, k=4, threshold=0.5, labels=labels)
    assert metrics["eval/pass@4"] == pytest.approx((1 + 0 + 1 + 1) / 4)
    assert metrics["eval/mean@4"] == pytest.approx((1 / 4 + 0 + 1 + 1 / 4) / 4)
    assert metrics["eval/reward/mean"] == pytest.approx(sum(r.reward for r in records) / 16)
    assert metrics["eval/response_length/mean"] == 2.0
    assert metrics["eval/math/pass@4"] == pytest.approx(0.5)
    assert metrics["eval/math/mean@4"] == pytest.approx(1 / 8)
    assert metrics["eval/code/pass@4"] == pytest.approx(1.0)
    assert metrics["eval/code/mean@4"] == pytest.approx(5 / 8)
    assert metrics["eval/code/reward/mean"] == pytest.approx((3.9 - 2.4) / 8)
    # a stricter threshold: the 0.9 and 0.6 answers no longer count, nor does prompt 3
    strict = eval_metrics(records, k=4, threshold=0.95, labels=labels)
    assert strict["eval/code/mean@4"] == pytest.approx(3 / 8)
    assert strict["eval/pass@4"] == pytest.approx(2 / 4)


def test_an_episode_trained_as_segments_is_one_response_of_its_prompt():
    # prompt 0: episode 0 in two segments (rl_rollout.episodes), then three one-record episodes
    first, last = record(0, 1.0, "d"), record(0, 1.0, "d")
    first.extra["segment"], last.extra["segment"] = segment_extra(0, 0, 2), segment_extra(0, 1, 2)
    records = [first, last, *(record(0, 0.0, "d") for _ in range(3))]
    metrics = eval_metrics(records, k=4, threshold=0.5)
    assert metrics["eval/mean@4"] == pytest.approx(1 / 4)  # not 2 of 5 responses
    assert metrics["eval/pass@4"] == 1.0


def test_one_sample_per_prompt_and_one_dataset_keep_the_plain_metrics():
    records = [record(group, float(group % 2), "/d/math.jsonl", length=group + 1) for group in range(4)]
    metrics = eval_metrics(records, k=1, threshold=0.5, labels={"/d/math.jsonl": "math"})
    assert metrics == {"eval/reward/mean": 0.5, "eval/response_length/mean": 2.5}
