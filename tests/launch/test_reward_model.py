"""The reward model's scores have a deadline and an error policy (`rl_launch.reward_model`), on the
toys: a reward model whose forward never returns is abandoned past `reward.model_timeout_s`, and
`reward.on_error` stops the run or trains on `reward.fallback`, counted like any source's fallback."""

from __future__ import annotations

import pytest

from rl_launch.health import HealthError
from rl_launch.reward_model import RewardModelError
from tests.launch.fakes import HANG, fake_run
from tests.launch.test_engine_restart import config

pytestmark = pytest.mark.usefixtures("fake_ray_one_thread")


def rm_config(**overrides):
    return config(**{"model.reward_pretrain": "/models/rm", "reward.model_timeout_s": 30.0, **overrides})


def hang_scores_from(run, step: int) -> None:
    """The reward model's forward of step `step` and every later one never returns."""
    model = run.learners["reward_model"][0]
    original, calls = model.scores, []

    def scores(parts):
        calls.append(len(calls) + 1)
        return HANG if len(calls) >= step else original(parts)

    model.scores = scores


def test_a_reward_model_that_never_answers_stops_the_run_under_on_error_raise_naming_the_options():
    run = fake_run(rm_config())
    hang_scores_from(run, 2)
    with pytest.raises(RewardModelError) as stopped:
        run.fit()
    assert run.tracker.steps() == [1]
    assert isinstance(stopped.value, HealthError)  # `rl-launch: stopped: ...`, exit code 1
    message = str(stopped.value)
    assert message.startswith(
        "the reward model (/models/rm, ray.reward_model) did not score the step's samples within "
        "reward.model_timeout_s = 30 s (1 of its 1 ranks had not answered): reward.on_error raise stops the run"
    )
    assert "set reward.on_error fallback" in message


def test_under_on_error_fallback_a_hung_reward_model_scores_the_fallback_counted_until_the_ceiling_stops_it():
    run = fake_run(
        rm_config(
            **{
                "reward.on_error": "fallback",
                "reward.fallback": -1.0,
                "train.max_steps": 6,
                "health.max_fallback_steps": 2,
            }
        )
    )
    hang_scores_from(run, 2)
    with pytest.raises(
        HealthError, match=r"steps 2-3 trained mostly on fallback rewards.*the reward model \(/models/rm"
    ):
        run.fit()
    metrics = dict(run.tracker.logged)
    assert run.tracker.steps() == [1, 2, 3]
    assert metrics[1]["reward/model_mean"] == 0.5  # the toy reward model's score
    assert metrics[1]["reward/fallback_fraction"] == 0.0
    for step in (2, 3):
        assert metrics[step]["reward/model_mean"] == -1.0  # reward.fallback for every sample
        assert metrics[step]["reward/fallback_fraction"] == 1.0
        assert metrics[step]["reward/fallbacks/model"] == 4.0
        assert metrics[step]["reward/timeouts"] == 4.0


def test_a_reward_model_forward_that_raises_falls_back_without_counting_a_timeout():
    run = fake_run(rm_config(**{"reward.on_error": "fallback", "train.max_steps": 2}))
    model = run.learners["reward_model"][0]

    def scores(parts):
        raise RuntimeError("CUDA out of memory (a toy)")

    model.scores = scores
    tracker = run.fit()
    metrics = dict(tracker.logged)
    assert tracker.steps() == [1, 2]
    assert metrics[1]["reward/fallbacks/model"] == 4.0
    assert metrics[1]["reward/timeouts"] == 0.0


def test_under_on_error_raise_a_reward_model_forward_that_raises_stops_the_run_with_its_own_error():
    run = fake_run(rm_config())
    model = run.learners["reward_model"][0]

    def scores(parts):
        raise ValueError("a bad input (a toy)")

    model.scores = scores
    with pytest.raises(ValueError, match="a bad input"):
        run.fit()


def test_a_reward_model_actor_that_died_stops_the_run_even_under_on_error_fallback():
    from tests.launch.fakes import RayActorError

    run = fake_run(rm_config(**{"reward.on_error": "fallback"}))
    run.learners["reward_model"][0].dead = True  # a learner's death stops the run with its diagnosis
    with pytest.raises(RayActorError):
        run.fit()
