"""Reward options of `rl-launch ppo` without Ray: sources and weights, remote request options,
headers from environment variables, OpenRLHF's shaping, and extra_logs into the step metrics.

The reward a rollout actor builds (`rl_launch.actors.build_reward`) is exercised against real
HTTP servers on 127.0.0.1; the end-to-end run through the CLI is tests/launch/test_rewards_e2e.py.
"""

from __future__ import annotations

import pytest
import torch

from rl_data import Trajectory, build_experience
from rl_launch.actors import EngineSpec, build_reward
from rl_launch.algorithm import reward_metrics, score_batch, shape_rewards
from rl_launch.config import ConfigError, RewardConfig
from rl_launch.preflight import PreflightError, resolve_inputs
from tests.launch.configs import ppo_config
from tests.launch.reward_servers import reward_server

BASE = {
    "model.pretrain": "/models/never-loaded",
    "data.prompt_data": "/data/never-read.jsonl",
    "algo.advantage.estimator": "grpo",
    "rollout.rollout_batch_size": "2",
    "rollout.n_samples_per_prompt": "2",
}


def config(**overrides: str):
    return ppo_config(BASE, **overrides)


def refused(pattern: str, **overrides: str) -> ConfigError:
    with pytest.raises(ConfigError, match=pattern) as error:
        config(**overrides)
    return error.value


# ----------------------------------------------------------------------------- configuration


def test_remote_urls_are_comma_separated_and_each_is_a_source_after_the_function():
    cfg = config(
        reward__function="numeric",
        reward__remote_url="http://127.0.0.1:1/a,https://rm.example/b",
        reward__weights="1,0.5,2",
    )
    assert cfg.reward.urls == ["http://127.0.0.1:1/a", "https://rm.example/b"]
    assert cfg.reward.sources == ["function", "remote_0", "remote_1"]
    assert cfg.reward.weights == [1.0, 0.5, 2.0]
    assert config(reward__remote_url="http://h/a").reward.sources == ["remote_0"]
    assert RewardConfig(remote_url=["http://h/a", "http://h/b"]).urls == ["http://h/a", "http://h/b"]
    refused(r"^reward\.remote_url: 'http://h/a,' must name URLs", reward__remote_url="http://h/a,")
    assert config().reward.sources == ["function"]  # the preset's function, or the zero reward


def test_weights_need_one_per_source():
    refused(
        r"^reward\.weights: \[1\.0\] must have one weight per reward source, 2 here \(remote_0, remote_1\)",
        reward__remote_url="http://h/a,http://h/b",
        reward__weights="1",
    )


def test_a_url_with_credentials_is_refused_without_echoing_them_and_points_at_headers_env():
    error = refused(
        r"^reward\.remote_url: a URL with credentials .* reward\.headers_env",
        reward__remote_url="http://alice:s3cret-pw@rm.example:8000/score",
    )
    assert "s3cret-pw" not in str(error)
    refused(
        r"^reward\.remote_url: 'ftp://rm\.example/x' is not an http", reward__remote_url="ftp://rm.example/x"
    )


def test_headers_env_takes_variable_names_only_and_needs_a_server():
    cfg = config(reward__remote_url="http://h/a", reward__headers_env__Authorization="REWARD_TOKEN")
    assert cfg.reward.headers_env == {"Authorization": "REWARD_TOKEN"}
    error = refused(
        r"^reward\.headers_env\.Authorization: '<hidden>' must be the NAME of an environment variable",
        reward__remote_url="http://h/a",
        reward__headers_env__Authorization="Bearer abc123",
    )
    assert "abc123" not in str(error)
    refused(r"^reward\.headers_env: .* needs reward\.remote_url", reward__headers_env__Authorization="TOKEN")


def test_request_and_shaping_options_are_range_checked():
    refused(r"reward\.batch_size", reward__batch_size="0")
    refused(r"reward\.retries", reward__retries="-1")
    refused(r"reward\.on_error", reward__on_error="ignore")
    refused(
        r"^reward\.stop_properly_penalty_coef: 1\.5 must be <= 1", reward__stop_properly_penalty_coef="1.5"
    )
    refused(
        r"^reward\.overlong_buffer_len: 64 must be <= rollout\.generate_max_len \(32\)",
        reward__overlong_buffer_len="64",
        rollout__generate_max_len="32",
    )


