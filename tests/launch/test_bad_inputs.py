"""Bad input stops a run early: a clear message naming the option, a non-zero exit, no Ray left behind.

A missing dataset, a model folder that is not there, a reward server that is down and sequences
longer than the model's context are caught before Ray starts (the run's Ray temp folder stays empty); a request for more GPUs than the
cluster has is caught after Ray starts but before any actor does, and Ray goes down with the run.
"""

from __future__ import annotations

import json
import os

import pytest

from rl_data.transport import free_port
from tests.launch.launching import launch

# Every test starts `rl-launch ppo` in a process (seconds of imports); the last one starts Ray too.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "train.jsonl"
    path.write_text(
        "".join(json.dumps({"prompt": f"What is {i} + 1?", "label": str(i + 1)}) + "\n" for i in range(16))
    )
    return path


def _args(checkpoint, prompts, ray_dir, tmp_path, *extra: str) -> list[str]:
    return [
        "--preset", "none",
        "--model.pretrain", str(checkpoint),
        "--data.prompt_data", str(prompts),
        "--reward.function", "numeric",
        "--rollout.rollout_batch_size", "4",
        "--train.max_steps", "1",
        "--log.output_dir", str(tmp_path / "run"),
        "--log.progress_bar", "false",
        "--ray.temp_dir", ray_dir,
        *extra,
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ("--data.prompt_data", "/nonexistent/prompts.jsonl"),
            "data.prompt_data: dataset file '/nonexistent/prompts.jsonl' does not exist",
        ),
        (
            ("--model.pretrain", "/nonexistent/model"),
            "model.pretrain: model folder '/nonexistent/model' does not exist",
        ),
        (("--reward.function", "/nonexistent/reward.py"), "reward.function:"),
        (
            ("--rollout.generate_max_len", "4096"),  # the tiny model's context is 2048
            "data.prompt_max_len (1024) + rollout.generate_max_len (4096) = 5120 tokens is more than the "
            "context of model.pretrain",
        ),
    ],
    ids=["missing-dataset", "missing-model", "missing-reward-file", "longer-than-the-context"],
)
def test_a_missing_input_stops_the_run_before_ray_starts(
    extra, message, tiny_checkpoint, prompts, ray_temp, tmp_path
):
    ray_dir, env = ray_temp
    result = launch(_args(tiny_checkpoint, prompts, ray_dir, tmp_path, *extra), env, timeout=120)
    assert result.returncode != 0
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert os.listdir(ray_dir) == []  # nothing slow started


def test_a_reward_server_that_is_down_stops_the_run_before_ray_starts(
    tiny_checkpoint, prompts, ray_temp, tmp_path
):
    ray_dir, env = ray_temp
    url = f"http://127.0.0.1:{free_port()}/score"  # nobody listens there
    result = launch(
        _args(tiny_checkpoint, prompts, ray_dir, tmp_path, "--reward.remote_url", url), env, timeout=120
    )
    assert result.returncode != 0
    assert f"reward.remote_url: cannot reach the reward server at {url}" in result.stderr
    assert os.listdir(ray_dir) == []


def test_more_gpus_than_the_cluster_has_fails_before_any_actor_and_leaves_no_ray(
    tiny_checkpoint, prompts, ray_temp, tmp_path
):
    ray_dir, env = ray_temp  # the fixture fails the test if a Ray process of this run survives it
    extra = ("--ray.device", "cuda", "--ray.policy.num_actors", "2", "--rollout.num_engines", "2")
    result = launch(_args(tiny_checkpoint, prompts, ray_dir, tmp_path, *extra), env, timeout=300)
    assert result.returncode != 0
    assert (
        "the run needs 5 GPUs (policy: 2 x 1, critic: 1 x 1, engine: 2 x 1) but the Ray cluster has 0"
        in result.stderr
    )
    assert "Traceback" not in result.stderr
