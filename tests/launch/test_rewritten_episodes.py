"""An episode trained as segments (a chat template that rewrote its history) is one episode for the
advantage: its segments are not extra members of its group, and its outcome reward counts once."""

from __future__ import annotations

import pytest
import torch

from rl_data import Trajectory, build_experience
from rl_launch.algorithm import score_batch
from rl_rollout.episodes import episode_ids, segment_extra
from tests.launch.configs import ppo_config

BASE = {
    "model.pretrain": "/models/never-loaded",
    "data.prompt_data": "/data/never-read.jsonl",
    "rollout.rollout_batch_size": "1",
    "rollout.n_samples_per_prompt": "2",
}


def config(estimator: str, **options: str):
    return ppo_config(BASE, **{"algo.advantage.estimator": estimator, **options})


def records() -> list[Trajectory]:
    """Group 0: episode 0 in three segments (2, 1 and 2 action tokens, reward 1), episode 1 in one
    record (reward 0)."""

    def record(length: int, reward: float, segment: dict | None) -> Trajectory:
        return Trajectory(
            prompt_ids=[1, 2],
            response_ids=list(range(3, 3 + length)),
            reward=reward,
            group_id=0,
            extra={} if segment is None else {"segment": segment},
        )

    return [
        record(2, 1.0, segment_extra(0, 0, 3)),
        record(1, 1.0, segment_extra(0, 1, 3)),
        record(2, 1.0, segment_extra(0, 2, 3)),
        record(3, 0.0, None),
    ]


def advantages(cfg, rows: list[Trajectory], joined: bool) -> list[list[float]]:
    batch = build_experience(rows)
    episodes = episode_ids(rows) if joined else None
    score_batch(
        cfg, batch, batch.rewards.clone(), kl_coef=0.0, episode_ids=episodes and torch.tensor(episodes)
    )
    view = batch.response_view(batch.advantages)
    return [view[i, : int(n)].tolist() for i, n in enumerate(batch.response_lengths)]


def test_episode_ids_key_segments_by_group_and_episode():
    assert episode_ids(records()) == [0, 0, 0, 1]
    plain = [Trajectory(prompt_ids=[1], response_ids=[2], group_id=0) for _ in range(2)]
    assert episode_ids(plain) is None


def test_grpo_counts_an_episode_once_however_many_segments_it_has():
    cfg = config("grpo")
    # two episodes, rewards 1 and 0: mean 0.5, unbiased std 0.707107 -> ±0.707107 on every token
    a = 0.5 / (0.5**0.5)
    rows = advantages(cfg, records(), joined=True)
    assert [len(row) for row in rows] == [2, 1, 2, 3]
    assert [v for row in rows for v in row] == pytest.approx([a] * 5 + [-a] * 3, abs=1e-5)
    # as four rows the segments would be three members of the group (mean 0.75)
    wrong = advantages(cfg, records(), joined=False)
    assert wrong[3][0] == pytest.approx(-1.5, abs=1e-5)


def test_a_discounted_return_runs_across_the_segments_of_an_episode():
    # REINFORCE++ without whitening, γ = 0.5: the outcome 1 sits once, on the episode's last action
    # token, and discounts back over its 5 action tokens across the three segments
    cfg = config(
        "reinforce", **{"algo.advantage.options.gamma": "0.5", "algo.advantage.options.whiten": "false"}
    )
    rows = advantages(cfg, records(), joined=True)
    assert rows == [[0.0625, 0.125], [0.25], [0.5, 1.0], [0.0, 0.0, 0.0]]
    # row by row, each segment would end with the whole reward
    assert advantages(cfg, records(), joined=False)[:3] == [[0.5, 1.0], [1.0], [0.5, 1.0]]


@pytest.mark.usefixtures("fake_ray_one_thread")
def test_the_trainer_scores_the_segments_of_an_episode_as_one_episode():
    # PPOTrainer.make_experience over toy actors: the records' segment marks reach score_batch
    from rl_launch.config import PPOConfig
    from rl_launch.options import load_config
    from tests.launch.fakes import fake_run

    settings = {
        "preset": "arithmetic",  # validation only: nothing is prepared
        "rollout.rollout_batch_size": "1",
        "rollout.n_samples_per_prompt": "2",
        "rollout.weight_sync": "broadcast",
        "algo.advantage.estimator": "grpo",
        "train.max_steps": "1",
        "log.progress_bar": "false",
    }
    run = fake_run(load_config(PPOConfig, overrides=settings))
    batch, _ = run.trainer.make_experience(records())
    view = batch.response_view(batch.advantages)
    firsts = view[:, 0].tolist()
    a = 0.5 / (0.5**0.5)
    assert firsts == pytest.approx([a, a, a, -a], abs=1e-5)
