"""`rl-launch rm`: a reward model trained on preference pairs (`rl_learner.RewardModelLearner`).

The model is `model.pretrain` with a scalar score head (`load_value_model`); the loss is
Bradley-Terry, −log σ(r_w − r_l [− margin]). Logged: rm/loss, rm/accuracy (pairs with
r_w > r_l, measured on the step's batch before its update), rm/reward_margin, rm/chosen_reward,
rm/rejected_reward. `final/` loads with `AutoModelForSequenceClassification`.
"""

from __future__ import annotations

from typing import Any

from .common import build_learner, load_preferences, pair_tokens
from .config import RMConfig
from .loop import Task, run_task

__all__ = ["SETTINGS", "TASK", "run"]

SETTINGS: dict[str, Any] = {
    "train": {
        "max_steps": 30,
        "train_batch_size": 16,
        "actor_learning_rate": 2e-3,
        "lr_warmup_ratio": 0.0,
        "zero_stage": 0,
    },
    "log": {"output_dir": "runs/rm-arithmetic"},
}
"""The arithmetic preset's settings (under the user's file and flags)."""


def _build(config: RMConfig, model_path: str, total_steps: int):
    from rl_learner import RewardModelLearner, pack_pairs

    learner = build_learner(RewardModelLearner, config, model_path, total_steps, value=True)

    def step(micro: list[list[Any]]) -> dict[str, float]:
        return learner.reward_step(
            [pack_pairs(part) for part in micro],
            use_margin=config.loss.use_margin,
            aux_loss_coef=config.loss.aux_loss_coef,
        )

    return learner, step


TASK = Task(
    command="rm",
    role="reward_model",
    headline=("rm/accuracy", "rm/loss"),
    preset_data="pairs",
    load=load_preferences,
    lengths=pair_tokens,
    build=_build,
)


def run(config: RMConfig) -> int:
    return run_task(TASK, config)
