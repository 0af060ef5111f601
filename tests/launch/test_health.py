"""Health that acts: a run whose updates are all skipped stops with a diagnosis; a log-prob drift
between engines and learner warns, and stops past its bound."""

from __future__ import annotations

import json

import pytest

from rl_launch.cli import resolve_ppo_config
from rl_launch.health import HealthError, HealthMonitor
from tests.launch.launching import launch, read_metrics

BASE = {"model.pretrain": "m", "data.prompt_data": "d"}


def monitor(**health: str) -> HealthMonitor:
    return HealthMonitor(resolve_ppo_config(None, {**BASE, **{f"health.{k}": v for k, v in health.items()}}))


def test_consecutive_skipped_steps_stop_the_run_with_a_diagnosis():
    health = monitor(max_skipped_steps="2")
    assert health.check(1, {"policy/skipped": 1.0}) == []
    assert health.check(2, {"policy/skipped": 0.5}) == []  # one of two updates went through: progress
    assert health.check(3, {"policy/skipped": 1.0}) == []
    with pytest.raises(
        HealthError, match=r"every policy update of steps 3-4 was skipped.*train\.actor_learning_rate"
    ):
        health.check(4, {"policy/skipped": 1.0, "policy/grad_norm": float("nan"), "reward/mean": 0.5})


def test_skipped_steps_never_stop_a_run_that_turned_it_off():
    health = monitor(max_skipped_steps="none")
    for step in range(1, 20):
        assert health.check(step, {"policy/skipped": 1.0}) == []


def test_a_logprob_drift_warns_once_per_ten_steps_and_stops_past_its_bound():
    health = monitor(logprob_mismatch_warn="0.1", logprob_mismatch_stop="1.0")
    assert health.check(1, {"health/logprob_mismatch_mean": 0.01}) == []
    (warning,) = health.check(2, {"health/logprob_mismatch_mean": 0.3})
    assert "step 2" in warning
    assert "0.3 nats per token" in warning
    assert health.check(3, {"health/logprob_mismatch_mean": 0.3}) == []  # not again right away
    assert len(health.check(12, {"health/logprob_mismatch_mean": 0.3})) == 1
    with pytest.raises(HealthError, match=r"step 13: .* differ by 2 nats per token"):
        health.check(13, {"health/logprob_mismatch_mean": 2.0})


NAN_LOSS = """
import torch

from rl_algos import POLICY_LOSSES


@POLICY_LOSSES.register("nan_loss")
def nan_loss(logprobs, old_logprobs, advantages, action_mask):
    loss = logprobs * float("nan")
    return loss * action_mask, {}
"""


@pytest.mark.slow
def test_a_run_whose_updates_are_all_non_finite_stops_after_the_bound(tiny_checkpoint, joined_ray, tmp_path):
    ray_args, env = joined_ray
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": f"What is {i} + 1?", "label": str(i + 1)}) + "\n" for i in range(8))
    )
    plugin = tmp_path / "nan_loss.py"
    plugin.write_text(NAN_LOSS)
    run_dir = tmp_path / "run"
    args = [
        "--model.pretrain", str(tiny_checkpoint),
        "--data.prompt_data", str(prompts),
        "--reward.function", "numeric",
        "--plugin", str(plugin),
        "--algo.advantage.estimator", "grpo",
        "--algo.policy.loss", "nan_loss",
        "--rollout.n_samples_per_prompt", "2",
        "--rollout.rollout_batch_size", "4",
        "--rollout.generate_max_len", "4",
        "--train.max_steps", "6",
        "--health.max_skipped_steps", "2",
        "--log.output_dir", str(run_dir),
        "--log.progress_bar", "false",
        *ray_args,
        "--rollout.engine", "hf",  # transformers generation: starts in a second, vLLM in ~25 s
    ]  # fmt: skip
    result = launch(args, env)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "rl-launch ppo: stopped: every policy update of steps 1-2 was skipped" in result.stderr
    assert [line["step"] for line in read_metrics(run_dir)] == [1, 2]  # the steps it ran are logged


def test_steps_that_train_mostly_on_fallbacks_stop_the_run_naming_the_source():
    health = monitor(max_fallback_fraction="0.5", max_fallback_steps="2")
    config = health.config
    dead = {"reward/fallback_fraction": 0.75, "reward/fallbacks/function": 3.0, "reward/timeouts": 3.0}
    assert health.check(1, dead) == []
    assert health.check(2, {"reward/fallback_fraction": 0.25}) == []  # the source came back: no streak
    assert health.check(3, dead) == []
    with pytest.raises(HealthError) as stopped:
        health.check(4, {**dead, "reward/fallbacks/episode": 1.0})
    message = str(stopped.value)
    assert "steps 3-4 trained mostly on fallback rewards (75% of step 4's samples" in message
    assert f"reward.function ({config.reward.function or 'the preset'}): 3 samples" in message
    assert "failed episodes (rollout.executor" in message
    assert "reward/timeouts = 3" in message


def test_fallbacks_never_stop_a_run_that_turned_it_off():
    health = monitor(max_fallback_fraction="none")
    for step in range(1, 10):
        assert health.check(step, {"reward/fallback_fraction": 1.0}) == []


def test_a_run_whose_reward_server_is_dead_stops_instead_of_training_on_constants(monkeypatch):
    """Through the real step loop: every record of every step is a fallback of remote_0 (a dead
    reward server under reward.on_error fallback); the run stops at step 3 naming the server."""
    from rl_data import Trajectory, decode, encode
    from tests.launch.fakes import fake_run, use_fake_ray
    from tests.launch.test_step_loop import config

    use_fake_ray(monkeypatch)
    url = "http://127.0.0.1:9/reward"
    run = fake_run(config(**{"train.max_steps": 5, "reward.remote_url": url, "reward.on_error": "fallback"}))
    engine = run.engines[0]
    generate = engine.generate

    def dead_server(*args, **kwargs):
        records = decode(generate(*args, **kwargs), list[Trajectory])
        for record in records:
            record.extra["reward_fallback_sources"] = ["remote_0"]
        return encode(records)

    monkeypatch.setattr(engine, "generate", dead_server)
    with pytest.raises(
        HealthError, match=rf"steps 1-3 trained mostly on fallback rewards.*reward.remote_url {url}"
    ):
        run.fit()
    assert run.tracker.steps() == [1, 2, 3]
    assert [metrics["reward/fallback_fraction"] for _, metrics in run.tracker.logged] == [1.0, 1.0, 1.0]
