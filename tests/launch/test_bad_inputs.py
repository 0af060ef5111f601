"""Bad input stops a run early: a clear message naming the option, a non-zero exit, no Ray left behind.

A missing dataset, a model folder that is not there, a reward server that is down and sequences
longer than the model's context are caught before Ray starts (the run's Ray temp folder stays
empty); a bad row is found while Ray starts (the prompts load beside it) and stops the run before
any actor starts, Ray going down with it; a request for more GPUs than the cluster has is caught after Ray starts but before any
actor does, and Ray goes down with the run.

Every check runs the CLI's `main` in the test's process (the message is what they pin; a process
of its own costs seconds of imports each); the `ray_temp` fixture checks that no process of the
Ray a check started outlives it.
"""

from __future__ import annotations

import json
import os

import pytest
import ray

from rl_data.sync.broadcast import free_port
from rl_launch.cli import main


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "train.jsonl"
    path.write_text(
        "".join(json.dumps({"prompt": f"What is {i} + 1?", "label": str(i + 1)}) + "\n" for i in range(16))
    )
    return path


def _args(checkpoint, prompts, ray_dir, tmp_path, *extra: str) -> list[str]:
    return [
        "ppo",
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
    extra, message, tiny_checkpoint, prompts, ray_temp, tmp_path, capsys, in_process
):
    ray_dir, _ = ray_temp
    # an exception escaping main (a traceback in a process of its own) fails the test here
    assert main(_args(tiny_checkpoint, prompts, ray_dir, tmp_path, *extra)) != 0
    assert message in capsys.readouterr().err
    assert not ray.is_initialized()
    assert os.listdir(ray_dir) == []  # nothing slow started


def test_a_reward_server_that_is_down_stops_the_run_before_ray_starts(
    tiny_checkpoint, prompts, ray_temp, tmp_path, capsys, in_process
):
    ray_dir, _ = ray_temp
    url = f"http://127.0.0.1:{free_port()}/score"  # nobody listens there
    assert main(_args(tiny_checkpoint, prompts, ray_dir, tmp_path, "--reward.remote_url", url)) != 0
    assert f"reward.remote_url: cannot reach the reward server at {url}" in capsys.readouterr().err
    assert not ray.is_initialized()
    assert os.listdir(ray_dir) == []


def test_a_bad_row_stops_the_run_after_ray_starts_before_any_actor(
    tiny_checkpoint, ray_temp, tmp_path, capsys, in_process
):
    # the prompts load on a thread while Ray starts: a bad row is reported once Ray is up, and
    # Ray goes down with the run (the ray_temp fixture fails the test if a process of it survives)
    assert not ray.is_initialized()  # Ray in this process is the run's own
    ray_dir, _ = ray_temp
    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        json.dumps({"prompt": "What is 1 + 1?", "label": "2"}) + "\n" + json.dumps({"label": "3"}) + "\n"
    )
    assert main(_args(tiny_checkpoint, rows, ray_dir, tmp_path)) != 0
    out, err = capsys.readouterr()
    assert f"rl-launch ppo: error: data.prompt_data: {rows}, row 1, key 'prompt': missing or null" in err, err
    assert "ray: local cluster on 127.0.0.1" in out  # Ray had started
    assert "actors ready" not in out
    assert not ray.is_initialized()


def test_more_gpus_than_the_cluster_has_fails_before_any_actor_and_leaves_no_ray(
    tiny_checkpoint, prompts, ray_temp, tmp_path, capsys, in_process
):
    assert not ray.is_initialized()  # Ray in this process is the run's own
    ray_dir, _ = ray_temp  # the fixture fails the test if a Ray process of this run survives it
    extra = ("--ray.device", "cuda", "--ray.policy.num_actors", "2", "--rollout.num_engines", "2")
    # an exception escaping main (a traceback in a process of its own) fails the test here
    assert main(_args(tiny_checkpoint, prompts, ray_dir, tmp_path, *extra)) != 0
    out, err = capsys.readouterr()
    assert (
        "the run needs 5 GPUs (policy: 2 x 1, critic: 1 x 1, engine: 2 x 1) but the Ray cluster has 0" in err
    )
    assert "Traceback" not in err
    assert "ray: local cluster on 127.0.0.1" in out  # Ray had started
    assert "actors ready" not in out
    assert not ray.is_initialized()
