"""End to end through the real CLI, Ray, a transformers engine and DeepSpeed: a multi-turn run from an agent
file written the OpenRLHF way, given with OpenRLHF's own flag (`--train.agent_func_path`).

The agent answers the first action with a fixed feedback text and scores the second (1 if it holds
a digit). From outside the run: it completes its steps with ReMax's greedy baseline taken from
greedy episodes, metrics.jsonl carries the multi-turn counters, and the learner's loss counted
exactly the action tokens: every response holds the feedback tokens, which the policy's token
count (`policy/tokens`, the loss's Σ action_mask) leaves out."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from tests.launch.agent_files import FEEDBACK, TWO_TURN_AGENT
from tests.launch.launching import launch, read_metrics

pytestmark = pytest.mark.slow


def test_a_two_turn_agent_trains_with_environment_tokens_masked_out_of_the_loss(
    tiny_checkpoint, joined_ray, tmp_path
):
    ray_args, env = joined_ray
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": f"Think about {a}.", "label": str(a)}) + "\n" for a in range(8))
    )
    agent = tmp_path / "agent_func.py"
    agent.write_text(TWO_TURN_AGENT)
    run_dir = tmp_path / "run"
    rollout_batch, samples = 2, 2
    args = [
        "--preset", "none",
        "--model.pretrain", str(tiny_checkpoint),
        "--data.prompt_data", str(prompts),
        "--data.prompt_max_len", "64",
        "--train.agent_func_path", str(agent),  # OpenRLHF's flag: --rollout.agent_func_path
        "--rollout.executor_options.max_turns", "3",
        "--rollout.executor_options.episode_timeout_s", "300",
        "--algo.advantage.estimator", "remax",
        "--rollout.n_samples_per_prompt", str(samples),
        "--rollout.rollout_batch_size", str(rollout_batch),
        "--rollout.generate_max_len", "6",
        "--train.max_steps", "2",
        "--ckpt.save_hf_model", "false",
        "--log.output_dir", str(run_dir),
        "--log.progress_bar", "false",
        *ray_args,
        "--rollout.engine", "hf",  # transformers generation: starts in a second, vLLM in ~25 s
    ]  # fmt: skip
    result = launch(args, env)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "--train.agent_func_path" in result.stdout + result.stderr  # the alias note
    metrics = read_metrics(run_dir)
    assert [line["step"] for line in metrics] == [1, 2]
    feedback_tokens = len(
        AutoTokenizer.from_pretrained(tiny_checkpoint)(FEEDBACK, add_special_tokens=False)["input_ids"]
    )
    records = rollout_batch * samples
    for line in metrics:
        assert line["rollout/turns_mean"] == 2.0  # the agent is done after its second step
        assert line["rollout/episode_failures"] == 0.0
        assert 0 <= line["rollout/truncated"] <= records  # episodes whose last action was cut
        assert line["rollout/agent/second_turn"] == 1.0  # the agent's extra_logs
        assert line["rollout/env_tokens_mean"] == feedback_tokens
        # response = action₀ + feedback + action₁; only the actions are in the loss
        assert line["rollout/action_tokens_mean"] == pytest.approx(
            line["response_length/mean"] - feedback_tokens
        )
        assert line["policy/tokens"] == pytest.approx(line["rollout/action_tokens_mean"] * records)
        assert line["policy/tokens"] < line["response_length/mean"] * records
        assert 0.0 <= line["reward/mean"] <= 1.0
        assert 0.0 <= line["reward/greedy_baseline_mean"] <= 1.0  # from one greedy episode per prompt
        assert line["health/sync_checksum_match"] == 1.0


STUCK_AGENT = '''
import asyncio
import itertools
import time

from openrlhf.utils.agent import AgentInstanceBase

COUNTER = itertools.count()


class AgentInstance(AgentInstanceBase):
    """The first instance of each import blocks in a sync step, the second in an async one (no await);
    the others answer at once: done, reward 1."""

    def __init__(self, *args, **kwargs):
        self.number = next(COUNTER)

    async def reset(self, states, **kwargs):
        return {"observation": states["observation"]}

    def step(self, states, **kwargs):
        if self.number == 0:
            time.sleep(600)  # a sync step that blocks
        return self._step(states)

    async def _step(self, states):
        if self.number == 1:
            time.sleep(600)  # an async step that blocks its loop
        return {"rewards": 1.0, "environment_feedback": "", "done": True}
'''


def test_a_blocking_environment_step_times_out_and_the_run_goes_on(tiny_checkpoint, joined_ray, tmp_path):
    ray_args, env = joined_ray
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Say {a}.", "label": str(a)}) + "\n" for a in range(8)))
    agent = tmp_path / "stuck_agent.py"
    agent.write_text(STUCK_AGENT)
    run_dir = tmp_path / "run"
    args = [
        "--preset", "none",
        "--model.pretrain", str(tiny_checkpoint),
        "--data.prompt_data", str(prompts),
        "--data.prompt_max_len", "64",
        "--rollout.agent_func_path", str(agent),
        "--rollout.executor_options.episode_timeout_s", "2",
        "--rollout.executor_options.on_error", "fallback",
        "--algo.advantage.estimator", "grpo",
        "--rollout.n_samples_per_prompt", "2",
        "--rollout.rollout_batch_size", "2",
        "--rollout.generate_max_len", "4",
        "--train.max_steps", "2",
        "--ckpt.save_hf_model", "false",
        "--log.output_dir", str(run_dir),
        "--log.progress_bar", "false",
        *ray_args,
        "--rollout.engine", "hf",
    ]  # fmt: skip
    result = launch(args, env)
    assert result.returncode == 0, result.stderr[-4000:]
    metrics = read_metrics(run_dir)
    assert [line["step"] for line in metrics] == [1, 2]  # the run went on past the stuck steps
    first = metrics[0]
    assert first["rollout/episode_failures"] == 2.0  # the sync and the async step, abandoned at 2 s
    assert first["rollout/episode_timeouts"] == 2.0
    assert first["reward/fallbacks/episode"] == 2.0
    assert first["reward/fallback_fraction"] == 0.5
    log = (run_dir / "logs" / "engine-0.log").read_text()
    assert "timed out after 2.0 s; abandoned, the environment was at" in log
    assert "stuck_agent.py" in log
