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
    assert metrics == {
        "async/staleness_max": 3.0,
        "async/dropped_stale": 2.0,
        "async/token_staleness_mean": 2.0,
        "async/token_staleness_max": 3.0,
        "async/mixed_version_records": 0.0,
    }
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
        "last_policy_version": 3,
    }
    assert "2 + 3" in row["prompt"].replace("  ", " ")


def test_token_staleness_counts_each_action_token_by_the_version_that_wrote_it():
    """Partial rollout: a sync at version 3 -> 4 landed after two tokens of the first record."""
    mixed = Trajectory(
        prompt_ids=[1], response_ids=[5, 6, 7, 8], policy_version=3, token_versions=[3, 3, 4, 4]
    )
    multi_turn = Trajectory(  # an environment token (mask 0) is no action: it is not counted
        prompt_ids=[1],
        response_ids=[5, 9, 6],
        action_mask=[1, 0, 1],
        policy_version=2,
        token_versions=[2, 2, 4],
    )
    kept, metrics = drop_stale([mixed, multi_turn, _record(4, 1)], version=5, max_staleness=2)
    assert [r.policy_version for r in kept] == [3, 4]  # the multi-turn record is 3 behind: dropped
    # action-token lags: [2, 2, 1, 1] + [3, 1] + [1] -> mean 11 / 7, max 3 (the record's first token)
    assert metrics["async/token_staleness_mean"] == pytest.approx(11 / 7)
    assert metrics["async/token_staleness_max"] == 3.0
    assert metrics["async/staleness_max"] == 3.0
    assert metrics["async/mixed_version_records"] == 2.0


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"rollout.partial_rollout": "true"}, "rollout.partial_rollout: True needs rollout.async_train true"),
        (
            {"rollout.async_train": "true", "rollout.partial_rollout": "true", "rollout.engine": "http",
             "rollout.engine_options": '{"base_url": "http://127.0.0.1:1"}'},
            r"rollout engine 'http' cannot take a weight sync while requests are in flight; engines that can: hf, vllm",
        ),
        (
            {"rollout.async_train": "true", "rollout.partial_rollout": "true",
             "rollout.engine_options": '{"in_process": false}'},
            "rollout.partial_rollout needs the engine core in the actor",
        ),
    ],
)  # fmt: skip
def test_partial_rollout_is_refused_without_async_mode_or_with_an_engine_that_cannot(overrides, message):
    from rl_launch.components import check_components

    with pytest.raises(ConfigError, match=message):
        check_components(load_config(PPOConfig, overrides={"preset": "arithmetic", **overrides}))


def test_openrlhf_partial_rollout_flag_is_our_option():
    from rl_launch.cli import main

    assert main(["ppo", "--preset", "arithmetic", "--train.async_enable", "--train.partial_rollout_enable",
                 "--print-config"]) == 0  # fmt: skip
