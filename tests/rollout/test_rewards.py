"""Reward functions: OpenRLHF function files, per-sample adapters, validation, rule rewards."""

from __future__ import annotations

import importlib.util
import logging
import math
import pathlib

import pytest
import torch

from rl_rollout.rewards import (
    BatchedReward,
    ExactMatchReward,
    FormatReward,
    NumericAnswerReward,
    PerSampleReward,
    RewardError,
    RewardFunction,
    RewardOutput,
    WeightedSumReward,
    extract_numeric_answer,
    load_reward_function,
    normalize_answer,
    response_text,
)

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
PROMPTS = ["Q: 2+2? A:", "Q: capital of France? A:", "Q: 7*6? A:"]
RESPONSES = [" 4", " Paris, of course", " 41"]
LABELS = ["4", "Paris", "42"]
QUERIES = [p + r for p, r in zip(PROMPTS, RESPONSES, strict=True)]


def test_openrlhf_reward_file_gives_rewards_scores_and_extra_logs():
    reward_fn = load_reward_function(FIXTURES / "reward_func_openrlhf.py")
    assert isinstance(reward_fn, RewardFunction)
    output = reward_fn(QUERIES, PROMPTS, LABELS)
    assert output.rewards == [1.5, 1.5, -0.5]
    assert output.scores == [1.0, 1.0, 0.0]
    assert output.extra_logs == {"hits": [1.0, 1.0, 0.0]}
    assert output.num_fallbacks == 0


def test_reward_file_returning_a_bare_tensor_uses_it_for_rewards_and_scores():
    output = load_reward_function(FIXTURES / "reward_func_bare.py")(QUERIES, PROMPTS, LABELS)
    assert output.rewards == [2.0, 17.0, 3.0]
    assert output.scores == output.rewards


def test_reward_file_errors_name_the_file_and_what_is_missing(tmp_path):
    with pytest.raises(AttributeError, match=r"reward_func_missing\.py.*no 'reward_func'.*\['score'\]"):
        load_reward_function(FIXTURES / "reward_func_missing.py")
    with pytest.raises(FileNotFoundError, match=r"nowhere\.py' does not exist"):
        load_reward_function(tmp_path / "nowhere.py")
    with pytest.raises(ValueError, match=r"expected a Python file"):
        load_reward_function(tmp_path / "reward.txt")
    broken = tmp_path / "broken.py"
    broken.write_text("import not_a_module_anywhere\n")
    with pytest.raises(ImportError, match=r"broken\.py' failed to import.*not_a_module_anywhere"):
        load_reward_function(broken)


@pytest.mark.skipif(importlib.util.find_spec("openrlhf") is not None, reason="openrlhf is installed here")
def test_reward_file_importing_openrlhf_helpers_names_the_package_and_what_to_do(tmp_path):
    # the import shape of OpenRLHF's math example: helpers from openrlhf.utils at the top
    graded = tmp_path / "graded_reward.py"
    graded.write_text(
        "from openrlhf.utils import extract_boxed_answer\n\n"
        "def reward_func(queries, prompts, labels, **kwargs):\n"
        "    return [float(extract_boxed_answer(q) == l) for q, l in zip(queries, labels)]\n"
    )
    with pytest.raises(ImportError) as error:
        load_reward_function(graded)
    message = str(error.value)
    assert "graded_reward.py' failed to import: it imports 'openrlhf', which is not installed" in message
    assert "pip install openrlhf" in message
    assert "--reward.function numeric" in message


@pytest.mark.parametrize(
    ("labels", "message"),
    [
        (["a", "nan", "b"], r"reward_func_bad\.py:reward_func: rewards\[1\] \(sample 1\) is nan"),
        (["text", "a", "b"], r"reward_func_bad\.py:reward_func: rewards\[0\] \(sample 0\) is 'oops'"),
        (["short", "a", "b"], r"reward_func_bad\.py:reward_func: 'rewards' has 2 values for a batch of 3"),
    ],
)
def test_bad_reward_values_raise_naming_the_file_and_sample(labels, message):
    reward_fn = load_reward_function(FIXTURES / "reward_func_bad.py")
    with pytest.raises(RewardError, match=message):
        reward_fn(QUERIES, PROMPTS, labels)


