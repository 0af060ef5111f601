"""A plugin of every component kind (tests/launch/plugin_every_kind.py) is listed by
`rl-launch components` and runs through a real `rl-launch ppo`, with no change to the packages:
an estimator that takes `values` gets a critic, a plugin engine, executor, rollout correction and
weight-sync transport each do their part of the step. The same run takes a second plugin given
as a file path (tests/launch/plugin_example.py), whose policy loss trains the policy, and every
process imports each plugin once."""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

from tests.launch.launching import launch, read_metrics

PLUGIN = pathlib.Path(__file__).with_name("plugin_every_kind.py")
EXAMPLE = pathlib.Path(__file__).with_name("plugin_example.py")

CHOICES = [
    "--algo.advantage.estimator", "plugin_td",
    "--rollout.engine", "plugin_hf",
    "--rollout.executor", "plugin_tagged",
    "--rollout.executor_options.tag", "2.0",
    "--algo.policy.correction", "plugin_capped",
    "--algo.policy.correction_options.cap", "3.0",
    "--rollout.weight_sync", "toy_folder",
]  # fmt: skip


def test_rl_launch_components_lists_the_plugin_of_every_kind():
    result = subprocess.run(
        [sys.executable, "-m", "rl_launch.cli", "components", "--plugin", os.path.relpath(PLUGIN)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    sections = result.stdout.split("\n\n")

    def section(title: str) -> str:
        return next(part for part in sections if part.lstrip().startswith(title))

    assert "plugin_td(gamma=1.0)" in section("advantage estimators")
    assert "plugin_hf" in section("rollout engines")
    assert "plugin_tagged(tag=1.0)" in section("rollout executors")
    assert "plugin_capped(cap=5.0)" in section("rollout corrections")
    assert "toy_folder" in section("weight-sync strategies")


def test_a_bad_option_of_a_plugin_component_fails_before_anything_starts(tiny_checkpoint, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "What is 1 + 1?", "label": "2"}) + "\n")
    result = launch(
        [
            "--preset",
            "none",
            "--model.pretrain",
            str(tiny_checkpoint),
            "--data.prompt_data",
            str(prompts),
            "--reward.function",
            "numeric",
            "--plugin",
            os.path.relpath(PLUGIN),
            *CHOICES,
            "--algo.policy.correction_options.cop",
            "3",
            "--log.output_dir",
            str(tmp_path / "run"),
        ],
        dict(os.environ),
        timeout=120,
    )
    assert result.returncode == 2
    assert (
        "algo.policy.correction_options.cop: not an option of rollout correction 'plugin_capped'"
        in result.stderr
    )


@pytest.mark.slow
def test_a_run_uses_a_plugin_component_of_every_kind(tiny_checkpoint, ray_temp, tmp_path):
    ray_dir, env = ray_temp
    prompts = tmp_path / "train.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": f"What is {i} + 1?", "label": str(i + 1)}) + "\n" for i in range(16))
    )
    run_dir = tmp_path / "run"
    args = [
        "--preset", "none",
        "--model.pretrain", str(tiny_checkpoint),
        "--data.prompt_data", str(prompts),
        "--reward.function", "numeric",
        "--plugin", os.path.relpath(PLUGIN),
        "--plugin", os.path.relpath(EXAMPLE),  # a .py path, relative to the driver's working directory
        *CHOICES,
        "--algo.policy.loss", "plugin_pg",
        "--rollout.n_samples_per_prompt", "4",
        "--rollout.rollout_batch_size", "4",
        "--rollout.generate_max_len", "8",
        "--train.max_steps", "2",
        "--train.zero_stage", "0",
        "--ckpt.save_hf_model", "false",
        "--log.output_dir", str(run_dir),
        "--log.progress_bar", "false",
        "--ray.temp_dir", ray_dir,
    ]  # fmt: skip
    result = launch(args, env)
    assert result.returncode == 0, result.stderr[-4000:]
    metrics = read_metrics(run_dir)
    assert [line["step"] for line in metrics] == [1, 2]
    for line in metrics:
        assert math.isfinite(line["policy/loss"])
        assert "policy/ratio_mean" in line  # plugin_example's loss's own metric, computed in the actor
        assert line["policy/skipped"] == 0
        assert math.isfinite(line["critic/loss"])  # plugin_td takes values: a critic was started and trained
        assert line["rollout/agent/plugin_tag"] == 2.0  # the executor's option arrived verbatim
        assert "policy/plugin_cap_fraction" in line  # the correction ran in the learner
        assert line["health/sync_checksum_match"] == 1.0  # the toy transport carried the weights
    assert sorted(path.name for path in (run_dir / "toy_sync").glob("bucket-0-v*.bin"))
    engine_log = (run_dir / "logs" / "engine-0.log").read_text()
    assert "plugin_every_kind: engine built" in engine_log
    assert "plugin_every_kind: executor built" in engine_log
    # imported in the driver and in each actor (the policy learner, the engine), once per process
    for name, output in [
        ("driver", result.stdout),
        *[(name, (run_dir / "logs" / f"{name}.log").read_text()) for name in ("policy-0", "engine-0")],
    ]:
        assert "plugin_example: imported (execution 1 in pid" in output, name
        assert "(execution 2 in pid" not in output, name