def test_a_header_variable_missing_in_the_driver_stops_the_run_in_preflight(
    tiny_checkpoint, tmp_path, monkeypatch
):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "1 + 1?", "label": "2"}\n')
    monkeypatch.delenv("RL_TEST_MISSING_TOKEN", raising=False)
    with reward_server("a", 1.0) as server:
        cfg = config(
            model__pretrain=str(tiny_checkpoint),
            data__prompt_data=str(prompts),
            reward__remote_url=server.url,
            reward__headers_env__Authorization="RL_TEST_MISSING_TOKEN",
        )
        with pytest.raises(PreflightError, match=r"Authorization -> RL_TEST_MISSING_TOKEN"):
            resolve_inputs(cfg, None)
        monkeypatch.setenv("RL_TEST_MISSING_TOKEN", "Bearer x")
        assert resolve_inputs(cfg, None).reward_function is None


# ---------------------------------------------------------------- the rollout actor's reward


def _records(count: int, reward: float = 0.0, lengths=None, finish_reasons=None) -> list[Trajectory]:
    lengths = lengths or [3] * count
    finish_reasons = finish_reasons or ["stop"] * count
    return [
        Trajectory(
            prompt_ids=torch.tensor([1, 2]),
            response_ids=torch.arange(3, 3 + length),
            rollout_logprobs=torch.full((length,), -1.0),
            reward=reward,
            group_id=index // 2,
            finish_reason=reason,
        )
        for index, (length, reason) in enumerate(zip(lengths, finish_reasons, strict=True))
    ]


def test_two_servers_and_a_file_are_weighted_batched_authorised_and_logged(tmp_path, monkeypatch):
    reward_file = tmp_path / "reward.py"
    reward_file.write_text(
        "def reward_func(queries, prompts, labels):\n"
        "    return {'rewards': [1.0] * len(queries), 'extra_logs': {'file_calls': 1.0}}\n"
    )
    monkeypatch.setenv("RL_TEST_REWARD_TOKEN", "Bearer t0ken")
    with reward_server("a", 1.0) as first, reward_server("b", 0.25) as second:
        reward = RewardConfig(
            function=str(reward_file),
            remote_url=[first.url, second.url],
            weights=[0.5, 2.0, -4.0],
            batch_size=2,
            retries=0,
            headers_env={"Authorization": "RL_TEST_REWARD_TOKEN"},
        )
        spec = _spec(reward)
        reward_fn = build_reward(spec)
        queries = ["p0 abc", "p1 de", "p2 f", "p3 "]
        prompts = ["p0", "p1", "p2", "p3"]
        output = reward_fn(queries, prompts, ["x"] * 4)
        records = _records(4)
        reward_fn.annotate(records)
    # Σ w_k r_k = 0.5·1 + 2·1 − 4·0.25
    assert output.rewards == [pytest.approx(1.5)] * 4
    assert [request["size"] for request in first.requests] == [2, 2]
    assert {request["authorization"] for request in first.requests + second.requests} == {"Bearer t0ken"}
    assert records[0].extra["reward_sources"] == {"function": 1.0, "remote_0": 1.0, "remote_1": 0.25}
    metrics = reward_metrics(records)
    assert metrics["reward/function_mean"] == 1.0
    assert metrics["reward/remote_0_mean"] == 1.0
    assert metrics["reward/remote_1_mean"] == 0.25
    # per-sample lists stay per record; one value per request is averaged over the step
    assert [r.extra["reward_logs"]["a_response_chars"] for r in records] == [4.0, 3.0, 2.0, 1.0]
    assert metrics["reward/extra/a_response_chars"] == 2.5
    assert metrics["reward/extra/b_requests"] == 1.0
    assert metrics["reward/extra/file_calls"] == 1.0


def test_a_dead_server_with_on_error_fallback_gives_the_fallback_reward():
    from rl_data.sync.broadcast import free_port

    reward = RewardConfig(
        remote_url=[f"http://127.0.0.1:{free_port()}/reward"], retries=0, on_error="fallback", fallback=-1.0
    )
    spec = EngineSpec(kind="hf", model_path="unused", dtype="fp32", max_model_len=8, seed=0, reward=reward)
    output = build_reward(spec)(["q a"], ["q"], [None])
    assert output.rewards == [-1.0]
    assert output.fallback_indices == [0]


