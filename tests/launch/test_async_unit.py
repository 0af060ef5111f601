"""Async mode without Ray: the staleness bound, the options' checks, the completion rows."""

from __future__ import annotations

import pytest
import torch

from rl_data import Trajectory
from rl_launch.config import ConfigError, PPOConfig
from rl_launch.options import load_config
from rl_launch.rollouts import completion_rows, drop_stale


def _record(version: int, group: int) -> Trajectory:
    return Trajectory(
        prompt_ids=torch.tensor([1, 2]),
        response_ids=torch.tensor([3]),
        policy_version=version,
        group_id=group,
        reward=0.5,
        extra={"sample_index": group, "source": "train.jsonl", "row": 7},
    )


def test_records_further_behind_than_max_staleness_are_dropped_and_counted():
    records = [_record(3, 0), _record(3, 0), _record(1, 1), _record(1, 1)]
    kept, metrics = drop_stale(records, version=4, max_staleness=2)
    assert kept == records[:2]
    assert metrics == {"async/staleness_max": 3.0, "async/dropped_stale": 2.0}
    kept, metrics = drop_stale(records, version=4, max_staleness=None)
    assert kept == records
    assert metrics["async/dropped_stale"] == 0.0


def test_a_step_whose_records_are_all_too_stale_stops_with_a_diagnosis():
    with pytest.raises(RuntimeError, match=r"rollout.max_staleness = 1: every record .* 3-3 versions behind"):
        drop_stale([_record(1, 0)], version=4, max_staleness=1)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"rollout.async_depth": "2"}, "rollout.async_depth: 2 needs rollout.async_train true"),
        ({"rollout.max_staleness": "1"}, "rollout.max_staleness: 1 needs rollout.async_train true"),
        (
            {"rollout.async_train": "true", "rollout.async_depth": "3", "rollout.max_staleness": "2"},
            r"rollout.max_staleness: 2 must be >= rollout.async_depth \(3\)",
        ),
        ({"rollout.async_train": "true", "rollout.async_depth": "0"}, "rollout.async_depth"),
        ({"rollout.weight_sync_timeout_s": "0"}, "rollout.weight_sync_timeout_s"),
    ],
)
def test_async_options_are_checked_by_name(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(PPOConfig, overrides={"preset": "arithmetic", **overrides})


def test_async_depth_and_staleness_bound_are_accepted_together():
    config = load_config(
        PPOConfig,
        overrides={
            "preset": "arithmetic",
            "rollout.async_train": "true",
            "rollout.async_depth": "2",
            "rollout.max_staleness": "2",
        },
    )
    assert (config.rollout.async_depth, config.rollout.max_staleness) == (2, 2)


def test_completion_rows_say_what_was_asked_answered_and_where_it_came_from(tokenizer):
    record = Trajectory(
        prompt_ids=torch.tensor(tokenizer.encode("What is 2 + 3?")),
        response_ids=torch.tensor(tokenizer.encode("5")),
        reward=1.0,
        group_id=12,
        policy_version=3,
        finish_reason="stop",
        extra={"sample_index": 40, "source": "train.jsonl", "row": 41},
    )
    (row,) = completion_rows([record], tokenizer)
    assert row == {
        "prompt": tokenizer.decode(record.prompt_ids.tolist()),
        "response": tokenizer.decode(record.response_ids.tolist()),
        "reward": 1.0,
        "finish_reason": "stop",
        "source": "train.jsonl",
        "row": 41,
        "index": 40,
        "group_id": 12,
        "policy_version": 3,
    }
    assert "2 + 3" in row["prompt"].replace("  ", " ")
