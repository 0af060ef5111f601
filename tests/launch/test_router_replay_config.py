"""`algo.policy.router_replay`: refused before anything starts unless the engine records routes
(its routes option on) and the executor carries them; reaches `PolicyLossConfig` verbatim."""

from __future__ import annotations

import pytest

from rl_launch.components.objective import policy_loss_config
from tests.launch.test_components import config, refused


def test_replay_on_an_engine_that_records_routes_reaches_the_learners_config():
    run = config(
        algo__policy__router_replay="R3",
        rollout__engine="hf",
        rollout__engine_options__return_routed_experts="true",
    )
    assert policy_loss_config(run, kl_coef=0.0).router_replay == "R3"
    assert policy_loss_config(config(), kl_coef=0.0).router_replay == "disabled"


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        (
            {"rollout__engine": "hf"},
            r"^algo\.policy\.router_replay: R3 .*set rollout\.engine_options\.return_routed_experts true",
        ),
        (
            {"rollout__engine": "vllm"},
            r"^algo\.policy\.router_replay: R3 .*set rollout\.engine_options\.enable_return_routed_experts true",
        ),
        (
            {"rollout__engine": "http", "rollout__engine_options__base_url": "http://127.0.0.1:1"},
            r"^algo\.policy\.router_replay: R3 .*engine 'http' does not report them; engines that can, with "
            r"their option: hf \(return_routed_experts\), vllm \(enable_return_routed_experts\)",
        ),
    ],
)
def test_replay_without_routes_from_the_engine_is_refused_with_the_fix(overrides, pattern):
    refused(pattern, algo__policy__router_replay="R3", **overrides)


def test_replay_is_refused_for_an_executor_that_drops_routes():
    refused(
        r"^algo\.policy\.router_replay: rollout executor 'tool_call' does not put the engine's MoE routes",
        algo__policy__router_replay="R3",
        rollout__engine="hf",
        rollout__engine_options__return_routed_experts="true",
        rollout__executor="tool_call",
    )


def test_an_unknown_replay_mode_is_refused():
    refused(r"router_replay", algo__policy__router_replay="R2")
