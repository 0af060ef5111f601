"""On-policy distillation through `rl-launch ppo`: the arithmetic preset's lazy model (greedy
eval accuracy ≈ 0.02) learns from a teacher that answers right (`build_teacher`, ≈ 0.95) with
the teacher's reverse-KL token reward alone (algo.distill.outcome false: the rule reward is
only measured, never trained on). Its per-token KL to the teacher must fall and its held-out
accuracy rise.

One run of 6 steps (REINFORCE++ over the token rewards, the preset's other settings but two: the
transformers engine, which starts in about a second where vLLM takes ~25 s and the most CPU of
the start-up, and greedy evaluation at step 0 and the last step only, the two the test reads).
Measured with vLLM and every step evaluated
on 2 CPU cores at load 5-9, two runs (presets built apart): distill/kl_to_teacher by step
0.81 0.71 0.51 0.37 0.29 0.32 and 0.60 0.61 0.44 0.33 0.36 0.40 (the per-token KL of the
student's own samples, noisy at 256 samples a step, levels off near 0.3);
eval/reward/mean 0.016 → 0.15 0.50 0.72 0.73 0.81 0.82 and 0.024 → 0.24 0.59 0.69 0.69 0.71
0.79. The run takes ~70 s at that load, the session's preset and teacher build ~70 s more
(~25 s on a quiet machine). With the transformers engine, at load 7-10: KL 0.54 0.61 0.53 0.32
0.26 0.44, eval 0.024 -> 0.72 (95 s and 49 CPU-s for the run against vLLM's 130 s and 61 CPU-s).
"""

from __future__ import annotations

import pytest

from tests.launch.launching import launch, read_metrics

pytestmark = pytest.mark.slow

STEPS = 6
KL_FALL = 0.75
"""The mean KL to the teacher over the last 3 steps is at most this fraction of step 1's (0.40 and
0.60 measured with vLLM, 0.63 with the transformers engine)."""
EVAL_RISE = 0.4
"""The held-out greedy accuracy rises at least this much from step 0 (0.80 and 0.76 measured with
vLLM, 0.70 with the transformers engine)."""


def test_distillation_alone_moves_the_student_to_its_teacher(arithmetic_teacher, joined_ray, tmp_path):
    preset_root, teacher = arithmetic_teacher
    ray_args, env = joined_ray
    run_dir = tmp_path / "run"
    args = [
        "--preset_root", preset_root,
        "--model.teacher_pretrain", teacher,
        "--algo.advantage.estimator", "reinforce",
        "--algo.distill.outcome", "false",
        "--rollout.engine", "hf",
        "--train.max_steps", str(STEPS),
        "--eval.eval_steps", str(STEPS),
        "--log.output_dir", str(run_dir),
        "--log.progress_bar", "false",
        "--ckpt.save_hf_model", "false",
        *ray_args,
    ]  # fmt: skip
    result = launch(args, env, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "teacher x1" in result.stdout
    assert "distillation to" in result.stdout
    assert "distill/kl_to_teacher" in result.stdout  # a headline row of the console summary
    metrics = read_metrics(run_dir)
    kl = [line["distill/kl_to_teacher"] for line in metrics if "distill/kl_to_teacher" in line]
    assert len(kl) == STEPS, kl  # logged every step
    assert sum(kl[-3:]) / 3 <= KL_FALL * kl[0], kl
    evals = [line["eval/reward/mean"] for line in metrics if "eval/reward/mean" in line]
    assert [line["step"] for line in metrics if "eval/reward/mean" in line] == [0, STEPS]
    assert evals[-1] - evals[0] >= EVAL_RISE, evals
    # the reward is distillation's alone: negative, and less so as the student nears the teacher
    rewards = [line["distill/reward_mean"] for line in metrics if "distill/reward_mean" in line]
    assert rewards[0] < 0, rewards
    assert rewards[-1] > rewards[0], rewards
