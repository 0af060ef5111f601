"""Async mode without Ray: the staleness bound, the options' checks, the completion rows."""

from __future__ import annotations

import msgspec
import pytest
import torch

from rl_data import Trajectory
from rl_launch.config import ConfigError, PPOConfig
from rl_launch.options import load_config
from rl_launch.rollouts import completion_rows, drop_stale


def _config(overrides: dict[str, str]) -> PPOConfig:
    """The arithmetic preset's settings (validation only: nothing is prepared) with `overrides`."""
    return load_config(PPOConfig, overrides={"preset": "arithmetic", **overrides})


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
        _config(overrides)


def test_async_depth_and_staleness_bound_are_accepted_together():
    config = _config(
        {"rollout.async_train": "true", "rollout.async_depth": "2", "rollout.max_staleness": "2"}
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
        check_components(_config(overrides))


def test_openrlhf_partial_rollout_flag_is_our_option():
    from rl_launch.cli import main

    assert main(["ppo", "--preset", "arithmetic", "--train.async_enable", "--train.partial_rollout_enable",
                 "--print-config"]) == 0  # fmt: skip


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"rollout.streaming": "true"}, "rollout.streaming: True needs rollout.async_train true"),
        (
            {"rollout.async_train": "true", "rollout.streaming": "true", "rollout.max_staleness": "0"},
            "rollout.max_staleness: 0 must be >= 1 with rollout.streaming",
        ),
        (
            {"rollout.async_train": "true", "rollout.generate_batch_size": "64"},
            r"needs rollout.dynamic_filtering true or rollout.streaming true",
        ),
    ],
)
def test_streaming_options_are_checked_by_name(overrides, message):
    with pytest.raises(ConfigError, match=message):
        _config(overrides)


def test_streaming_accepts_oversampling_without_filtering_and_a_bound_below_the_depth():
    config = _config(
        {
            "rollout.async_train": "true",
            "rollout.async_depth": "2",
            "rollout.streaming": "true",
            "rollout.max_staleness": "1",
            "rollout.generate_batch_size": "64",
        }
    )
    assert (config.rollout.prompts_per_round, config.rollout.max_staleness) == (64, 1)
    from rl_launch.specs import engine_concurrency_groups

    # (depth 2 + 2) x 64 prompts per round over one engine: the pool and one round beyond it
    assert engine_concurrency_groups(config) == {"activity": 1, "generate": 256}
    big = msgspec.structs.replace(
        config, rollout=msgspec.structs.replace(config.rollout, generate_batch_size=1024)
    )
    assert engine_concurrency_groups(big)["generate"] == 512  # MAX_GENERATE_THREADS


def test_openrlhf_oversampling_flag_says_what_happens_to_the_surplus_in_each_mode():
    from rl_launch.aliases import aliases_of

    remark = aliases_of("ppo")["rollout.vllm_generate_batch_size"].remark
    assert "with --rollout.streaming true the surplus groups stay in flight" in remark
    assert "without streaming the surplus accepted groups are dropped" in remark


def test_engine_idle_time_counts_only_the_time_with_no_generate_call_in_flight():
    from rl_launch.actors import EngineActivity

    now = [0.0]
    activity = EngineActivity(clock=lambda: now[0])
    now[0] = 1.0
    activity.begin()  # idle 0 -> 1
    now[0] = 2.0
    activity.begin()  # two calls overlap: busy 1 -> 4
    now[0] = 3.0
    activity.end()
    now[0] = 4.0
    activity.end()
    now[0] = 6.0  # idle 4 -> 6
    assert activity.window() == (3.0, 6.0)
    activity.begin()
    now[0] = 8.0  # a window that ends while a call runs: busy throughout
    assert activity.window() == (0.0, 2.0)
    activity.end()
    now[0] = 9.0
    assert activity.window() == (1.0, 1.0)


def test_a_sync_waits_for_the_generations_running_and_holds_back_new_ones():
    import threading

    from rl_launch.actors import _SyncGate

    gate, order = _SyncGate(), []
    running, sync_waiting = threading.Event(), threading.Event()

    def generation(name: str, hold: threading.Event | None = None) -> None:
        with gate.generation():
            order.append(f"{name} starts")
            running.set()
            if hold is not None:
                hold.wait(5)
            order.append(f"{name} ends")

    def sync() -> None:
        sync_waiting.set()
        with gate.sync():
            order.append("sync")

    release = threading.Event()
    first = threading.Thread(target=generation, args=("first", release))
    first.start()
    running.wait(5)
    syncing = threading.Thread(target=sync)
    syncing.start()
    sync_waiting.wait(5)
    while not gate._waiting_syncs:  # the sync is queued behind the running generation
        threading.Event().wait(0.001)
    second = threading.Thread(target=generation, args=("second",))
    second.start()
    release.set()
    for thread in (first, syncing, second):
        thread.join(5)
    assert order == ["first starts", "first ends", "sync", "second starts", "second ends"]


def test_one_rule_accepts_a_group_in_every_mode_and_each_mode_has_its_class():
    from types import SimpleNamespace

    from rl_launch.rollouts import (
        AsyncRollouts,
        StreamingRollouts,
        SyncRollouts,
        group_verdict,
        make_rollouts,
        rollout_mode,
    )

    def rollout(**changes):
        settings = dict(
            async_train=True,
            max_staleness=1,
            dynamic_filtering=False,
            dynamic_filtering_reward_range=(0.0, 1.0),
        )
        return SimpleNamespace(**{**settings, **changes})

    fresh, behind = [_record(3, 0), _record(3, 0)], [_record(1, 0), _record(3, 0)]
    assert group_verdict(fresh, 4, rollout()) is None
    assert group_verdict(behind, 4, rollout()) == "stale"  # one record 3 versions behind: the whole group
    assert group_verdict(behind, 4, rollout(max_staleness=None)) is None
    assert group_verdict(behind, 4, rollout(async_train=False)) is None  # sync: no staleness rule
    # dynamic filtering: a group whose every sample has the same reward is outside (0, 1)
    same = [_record(4, 0), _record(4, 0)]
    for record in same:
        record.score = 1.0
    assert group_verdict(same, 4, rollout(dynamic_filtering=True)) == "filtered"
    assert (
        group_verdict(same, 4, rollout(dynamic_filtering=True, dynamic_filtering_reward_range=(0.0, 1.5)))
        is None
    )
    assert group_verdict(behind, 4, rollout(dynamic_filtering=True)) == "stale"  # stale is judged first

    classes = {}
    for overrides in (
        {},
        {"rollout.async_train": "true"},
        {"rollout.async_train": "true", "rollout.streaming": "true"},
    ):
        config = _config(overrides)
        rollouts = make_rollouts(config, engines=[object()], loader=[])
        classes[rollout_mode(config)] = type(rollouts)
        assert rollouts.in_flight() == []
    assert classes == {"sync": SyncRollouts, "async": AsyncRollouts, "streaming": StreamingRollouts}
