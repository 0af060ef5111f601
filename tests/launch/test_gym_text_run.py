"""End to end through the real CLI, Ray, a transformers engine and DeepSpeed: `rl-launch ppo
--rollout.executor gym_text` on a Gymnasium-style text environment written to a file (duck-typed
reset/step/close, no gymnasium).

The environment takes two actions: the first gets FEEDBACK back, the second ends the episode; each
step's reward is the parity of the action's length, so it varies with what the model wrote. It
logs its running total through `info` and, on `close()`, one JSON line of its seed, actions and
rewards. From outside the run: the steps are logged, the rewards the environment gave are the
run's rewards (recomputed from the actions it saw), its `info` numbers are metrics, every episode
closed its environment, and the learner's loss counted exactly the action tokens (the feedback
tokens in every response are left out of `policy/tokens`, the loss's Σ action_mask)."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from tests.launch.launching import launch, read_metrics

pytestmark = pytest.mark.slow

FEEDBACK = "\nAgain, once more.\n"

ENV_FILE = f"""
import json


def rule(action):
    return float(len(action) % 2)


class TwoTurnParity:
    def __init__(self, log):
        self.log = log
        self.seed, self.actions, self.rewards = None, [], []

    def reset(self, *, seed=None, options=None):
        self.seed = seed
        return f"Say something about {{seed}}.", {{}}

    def step(self, action):
        self.actions.append(action)
        self.rewards.append(rule(action))
        info = {{"episode_total": sum(self.rewards), "turn": len(self.actions), "note": "text is dropped"}}
        done = len(self.actions) == 2
        return ("" if done else {FEEDBACK!r}), self.rewards[-1], done, False, info

    def close(self):
        with open(self.log, "a") as handle:
            handle.write(json.dumps({{"seed": self.seed, "actions": self.actions, "rewards": self.rewards}}) + "\\n")
"""


def test_a_gymnasium_style_text_env_from_a_file_trains_on_its_rewards_with_its_tokens_masked(
    tiny_checkpoint, joined_ray, tmp_path
):
    ray_args, env = joined_ray
    prompts = tmp_path / "seeds.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": "-", "label": seed}) + "\n" for seed in range(8)))
    env_file = tmp_path / "parity_env.py"
    env_file.write_text(ENV_FILE)
    closed = tmp_path / "closed.jsonl"
    run_dir = tmp_path / "run"
    rollout_batch, samples, steps = 4, 2, 2
    args = [
        "--preset", "none",
        "--model.pretrain", str(tiny_checkpoint),
        "--data.prompt_data", str(prompts),
        "--data.prompt_max_len", "64",
        "--rollout.executor", "gym_text",
        "--rollout.executor_options.env", f"{env_file}:TwoTurnParity",
        "--rollout.executor_options.env_kwargs.log", str(closed),
        "--rollout.executor_options.max_turns", "3",
        "--rollout.executor_options.episode_timeout_s", "300",
        "--algo.advantage.estimator", "grpo",
        "--rollout.n_samples_per_prompt", str(samples),
        "--rollout.rollout_batch_size", str(rollout_batch),
        "--rollout.generate_max_len", "6",
        "--train.max_steps", str(steps),
        "--ckpt.save_hf_model", "false",
        "--log.output_dir", str(run_dir),
        "--log.progress_bar", "false",
        *ray_args,
        "--rollout.engine", "hf",  # transformers generation: starts in a second, vLLM in ~25 s
    ]  # fmt: skip
    result = launch(args, env)
    assert result.returncode == 0, result.stderr[-4000:]
    metrics = read_metrics(run_dir)
    assert [line["step"] for line in metrics] == [1, 2]

    episodes = [json.loads(line) for line in closed.read_text().splitlines()]
    records = rollout_batch * samples
    assert len(episodes) == steps * records  # every episode's environment was closed once
    assert {episode["seed"] for episode in episodes} <= set(range(8))  # the labels are the seeds
    for episode in episodes:  # the actions it saw were the decoded generations, scored by its rule
        assert len(episode["actions"]) == 2
        assert episode["rewards"] == [float(len(action) % 2) for action in episode["actions"]]
    totals = [sum(episode["rewards"]) for episode in episodes]
    assert len(set(totals)) > 1  # the reward depends on the action: it varies
    feedback_tokens = len(
        AutoTokenizer.from_pretrained(tiny_checkpoint)(FEEDBACK, add_special_tokens=False)["input_ids"]
    )
    for line in metrics:
        assert line["rollout/turns_mean"] == 2.0
        assert line["rollout/episode_failures"] == 0.0
        # the episode reward is the sum of the step rewards; the env's own total, logged through info,
        # is the same number, and info's numbers (not its text) are metrics
        assert line["reward/mean"] == pytest.approx(line["rollout/agent/episode_total"])
        assert line["rollout/agent/turn"] == 2.0
        assert not any(key.endswith("/note") for key in line)
        assert line["rollout/env_tokens_mean"] == feedback_tokens
        # response = action₀ + feedback + action₁; only the actions are in the loss
        assert line["rollout/action_tokens_mean"] == pytest.approx(
            line["response_length/mean"] - feedback_tokens
        )
        assert line["policy/tokens"] == pytest.approx(line["rollout/action_tokens_mean"] * records)
        assert line["policy/tokens"] < line["response_length/mean"] * records
    # the rewards the environment gave are the run's: the mean over both steps' episodes
    assert sum(totals) / len(totals) == pytest.approx(sum(line["reward/mean"] for line in metrics) / steps)
