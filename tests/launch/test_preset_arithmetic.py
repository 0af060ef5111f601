"""The arithmetic preset: task splits, demonstrations, reward golden values, settings, cached build, SFT."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from rl_launch.config import PPOConfig
from rl_launch.options import load_config
from rl_launch.presets import preset_settings
from rl_launch.presets.arithmetic import (
    MARKER,
    SETTINGS,
    arithmetic_reward,
    build_preset,
    demonstrations,
    make_problems,
    problem_split,
    score_response,
)
from rl_launch.warm_start import sft_warm_start

FAST_SFT_STEPS = 4


def _number(prompt: str) -> int:
    _, _, number, plus, one = prompt.rstrip("?").split(" ")
    assert (plus, one) == ("+", "1"), prompt
    return int(number)


# ---------------------------------------------------------------------------------------- task


def test_train_and_eval_problems_are_disjoint_and_labels_correct():
    train = make_problems(None, 0, split="train")
    evaluation = make_problems(None, 0, split="eval")
    train_prompts = {row["prompt"] for row in train}
    eval_prompts = {row["prompt"] for row in evaluation}
    assert train_prompts.isdisjoint(eval_prompts)
    # Every number 0..999 is in exactly one split; about a tenth of them are eval problems.
    assert len(train_prompts) + len(eval_prompts) == 1000
    assert len(train) == len(train_prompts)
    assert 60 < len(eval_prompts) < 160
    for row in train + evaluation:
        assert set(row) == {"prompt", "label"}
        assert row["label"] == str(_number(row["prompt"]) + 1)


def test_split_does_not_depend_on_seed():
    assert {r["prompt"] for r in make_problems(None, 0, split="eval")} == {
        r["prompt"] for r in make_problems(None, 7, split="eval")
    }
    assert problem_split(345) == problem_split(345)


def test_make_problems_is_deterministic_for_a_seed_and_varies_with_it():
    assert make_problems(50, 3) == make_problems(50, 3)
    assert make_problems(50, 3) != make_problems(50, 4)


def test_make_problems_repeats_only_after_a_full_pass():
    distinct = len(make_problems(None, 0, split="train"))
    rows = make_problems(distinct + 5, 0, split="train")
    assert len({r["prompt"] for r in rows[:distinct]}) == distinct
    assert len(rows) == distinct + 5


def test_make_problems_golden_labels():
    rows = make_problems(None, 0, split="train", max_number=3, eval_fraction=0.0001)
    assert sorted((r["prompt"], r["label"]) for r in rows) == [
        ("What is 0 + 1?", "1"),
        ("What is 1 + 1?", "2"),
        ("What is 2 + 1?", "3"),
        ("What is 3 + 1?", "4"),
    ]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"split": "test"}, "split: 'test'"),
        ({"max_number": 0}, "max_number: 0"),
        ({"eval_fraction": 1.5}, "eval_fraction: 1.5"),
        ({"count": -1}, "count: -1"),
    ],
)
def test_make_problems_rejects_bad_arguments(kwargs, match):
    options = {"count": 10, **kwargs}
    count = options.pop("count")
    with pytest.raises(ValueError, match=match):
        make_problems(count, 0, **options)


def test_demonstrations_give_the_right_answer_once_and_the_lazy_one_twice():
    problems = [{"prompt": "What is 41 + 1?", "label": "42"}, {"prompt": "What is 9 + 1?", "label": "10"}]
    assert demonstrations(problems) == [
        ("What is 41 + 1?", "42"),
        ("What is 41 + 1?", "41"),
        ("What is 41 + 1?", "41"),
        ("What is 9 + 1?", "10"),
        ("What is 9 + 1?", "9"),
        ("What is 9 + 1?", "9"),
    ]
    assert demonstrations(problems, lazy_answers=0) == [("What is 41 + 1?", "42"), ("What is 9 + 1?", "10")]


def test_demonstrations_reject_bad_arguments():
    with pytest.raises(ValueError, match="lazy_answers: -1"):
        demonstrations([], lazy_answers=-1)
    with pytest.raises(ValueError, match=r"problems\[0\]: label 'x' is not an integer"):
        demonstrations([{"prompt": "What is x + 1?", "label": "x"}])


# ------------------------------------------------------------------------------------ settings


def test_preset_settings_are_the_module_settings_and_a_valid_config():
    settings = preset_settings("arithmetic")
    assert settings == SETTINGS
    settings["train"]["max_steps"] = 1  # a copy: changing it leaves the preset alone
    assert SETTINGS["train"]["max_steps"] != 1
    config = load_config(PPOConfig, overrides={"preset": "arithmetic"}, base=preset_settings("arithmetic"))
    assert config.algo.advantage.estimator == "grpo"
    assert config.train.max_steps == SETTINGS["train"]["max_steps"] <= 25
    assert config.eval.eval_steps >= 1  # the demo shows its held-out accuracy during the run


def test_preset_settings_reject_an_unknown_preset():
    with pytest.raises(ValueError, match="preset: 'nope' is not one of arithmetic, colours, none"):
        preset_settings("nope")


# -------------------------------------------------------------------------------------- reward


@pytest.mark.parametrize(
    ("response", "label", "expected"),
    [
        ("7", "7", 1.0),
        ("7<|im_end|>", "7", 1.0),
        (" 7.", "7", 1.0),
        ("7 apples, or 8", "7", 1.0),
        ("-3", "-3", 1.0),
        ("3", "-3", 0.0),
        ("8", "7", 0.0),
        ("8 or 7", "7", 0.0),
        ("17", "7", 0.0),
        ("seven", "7", 0.0),
        ("", "7", 0.0),
    ],
)
def test_score_response_golden_values(response, label, expected):
    assert score_response(response, label) == expected


def test_arithmetic_reward_scores_the_response_after_the_prompt():
    prompt = "<|im_start|>user\nWhat is 2 + 5?<|im_end|>\n<|im_start|>assistant\n"
    queries = [prompt + "7<|im_end|>", prompt + "2", prompt + "no idea", prompt + "7 because 2 + 5 = 7"]
    assert arithmetic_reward(queries, [prompt] * 4, ["7"] * 4) == [1.0, 0.0, 0.0, 1.0]


def test_arithmetic_reward_errors_name_the_problem():
    with pytest.raises(ValueError, match="lengths 1, 1, 2 differ"):
        arithmetic_reward(["a"], ["a"], ["1", "2"])
    with pytest.raises(ValueError, match=r"labels\[1\]: label 'x' is not an integer"):
        arithmetic_reward(["1", "2"], ["", ""], ["1", "x"])


# --------------------------------------------------------------------------------------- build


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("presets")
    return root, build_preset(root, sft_steps=FAST_SFT_STEPS)


def test_build_writes_datasets_and_marker(built):
    root, artifacts = built
    assert Path(artifacts.path).parent == root
    marker = json.loads((Path(artifacts.path) / MARKER).read_text())
    assert marker["recipe_hash"] == artifacts.recipe_hash
    assert marker["recipe"]["sft_steps"] == FAST_SFT_STEPS
    assert artifacts.sft_metrics["steps"] == FAST_SFT_STEPS
    assert artifacts.apply_chat_template is True
    # Three demonstrations (one right, two lazy) per distinct train problem.
    assert artifacts.sft_metrics["examples"] == 3 * len(make_problems(None, 0, split="train"))
    for path, split in ((artifacts.train_path, "train"), (artifacts.eval_path, "eval")):
        rows = [json.loads(line) for line in Path(path).read_text().splitlines()]
        assert len(rows) == len(make_problems(None, 0, split=split))
        for row in rows:
            number = _number(row["prompt"])
            assert row["label"] == str(number + 1)
            assert problem_split(number) == split


def test_build_is_cached_and_a_changed_argument_rebuilds(built):
    root, artifacts = built
    model_file = Path(artifacts.model_path) / "model.safetensors"
    mtime = model_file.stat().st_mtime_ns
    again = build_preset(root, sft_steps=FAST_SFT_STEPS)
    assert again == artifacts
    assert model_file.stat().st_mtime_ns == mtime
    other = build_preset(root, sft_steps=FAST_SFT_STEPS + 1)
    assert other.path != artifacts.path
    assert other.sft_metrics["steps"] == FAST_SFT_STEPS + 1
    assert model_file.stat().st_mtime_ns == mtime


def test_interrupted_build_without_marker_is_rebuilt(built, tmp_path):
    first = build_preset(tmp_path, sft_steps=2)
    (Path(first.path) / MARKER).unlink()
    (Path(first.model_path) / "model.safetensors").write_bytes(b"truncated")
    rebuilt = build_preset(tmp_path, sft_steps=2)
    assert rebuilt.path == first.path
    assert (Path(rebuilt.path) / MARKER).is_file()
    assert (Path(rebuilt.model_path) / "model.safetensors").stat().st_size > 1000


def test_build_is_deterministic_for_a_seed(built, tmp_path):
    _, artifacts = built
    twin = build_preset(tmp_path, sft_steps=FAST_SFT_STEPS)
    assert twin.recipe_hash == artifacts.recipe_hash
    for name in ("model/model.safetensors", "model/tokenizer.json", "train.jsonl", "eval.jsonl"):
        assert (Path(twin.path) / name).read_bytes() == (Path(artifacts.path) / name).read_bytes(), name


def test_built_model_loads_and_tokenizer_round_trips_the_prompt(built):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rl_data import render_prompt

    _, artifacts = built
    tokenizer = AutoTokenizer.from_pretrained(artifacts.model_path)
    model = AutoModelForCausalLM.from_pretrained(artifacts.model_path)
    row = json.loads(Path(artifacts.eval_path).read_text().splitlines()[0])
    text = render_prompt(tokenizer, row["prompt"])
    assert text == f"<|im_start|>user\n{row['prompt']}<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    digits = [tokenizer.decode([i]) for i in tokenizer(row["label"], add_special_tokens=False)["input_ids"]]
    assert digits == list(row["label"])
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), len(tokenizer))


def test_build_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="sft_steps: 0"):
        build_preset(tmp_path, sft_steps=0)
    with pytest.raises(ValueError, match="seed: -1"):
        build_preset(tmp_path, seed=-1)
    with pytest.raises(ValueError, match="lazy_answers: -1"):
        build_preset(tmp_path, lazy_answers=-1)
    assert not os.listdir(tmp_path)


# ----------------------------------------------------------------------------------------- SFT


@pytest.fixture(scope="module")
def sft_tokenizer():
    from rl_data.tiny import build_tiny_tokenizer

    return build_tiny_tokenizer()


def _tiny_model(tokenizer):
    from rl_data.tiny import build_tiny_model

    return build_tiny_model(tokenizer, hidden_size=64, num_layers=1, intermediate_size=128, seed=0)


def test_sft_warm_start_lowers_the_loss_on_its_data(sft_tokenizer):
    tokenizer = sft_tokenizer
    model = _tiny_model(tokenizer)
    examples = [(f"Q{i}: ", f"{i % 3}{tokenizer.eos_token}") for i in range(8)]
    metrics = sft_warm_start(model, tokenizer, examples, steps=20, batch_size=8, lr=1e-2, seed=0)
    assert metrics["steps"] == 20
    assert metrics["final_loss"] < 0.5 * metrics["first_loss"]
    assert not model.training


def test_sft_warm_start_first_loss_is_the_full_forwards_response_nll(sft_tokenizer):
    # The loop sends only the positions that predict a response token through the LM head; its
    # first loss must be the token-mean NLL of the responses under the whole forward. Prompts of
    # different lengths (right-padded) and a response with an untrained middle segment.
    tokenizer = sft_tokenizer
    examples = [
        ("What is 7 + 1? ", f"8{tokenizer.eos_token}"),
        ("Q: ", [("12", True), (" tool says 3 ", False), ("4", True)]),
        ("A much longer prompt than the others: ", f"5{tokenizer.eos_token}"),
    ]
    model = _tiny_model(tokenizer)
    reference = _tiny_model(tokenizer)  # the same seed: the same weights before the step
    metrics = sft_warm_start(model, tokenizer, examples, steps=1, batch_size=3, lr=1e-3, seed=0)
    total, count = 0.0, 0
    for prompt, response in examples:
        segments = [(response, True)] if isinstance(response, str) else response
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        trained = [False] * len(ids)
        for text, keep in segments:
            piece = tokenizer(text, add_special_tokens=False)["input_ids"]
            ids, trained = ids + piece, trained + [keep] * len(piece)
        with torch.no_grad():
            logprobs = reference(input_ids=torch.tensor([ids])).logits[0].log_softmax(-1)
        for t in range(1, len(ids)):
            if trained[t]:
                total, count = total - float(logprobs[t - 1, ids[t]]), count + 1
    assert metrics["first_loss"] == pytest.approx(total / count, rel=1e-5)


def test_sft_warm_start_is_deterministic_and_leaves_global_rng_alone(sft_tokenizer):
    examples = [("What is 1 + 1? ", "2<|im_end|>"), ("What is 2 + 2? ", "4<|im_end|>")]
    torch.manual_seed(123)
    expected_draw = torch.rand(())
    weights = []
    for _ in range(2):
        model = _tiny_model(sft_tokenizer)
        torch.manual_seed(123)
        sft_warm_start(model, sft_tokenizer, examples, steps=3, batch_size=1, lr=1e-3, seed=5)
        assert torch.rand(()) == expected_draw
        weights.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert torch.equal(weights[0], weights[1])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"steps": 0}, "steps: 0"),
        ({"batch_size": 0}, "batch_size: 0"),
        ({"lr": -1.0}, "lr: -1.0"),
    ],
)
def test_sft_warm_start_rejects_bad_arguments(sft_tokenizer, kwargs, match):
    options = {"steps": 1, "batch_size": 1, "lr": 1e-3, **kwargs}
    with pytest.raises(ValueError, match=match):
        sft_warm_start(_tiny_model(sft_tokenizer), sft_tokenizer, [("a", "b")], **options)


def test_sft_warm_start_rejects_empty_response(sft_tokenizer):
    with pytest.raises(ValueError, match=r"examples\[1\]: the response '' has no tokens"):
        sft_warm_start(
            _tiny_model(sft_tokenizer), sft_tokenizer, [("a", "b"), ("c", "")], steps=1, batch_size=1, lr=1e-3
        )