def test_fallback_replaces_only_the_bad_samples_and_counts_them(caplog):
    reward_fn = load_reward_function(FIXTURES / "reward_func_bad.py", on_error="fallback", fallback=-1.0)
    with caplog.at_level(logging.WARNING, logger="rl_rollout.rewards"):
        output = reward_fn(QUERIES, PROMPTS, ["nan", "a", "text"])
    assert output.rewards == [-1.0, 1.0, -1.0]
    assert output.scores == [-1.0, 1.0, -1.0]
    assert output.fallback_indices == [0, 2]
    assert "sample 0" in caplog.text
    assert "sample 2" in caplog.text
    whole = reward_fn(QUERIES, PROMPTS, ["short", "a", "b"])
    assert whole.rewards == [-1.0] * 3
    assert whole.fallback_indices == [0, 1, 2]
    metrics = reward_fn.metrics()
    assert metrics["reward/fallbacks"] == 5.0
    assert metrics["reward/samples"] == 6.0
    assert metrics["reward/fallback_rate"] == pytest.approx(5 / 6)


def test_batched_reward_that_raises_is_reported_with_its_name():
    def explode(queries, prompts, labels):
        raise KeyError("boom")

    with pytest.raises(RewardError, match=r"my_reward: raised KeyError\('boom'\) on a batch of 3 samples"):
        BatchedReward(explode, name="my_reward")(QUERIES, PROMPTS, LABELS)
    output = BatchedReward(explode, name="my_reward", on_error="fallback", fallback=0.5)(
        QUERIES, PROMPTS, LABELS
    )
    assert output.rewards == [0.5, 0.5, 0.5]


def test_per_sample_function_is_batched_and_fails_per_sample():
    def length_or_fail(query, prompt, label):
        if label == "boom":
            raise RuntimeError("bad label")
        return float(len(response_text(query, prompt)))

    reward_fn = PerSampleReward(length_or_fail)
    assert reward_fn(QUERIES, PROMPTS, LABELS).rewards == [2.0, 17.0, 3.0]
    with pytest.raises(RewardError, match=r"length_or_fail: raised RuntimeError\('bad label'\) on sample 1"):
        reward_fn(QUERIES, PROMPTS, ["4", "boom", "42"])
    tolerant = PerSampleReward(length_or_fail, on_error="fallback", fallback=0.0)
    output = tolerant(QUERIES, PROMPTS, ["4", "boom", "42"])
    assert output.rewards == [2.0, 0.0, 3.0]
    assert output.fallback_indices == [1]
    pairs = PerSampleReward(lambda q, p, label: (0.5, 1.0))(QUERIES, PROMPTS, LABELS)
    assert pairs.rewards == [0.5] * 3
    assert pairs.scores == [1.0] * 3
    with pytest.raises(RewardError, match=r"sample 0 got inf"):
        PerSampleReward(lambda q, p, label: math.inf, name="inf")(QUERIES, PROMPTS, LABELS)


def test_inputs_of_different_lengths_are_rejected():
    with pytest.raises(ValueError, match=r"differ in length: \{'queries': 3, 'prompts': 2, 'labels': 3\}"):
        ExactMatchReward()(QUERIES, PROMPTS[:2], LABELS)


def test_on_error_and_fallback_are_checked():
    with pytest.raises(
        ValueError, match=r"on_error: 'ignore' is not allowed; expected one of \('raise', 'fallback'\)"
    ):
        BatchedReward(len, on_error="ignore")
    with pytest.raises(ValueError, match=r"fallback: nan is not allowed"):
        BatchedReward(len, fallback=float("nan"))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so the answer is \\boxed{42}.", 42.0),
        ("first \\boxed{1} then \\boxed{\\frac{3}{4}}", 0.75),
        ("Natalia sold 48/2 = 24 clips.\n#### 72", 72.0),
        ("It costs $1,234.50 in total", 1234.5),
        ("numbers 3 and -7", -7.0),
        ("x = 1e3", 1000.0),
        ("no digits here", None),
        ("\\boxed{x+1} but 5 later", None),
        ("#### 72 clips", 72.0),
    ],
)
def test_numeric_answer_extraction(text, expected):
    assert extract_numeric_answer(text) == expected


