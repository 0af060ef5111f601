"""A plugin of every component kind (tests/launch/plugin_every_kind.py) is listed by
`rl-launch components` and runs through a real `rl-launch ppo`, with no change to the packages:
an estimator that takes `values` gets a critic, a plugin engine, executor, rollout correction and
weight-sync transport each do their part of the step. The same run takes a second plugin given
as a file path (tests/launch/plugin_example.py), whose policy loss trains the policy, and every
process imports each plugin once.

That run is tests/launch/test_data_eval_e2e.py's (`CHOICES`, `PLUGIN` and `EXAMPLE` are imported
there): one start-up for the plugins, the data mixture, evaluation and the EMA."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

from tests.launch.launching import launch

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
