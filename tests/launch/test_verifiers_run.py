"""End to end through the real CLI, Ray, a transformers engine and DeepSpeed: `rl-launch ppo
--data.prompt_data verifiers:<file> --rollout.executor verifiers` on a multi-turn verifiers 0.4
environment written to a file (a `vf.Taskset` and its own `vf.Env`), one step on CPU.

The env asks for a number, answers a wrong one with a hint (the next turn: environment tokens)
and ends when a reply names its target or the seat's max_turns (2) refuses a third turn; its rubric
is two weighted async rewards (solved, and brief at weight 0.5), and its `finalize` logs each
episode's target, replies and rewards as a JSON line. From outside the run: every episode was
played by the policy's own generations and scored by the rubric (recomputed here from the replies
it logged), the run's rewards are those, the rubric's scores are metrics, and the loss counted the
action tokens only. The test environment holds `rl-launch[verifiers]`: without it this fails.
The pieces without Ray: tests/launch/test_verifiers_data.py, tests/rollout/test_verifiers.py."""

from __future__ import annotations

import inspect
import json
import re

import pytest

from tests.launch.launching import launch, read_metrics

pytestmark = pytest.mark.slow


def hint(target, reply):
    """The env's answer to a reply: None when its first number is the target."""
    numbers = re.findall(r"-?[0-9]+", reply)
    if not numbers:
        return "No number."
    return None if int(numbers[0]) == target else ("Higher." if int(numbers[0]) < target else "Lower.")


ENV_FILE = """
import json
import re

import verifiers.v1 as vf

LOG = {log!r}


{hint}


class GuessData(vf.TaskData):
    target: int


class GuessTask(vf.Task[GuessData]):
    @vf.reward
    async def solved(self, trace) -> float:
        return float(hint(self.data.target, trace.last_reply) is None)

    @vf.reward(weight=0.5)
    async def brief(self, trace) -> float:
        return float(len(trace.last_reply) <= 4)


class GuessTaskset(vf.Taskset[GuessTask, vf.TasksetConfig]):
    def load(self):
        for target in range(8):
            yield GuessTask(GuessData(prompt="Guess my number between 0 and 9.", target=target), self.config.task)


class GuessConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig(max_turns=2)


class GuessEnv(vf.Env[GuessConfig]):
    async def run(self, task, agents):
        async with agents.player.interaction(task) as interaction:
            segment = await interaction.turn()
            while not segment.terminated and (answer := hint(task.data.target, segment.last_reply)):
                segment = await interaction.turn(answer)

    async def finalize(self, task, episode):
        [trace] = episode.traces
        trace.record_metric("finalized", 1.0)
        replies = [message.content.strip() for message in trace.assistant_messages]
        rewards = {{name: reward.score for name, reward in trace.rewards.items()}}
        with open(LOG, "a") as handle:
            handle.write(json.dumps({{"target": task.data.target, "replies": replies, "rewards": rewards}}) + "\\n")


__all__ = ["GuessEnv", "GuessTaskset"]
"""


def test_a_multi_turn_verifiers_env_from_a_file_trains_on_its_rubric_with_its_tokens_masked(
    tiny_checkpoint, joined_ray, tmp_path
):
    ray_args, env = joined_ray
    log = tmp_path / "episodes.jsonl"
    env_file = tmp_path / "guess_env.py"
    env_file.write_text(ENV_FILE.format(log=str(log), hint=inspect.getsource(hint)))
    run_dir = tmp_path / "run"
    rollout_batch, samples = 2, 2
    args = [
        "--preset", "none",
        "--model.pretrain", str(tiny_checkpoint),
        "--data.prompt_data", f"verifiers:{env_file}",
        "--data.prompt_max_len", "64",
        "--rollout.executor", "verifiers",
        "--rollout.executor_options.max_turns", "3",
        "--rollout.executor_options.episode_timeout_s", "300",
        "--algo.advantage.estimator", "grpo",
        "--rollout.n_samples_per_prompt", str(samples),
        "--rollout.rollout_batch_size", str(rollout_batch),
        "--rollout.generate_max_len", "6",
        "--train.max_steps", "1",
        "--ckpt.save_hf_model", "false",
        "--log.output_dir", str(run_dir),
        "--log.progress_bar", "false",
        *ray_args,
        "--rollout.engine", "hf",
    ]  # fmt: skip
    result = launch(args, env)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "data: 8 training prompts" in result.stdout + result.stderr
    [line] = read_metrics(run_dir)

    episodes = [json.loads(row) for row in log.read_text().splitlines()]
    assert len(episodes) == rollout_batch * samples  # every episode finalized once
    totals = []
    for episode in episodes:  # the episode and its rubric, recomputed from the replies the policy wrote
        replies, target = episode["replies"], episode["target"]
        answers = [hint(target, reply) for reply in replies]
        assert len(replies) == (1 if answers[0] is None else 2)  # solved, or the seat's max_turns (2)
        solved, brief = float(answers[-1] is None), float(len(replies[-1]) <= 4)
        assert episode["rewards"] == {"solved": solved, "brief": brief}
        totals.append(solved + 0.5 * brief)
    assert line["reward/mean"] == pytest.approx(sum(totals) / len(totals))  # the run trained on them
    assert line["rollout/episode_failures"] == 0.0
    assert line["rollout/agent/finalized"] == 1.0
    assert line["rollout/agent/brief"] == pytest.approx(
        sum(episode["rewards"]["brief"] for episode in episodes) / len(episodes)
    )
    assert line["rollout/action_tokens_mean"] == pytest.approx(
        line["response_length/mean"] - line["rollout/env_tokens_mean"]
    )
    assert line["policy/tokens"] == pytest.approx(line["rollout/action_tokens_mean"] * len(episodes))