def test_no_source_is_the_zero_reward_named_function():
    reward_fn = build_reward(
        EngineSpec(kind="hf", model_path="unused", dtype="fp32", max_model_len=8, seed=0)
    )
    assert reward_fn(["a b"], ["a"], [None]).rewards == [0.0]
    records = _records(1)
    reward_fn.annotate(records)
    assert reward_metrics(records) == {"reward/function_mean": 0.0}


# ------------------------------------------------------------------------------------ shaping


def test_overlong_and_stop_properly_shaping_follow_openrlhf():
    cfg = config(
        rollout__generate_max_len="8",
        reward__overlong_buffer_len="4",
        reward__overlong_penalty_factor="2.0",
        reward__stop_properly_penalty_coef="0.5",
    )
    rewards = torch.tensor([1.0, 1.0, 1.0, 1.0])
    lengths = torch.tensor([4, 5, 6, 8])  # the buffer starts after 8 − 4 = 4 tokens
    truncated = torch.tensor([False, False, False, True])
    shaped, metrics = shape_rewards(cfg, rewards, lengths, truncated)
    # overlong: 1 − 2·(len − 4)/4 -> 1, 0.5, 0, −1; then the truncated one is halved
    assert shaped.tolist() == [1.0, 0.5, 0.0, -0.5]
    assert metrics["reward/overlong_penalty_mean"] == pytest.approx(-(0 + 0.5 + 1 + 2) / 4)
    assert metrics["reward/overlong_fraction"] == 0.75
    assert metrics["reward/stop_properly_penalty_mean"] == pytest.approx(0.5 / 4)  # −1 halved is −0.5
    assert metrics["reward/shaped_mean"] == pytest.approx(0.25)
    negative = config(reward__stop_properly_penalty_coef="-1")
    shaped, _ = shape_rewards(negative, rewards, lengths, truncated)
    assert shaped.tolist() == [1.0, 1.0, 1.0, -1.0]
    unshaped, metrics = shape_rewards(config(), rewards, lengths, truncated)
    assert unshaped is rewards
    assert metrics == {}


def test_shaped_rewards_drive_the_advantages():
    cfg = config(
        rollout__generate_max_len="4",
        reward__overlong_buffer_len="2",
        algo__advantage__options__scale="none",  # grpo without the std division: A = r − mean(group)
    )
    records = _records(4, reward=1.0, lengths=[2, 4, 2, 3], finish_reasons=["stop", "length", "stop", "stop"])
    batch = build_experience(records)
    truncated = torch.tensor([reason == "length" for reason in batch.finish_reasons])
    shaped, _ = shape_rewards(cfg, batch.rewards.clone(), batch.response_lengths, truncated)
    score_batch(cfg, batch, shaped, kl_coef=0.0)
    first = batch.response_view(batch.advantages)[:, 0]
    # shaped: 1, 0 (4 tokens: the whole buffer), 1, 0.5 -> group means 0.5 and 0.75
    assert first.tolist() == pytest.approx([0.5, -0.5, 0.25, -0.25])


def test_the_readme_reward_command_parses_to_what_it_documents(capsys):
    import pathlib
    import re
    import shlex

    import yaml

    from rl_launch.cli import main

    readme = pathlib.Path(__file__).resolve().parents[2] / "packages" / "rl-launch" / "README.md"
    text = readme.read_text()
    start = text.index("### Rewards")
    end = re.compile(r"^##+ ", re.M).search(text, start + 1).start()  # the next heading
    (shell,) = re.findall(r"```bash\n(.+?)```", text[start:end], re.S)
    (command,) = [
        line for line in shell.replace("\\\n", " ").splitlines() if line.startswith("rl-launch ppo")
    ]
    assert main(["ppo", *shlex.split(command)[2:], "--print-config"]) == 0
    reward = yaml.safe_load(capsys.readouterr().out)["reward"]
    assert reward["remote_url"] == "http://rm-a:5000/get_reward,http://rm-b:5000/get_reward"
    assert reward["weights"] == [1.0, 0.5, 0.5]
    assert reward["headers_env"] == {"Authorization": "RM_TOKEN"}
    assert (reward["overlong_buffer_len"], reward["stop_properly_penalty_coef"]) == (256, 0.0)


