"""End to end through Ray, a transformers engine and DeepSpeed: two prompt files mixed 0.75/0.25, an input
template, a dropped prompt on the start-up line, and evaluation of two datasets with 4 samples per
prompt logging pass@4, mean@4 and per-dataset metrics before training and at the end.

The same run keeps an EMA of the policy (`--train.ema_beta`), saves it in each checkpoint and
exports it to <log.output_dir>/final_ema; and it is tests/launch/test_plugin_every_kind.py's run
(its components: tests/launch/plugin_every_kind.py): a plugin of every component kind, none of them
in the packages, plus a policy loss from a second plugin given as a file path, each doing its part
of the step, every process importing each plugin once. The plugin engine and executor wrap the hf
engine and the single-turn executor, so the data, evaluation and EMA paths run through them as
through the built-in ones. One start-up for the three features."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from tests.launch.launching import launch, read_metrics
from tests.launch.test_plugin_every_kind import CHOICES, EXAMPLE, PLUGIN

pytestmark = pytest.mark.slow

REWARD_FILE = """
def reward_func(queries, prompts, labels):
    # 1 when the response has a length divisible by 3: sampled answers mix 0s and 1s
    return [float((len(query) - len(prompt)) % 3 == 0) for query, prompt in zip(queries, prompts)]
"""


def _write(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _sums(name, count):
    return [{"prompt": f"{name}: what is {i} + {i}?", "label": str(2 * i)} for i in range(count)]


BETA = 0.5


@pytest.fixture(scope="module")
def run(tiny_checkpoint, shared_ray, tmp_path_factory):
    """The run's folder and its completed process (no actor of it left)."""
    ray_args, env = shared_ray.args, shared_ray.env
    tmp_path = tmp_path_factory.mktemp("data_eval_ema")
    arithmetic = _write(
        tmp_path / "arithmetic.jsonl", [*_sums("add", 8), {"prompt": "many words " * 100, "label": "0"}]
    )
    algebra = _write(tmp_path / "algebra.jsonl", _sums("solve", 8))
    easy = _write(tmp_path / "easy.jsonl", _sums("easy", 3))
    hard = _write(tmp_path / "hard.jsonl", _sums("hard", 2))
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD_FILE)
    run_dir = tmp_path / "run"
    args = [
        "--preset", "none",
        "--model.pretrain", str(tiny_checkpoint),
        "--data.prompt_data", f"{arithmetic},{algebra}",
        "--data.prompt_probs", "0.75,0.25",
        "--data.input_template", "Question: {}\nAnswer:",
        "--data.prompt_max_len", "64",
        "--data.eval_dataset", f"{easy},{hard}",
        "--eval.eval_steps", "2",
        "--eval.n_samples_per_prompt", "4",
        "--eval.temperature", "1.0",
        "--reward.function", str(reward),
        "--plugin", os.path.relpath(PLUGIN),
        "--plugin", os.path.relpath(EXAMPLE),  # a .py path, relative to the driver's working directory
        *CHOICES,  # the estimator plugin_td takes values: the run starts and trains a critic
        "--algo.policy.loss", "plugin_pg",
        "--rollout.n_samples_per_prompt", "2",
        "--rollout.rollout_batch_size", "4",
        "--rollout.generate_max_len", "8",
        "--train.max_steps", "2",
        "--train.zero_stage", "0",
        "--train.actor_learning_rate", "1e-3",
        "--train.ema_beta", str(BETA),
        "--ckpt.save_steps", "1",
        "--log.output_dir", str(run_dir),
        "--log.progress_bar", "false",
        *ray_args,
    ]  # fmt: skip
    result = launch(args, env)
    assert result.returncode == 0, result.stderr[-4000:]
    assert not shared_ray.wait_for_no_actors(), "actors outlived the run"
    return run_dir, result


def test_mixed_prompts_and_pass_at_k_evaluation_per_dataset(run):
    run_dir, result = run
    # the start-up line: the mixture per dataset and the dropped over-long prompt
    startup = next(line for line in result.stdout.splitlines() if "training prompts" in line)
    assert "+ 8 algebra, mixed 0.75/0.25; dropped 1: arithmetic too_long 1)" in startup, startup
    assert "5 eval prompts (3 easy + 2 hard; dropped 0)" in startup, startup

    metrics = read_metrics(run_dir)
    assert [line["step"] for line in metrics] == [0, 1, 2]
    evaluated = [metrics[0], metrics[2]]  # before any update and after the last step
    assert "eval/pass@4" not in metrics[1]
    for line in evaluated:
        for prefix in ("eval/", "eval/easy/", "eval/hard/"):
            assert 0.0 <= line[f"{prefix}mean@4"] <= line[f"{prefix}pass@4"] <= 1.0
            assert 0.0 <= line[f"{prefix}reward/mean"] <= 1.0
        # every prompt has 4 samples: the overall numbers are the prompt-weighted per-dataset ones
        for name in ("mean@4", "pass@4", "reward/mean"):
            combined = (3 * line[f"eval/easy/{name}"] + 2 * line[f"eval/hard/{name}"]) / 5
            assert line[f"eval/{name}"] == pytest.approx(combined)
        # with 0/1 rewards, mean@4 (share of correct answers) is the mean reward
        assert line["eval/mean@4"] == pytest.approx(line["eval/reward/mean"])


def test_the_exported_ema_is_the_beta_average_of_the_checkpointed_ema_and_the_final_policy(
    run, tiny_checkpoint
):
    from safetensors.torch import load_file

    from rl_learner import load_checkpoint_tensors

    run_dir, _ = run
    initial = load_file(str(tiny_checkpoint / "model.safetensors"))
    final = load_file(str(run_dir / "final" / "model.safetensors"))
    exported = load_file(str(run_dir / "final_ema" / "model.safetensors"))
    after_step_1 = load_checkpoint_tensors(run_dir / "checkpoints" / "policy", "ema", tag=1)
    after_step_2 = load_checkpoint_tensors(run_dir / "checkpoints" / "policy", "ema", tag=2)
    assert after_step_1 is not None
    assert sorted(after_step_2) == sorted(after_step_1)
    moved = 0
    for name, step_1 in after_step_1.items():
        # EMA_2 = β·EMA_1 + (1 − β)·θ_2, with θ_2 the exported final policy
        expected = BETA * step_1 + (1 - BETA) * final[name].float()
        assert torch.allclose(exported[name].float(), expected, atol=1e-6), name
        assert torch.equal(after_step_2[name], exported[name].float()), name
        moved += int(not torch.equal(final[name], initial[name]))
        if not torch.equal(final[name], initial[name]):
            # the average lies strictly between the initial model and the final policy
            assert not torch.equal(exported[name], final[name]), name
            assert not torch.equal(exported[name], initial[name]), name
    assert moved > 0  # the policy trained


def test_the_run_uses_a_plugin_component_of_every_kind(run):
    run_dir, result = run
    trained = [line for line in read_metrics(run_dir) if line["step"] > 0]
    assert [line["step"] for line in trained] == [1, 2]
    for line in trained:
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
