"""rl_rollout.reasoning_gym: a task named as a source becomes rows whose labels rebuild the item,
and the task's own score_answer is the reward (on a stand-in for the package: fast, no install)."""

from __future__ import annotations

import json

import pytest

from rl_rollout import ReasoningGymReward
from rl_rollout.reasoning_gym import parse_reasoning_gym_source, reasoning_gym_rows
from tests.rollout.fake_reasoning_gym import install


def test_source_options_parse_as_json_with_size_and_seed_defaults():
    assert parse_reasoning_gym_source("reasoning_gym:add") == ("add", {"size": 500, "seed": 0})
    assert parse_reasoning_gym_source("reasoning_gym:add?size=4&seed=3&offset=1&mode=hard&p=0.5") == (
        "add",
        {"size": 4, "seed": 3, "offset": 1, "mode": "hard", "p": 0.5},
    )
    for bad, says in [
        ("reasoning_gym:", "expected reasoning_gym:<task>"),
        ("reasoning_gym:a-b", "expected reasoning_gym:<task>"),
        ("reasoning_gym:add?size=0", "size=0; expected an integer >= 1"),
        ("reasoning_gym:add?seed=x", "seed='x'; expected an integer >= 0"),
        ("reasoning_gym:add?size", "bad query field"),
    ]:
        with pytest.raises(ValueError, match=says):
            parse_reasoning_gym_source(bad)


def test_rows_carry_the_question_and_a_label_that_rebuilds_the_item(monkeypatch):
    calls = install(monkeypatch)
    rows = reasoning_gym_rows("reasoning_gym:add?size=3&seed=10&offset=1", input_key="q", label_key="y")
    assert [row["q"] for row in rows] == ["What is 10 + 1?", "What is 11 + 3?", "What is 12 + 5?"]
    assert json.loads(rows[2]["y"]) == {
        "reasoning_gym": "add",
        "options": {"size": 3, "seed": 10, "offset": 1},
        "index": 2,
    }
    reward = ReasoningGymReward()
    responses = [
        "think... <answer>11</answer>",
        "<answer>0</answer> <answer>14</answer>",
        " 17 ",
        "<answer>9",
    ]
    labels = [rows[0]["y"], rows[1]["y"], rows[2]["y"], rows[0]["y"]]
    out = reward(responses, ["p"] * 4, labels)
    # the last <answer> tag; without a complete one the stripped response ("<answer>9" is no answer)
    assert list(out.rewards) == pytest.approx([1.0, 1.0, 1.0, 0.01])
    assert calls == [("add", {"size": 3, "seed": 10, "offset": 1})]  # built once, scored from the cache


def test_a_label_that_is_not_reasoning_gyms_follows_the_error_policy(monkeypatch):
    install(monkeypatch)
    with pytest.raises(Exception, match="is not a reasoning-gym label"):
        ReasoningGymReward()(["1"], ["p"], ["42"])
    out = ReasoningGymReward(on_error="fallback", fallback=-1.0)(["1"], ["p"], ['{"x": 1}'])
    assert list(out.rewards) == [-1.0]


def test_an_unknown_task_names_the_tasks(monkeypatch):
    install(monkeypatch)
    with pytest.raises(ValueError, match=r"reasoning_gym:nope .*not a task; tasks: add"):
        reasoning_gym_rows("reasoning_gym:nope?size=2")