# ------------------------------------------------------------------------- bounded reward sources


def _stuck_reward_file(tmp_path):
    """A reward file whose reward_func sleeps for as long as the test runs (until released)."""
    reward_file = tmp_path / "stuck_reward.py"
    reward_file.write_text(
        "import threading\n"
        "RELEASE = threading.Event()\n"
        "def reward_func(queries, prompts, labels):\n"
        "    RELEASE.wait(600)\n"
        "    return [1.0] * len(queries)\n"
    )
    return reward_file


def _spec(reward: RewardConfig) -> EngineSpec:
    return EngineSpec(
        kind="hf",
        model_path="unused",
        dtype="fp32",
        max_model_len=8,
        seed=0,
        reward_function=reward.function,
        reward=reward,
    )


def test_a_reward_function_that_never_returns_times_out_and_is_counted(tmp_path):
    import sys
    import time

    from rl_launch.rollouts import rollout_metrics
    from rl_rollout import RewardTimeout

    reward_file = _stuck_reward_file(tmp_path)
    lenient = RewardConfig(
        function=str(reward_file), function_timeout_s=1.0, on_error="fallback", fallback=-1.0
    )
    reward_fn = build_reward(_spec(lenient))
    started = time.monotonic()
    output = reward_fn(["p0 a", "p1 b"], ["p0", "p1"], [None, None])
    assert time.monotonic() - started < 30.0  # the function blocks 600 s: abandoned, not joined
    assert output.rewards == [-1.0, -1.0]
    assert output.timeout_indices == [0, 1]
    records = _records(2)
    reward_fn.annotate(records)
    assert records[0].extra["reward_fallback_sources"] == ["function"]
    assert records[0].extra["reward_timeout_sources"] == ["function"]
    metrics = rollout_metrics(records)
    assert metrics["reward/timeouts"] == 2.0
    assert metrics["reward/fallbacks"] == 2.0
    assert metrics["reward/fallback_fraction"] == 1.0
    assert metrics["reward/fallbacks/function"] == 2.0
    strict = build_reward(_spec(RewardConfig(function=str(reward_file), function_timeout_s=0.5)))
    with pytest.raises(
        RewardTimeout, match=r"stuck_reward.py:reward_func: reward_func\(\) did not return within 0.5 s"
    ):
        strict(["p0 a"], ["p0"], [None])
    for module in list(sys.modules.values()):  # release the abandoned threads
        if getattr(module, "__file__", None) == str(reward_file):
            module.RELEASE.set()


def test_a_registered_reward_that_raises_follows_reward_on_error(monkeypatch):
    from rl_launch.components import REWARDS
    from rl_rollout import BatchedReward

    def broken(queries, prompts, labels):
        raise ZeroDivisionError("the grader broke")

    monkeypatch.setitem(REWARDS, "broken_for_test", lambda: BatchedReward(broken, name="broken"))
    spec = _spec(RewardConfig(function="broken_for_test", on_error="fallback", fallback=-2.0))
    output = build_reward(spec)(["q a"], ["q"], [None])
    assert output.rewards == [-2.0]
    assert output.fallback_indices == [0]


def test_the_code_reward_by_name_runs_the_response_against_the_label_tests():
    from rl_rollout import SandboxError, run_python

    try:
        run_python("pass")
    except SandboxError:
        pytest.skip(
            "this machine refuses the sandbox's namespaces (reward.function code isolates the network)"
        )
    assert config(reward__function="code").reward.function == "code"
    reward_fn = build_reward(_spec(RewardConfig(function="code")))
    tests = ["assert f(2) == 4", "assert f(3) == 9"]
    queries = ["Q```python\ndef f(x):\n    return x * x\n```", "Q```python\ndef f(x):\n    return 4\n```"]
    assert reward_fn(queries, ["Q", "Q"], [tests, tests]).rewards == [1.0, 0.5]
