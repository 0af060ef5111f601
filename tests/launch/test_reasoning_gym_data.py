"""`--data.prompt_data reasoning_gym:<task>` and `--reward.function reasoning_gym` as rl-launch ppo
resolves them, on a stand-in for the reasoning-gym package (fast; no Ray). The run itself:
tests/launch/test_reasoning_gym_run.py (slow, needs the package)."""

from __future__ import annotations

import json

import pytest

from rl_launch.components import REWARDS
from rl_launch.preflight import PreflightError, resolve_inputs
from tests.launch.test_data_eval import load, prepare
from tests.rollout.fake_reasoning_gym import install


def test_a_task_is_a_training_and_eval_source_whose_labels_its_reward_scores(monkeypatch, tiny_checkpoint):
    install(monkeypatch)
    train, evaluation = load(
        tiny_checkpoint,
        data__prompt_data="reasoning_gym:add?size=6&seed=1",
        data__eval_dataset="reasoning_gym:add?size=2&seed=100",
        data__apply_chat_template="false",
        reward__function="reasoning_gym",
    )
    assert len(train) == 6
    assert train.labels == {"reasoning_gym:add?size=6&seed=1": "add"}
    sample = train[4]
    assert sample.prompt == "What is 5 + 8?"
    assert json.loads(sample.label) == {"reasoning_gym": "add", "options": {"size": 6, "seed": 1}, "index": 4}
    assert [evaluation[i].prompt for i in range(len(evaluation))] == ["What is 100 + 0?", "What is 101 + 2?"]
    reward = REWARDS["reasoning_gym"]()
    assert list(reward(["<answer>13</answer>", "13"], ["p", "p"], [sample.label, sample.label]).rewards) == [
        1.0,
        1.0,
    ]


def test_a_task_reasoning_gym_lacks_or_bad_options_are_refused_before_the_run(monkeypatch, tiny_checkpoint):
    install(monkeypatch)
    with pytest.raises(
        PreflightError, match=r"^data\.prompt_data: 'nope' is not a reasoning-gym task; tasks: add"
    ):
        prepare(tiny_checkpoint, data__prompt_data="reasoning_gym:nope")
    with pytest.raises(PreflightError, match=r"^data\.eval_dataset: .*size=0; expected an integer >= 1"):
        prepare(
            tiny_checkpoint,
            data__prompt_data="reasoning_gym:add",
            data__eval_dataset="reasoning_gym:add?size=0",
        )
    config, _, _ = prepare(tiny_checkpoint, data__prompt_data="reasoning_gym:add?size=4")
    assert resolve_inputs(config, None).prompt_data == ("reasoning_gym:add?size=4",)