def test_numeric_answer_reward_with_tolerance_and_gsm8k_labels():
    reward_fn = NumericAnswerReward(abs_tol=0.01)
    prompts = ["q"] * 5
    responses = ["q The answer is 72.", "q \\boxed{72.005}", "q #### 71", "q no idea", "q 1,000"]
    labels = ["She sold 48 + 24 = 72 clips.\n#### 72", 72, "72", 72.0, "1000"]
    assert reward_fn(responses, prompts, labels).rewards == [1.0, 1.0, 0.0, 0.0, 1.0]
    relative = NumericAnswerReward(abs_tol=0.0, rel_tol=0.01)
    assert relative(["q 990", "q 980"], ["q", "q"], [1000, 1000]).rewards == [1.0, 0.0]
    with pytest.raises(
        RewardError, match=r"numeric_answer: raised ValueError\(\"label 'n/a' holds no number\"\) on sample 0"
    ):
        reward_fn(["q 1"], ["q"], ["n/a"])


def test_exact_match_normalises_and_accepts_lists_of_answers():
    assert normalize_answer("  The Eiffel-Tower!! ") == "eiffeltower"
    reward_fn = ExactMatchReward()
    prompts = ["p:"] * 4
    assert reward_fn(
        ["p: Paris.", "p: paris", "p: Lyon", "p: the  PARIS"],
        prompts,
        ["Paris", "Paris", "Paris", ["x", "paris"]],
    ).rewards == [1.0, 1.0, 0.0, 1.0]
    pattern = ExactMatchReward(pattern=r"answer is (\w+)")
    assert pattern(
        ["p: I think the answer is Paris", "p: Paris"], ["p:", "p:"], ["paris", "paris"]
    ).rewards == [1.0, 0.0]
    strict = ExactMatchReward(normalize=False)
    assert strict(["p: Paris.", "p: Paris "], ["p:", "p:"], ["Paris", "Paris"]).rewards == [0.0, 1.0]


def test_format_reward_search_and_fullmatch():
    search = FormatReward(r"<think>.*</think>")
    full = FormatReward(r"<think>.*</think>\s*\\boxed\{.+\}", fullmatch=True, reward=0.5)
    responses = ["p<think>a\nb</think> \\boxed{3}", "p<think>a</think> then text", "p no tags"]
    prompts = ["p"] * 3
    assert search(responses, prompts, [None] * 3).rewards == [1.0, 1.0, 0.0]
    assert full(responses, prompts, [None] * 3).rewards == [0.5, 0.0, 0.0]


def test_weighted_sum_combines_components_and_takes_scores_from_one():
    accuracy = NumericAnswerReward()
    form = FormatReward(r"\\boxed\{")
    combined = WeightedSumReward({"accuracy": (accuracy, 1.0), "format": (form, 0.1)}, score_from="accuracy")
    queries = ["q \\boxed{4}", "q 4", "q \\boxed{5}"]
    output = combined(queries, ["q"] * 3, [4, 4, 4])
    assert output.rewards == pytest.approx([1.1, 1.0, 0.1])
    assert output.scores == [1.0, 1.0, 0.0]
    assert output.extra_logs == {"accuracy": [1.0, 1.0, 0.0], "format": [1.0, 0.0, 1.0]}
    summed = WeightedSumReward({"accuracy": (accuracy, 2.0), "format": (form, -1.0)})
    assert summed(queries, ["q"] * 3, [4, 4, 4]).scores == pytest.approx([1.0, 2.0, -1.0])
    with pytest.raises(ValueError, match=r"score_from: 'style' is not one of the components \['accuracy'\]"):
        WeightedSumReward({"accuracy": (accuracy, 1.0)}, score_from="style")


def test_reward_output_holds_plain_floats():
    output = RewardOutput(rewards=[1.0], scores=[0.0])
    assert output.num_fallbacks == 0
    tensor_logs = BatchedReward(
        lambda q, p, label: {"rewards": torch.ones(len(q)), "extra_logs": {"m": torch.tensor(2.0)}}
    )
    assert tensor_logs(["a"], [""], [None]).extra_logs == {"m": 2.0}
