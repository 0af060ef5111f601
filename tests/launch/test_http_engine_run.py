"""`rl-launch ppo` with `rollout.engine http`: the rollouts come from an OpenAI-compatible server the
user runs (a real `vllm serve` of the tiny checkpoint), which cannot receive the learner's
weights, so the weight sync is none and the run says so.

The run itself (`check_a_run_samples_from`) is called by tests/rollout/test_http_engine.py's
contract class, on the `vllm serve` that class starts anyway: a server takes longer to start
(~45 s on 2 cores, more beside the other test worker) than the run takes."""

from __future__ import annotations

import json

import pytest

from rl_launch.cli import resolve_ppo_config
from rl_launch.components import check_components
from rl_launch.config import ConfigError
from tests.launch.launching import launch, ray_temp_dir, read_metrics

BASE = {"model.pretrain": "m", "data.prompt_data": "d", "rollout.engine": "http"}


def check(**overrides: str) -> None:
    check_components(resolve_ppo_config(None, {**BASE, **overrides}))


def test_the_http_engine_needs_a_base_url_and_cannot_take_a_weight_sync():
    with pytest.raises(
        ConfigError, match=r"^rollout\.engine_options\.base_url: rollout engine 'http' needs it$"
    ):
        check()
    url = {"rollout.engine_options.base_url": "http://127.0.0.1:8000"}
    check(**url)
    check(**url, **{"rollout.weight_sync": "none"})
    with pytest.raises(
        ConfigError, match=r"^rollout\.weight_sync: 'broadcast', but rollout engine 'http' cannot"
    ):
        check(**url, **{"rollout.weight_sync": "broadcast"})
    with pytest.raises(ConfigError, match=r"^rollout\.engine_options\.api_key: not an option .*api_key_env"):
        check(**url, **{"rollout.engine_options.api_key": "secret"})  # a key goes through a variable


def check_a_run_samples_from(url: str, checkpoint, tmp_path) -> None:
    """`rl-launch ppo --rollout.engine http` against the `vllm serve` of `checkpoint` at `url`:
    two steps, weight sync none (said on the console), the policy lag it implies; no Ray process
    of the run outlives it."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": f"What is {i} + 1?", "label": str(i + 1)}) + "\n" for i in range(8))
    )
    run_dir = tmp_path / "run"
    with ray_temp_dir() as (ray_dir, env):  # fails when a Ray process of the run outlives it
        args = [
            "--model.pretrain", str(checkpoint),
            "--data.prompt_data", str(prompts),
            "--reward.function", "numeric",
            "--rollout.engine", "http",
            "--rollout.engine_options.base_url", url,
            "--algo.advantage.estimator", "grpo",
            "--algo.policy.correction", "tis",  # the sampler lags the learner from step 2 on
            "--rollout.n_samples_per_prompt", "2",
            "--rollout.rollout_batch_size", "4",
            "--rollout.generate_max_len", "4",
            "--train.max_steps", "2",
            "--log.output_dir", str(run_dir),
            "--log.progress_bar", "false",
            "--ray.temp_dir", ray_dir,
        ]  # fmt: skip
        result = launch(args, env)
    assert result.returncode == 0, result.stderr[-4000:]
    assert (
        "weight sync: none (the engines keep the weights they started with" in result.stdout + result.stderr
    )
    metrics = read_metrics(run_dir)
    assert [line["step"] for line in metrics] == [1, 2]
    assert [line["health/policy_lag"] for line in metrics] == [0.0, 1.0]  # the server's weights never change
    assert all("health/sync_checksum_match" not in line for line in metrics)
