"""`rl-launch dpo`: DPO, cDPO or IPO on preference pairs (`rl_learner.DPOLearner`).

The reference is a frozen copy of `model.pretrain` (an inference-only learner on the trained
model's backend); its log-probs of the step's pairs are computed before the policy's update.
Logged: dpo/loss, dpo/reward_margin (mean β·z), dpo/reward_accuracy, dpo/chosen_rewards,
dpo/rejected_rewards, dpo/chosen_logps, dpo/rejected_logps, all on the step's batch before its
update.
"""

from __future__ import annotations

from typing import Any

from .common import build_learner, build_reference, load_preferences, pair_tokens
from .config import DPOConfig
from .loop import Task, run_task

__all__ = ["SETTINGS", "TASK", "run"]

SETTINGS: dict[str, Any] = {
    "loss": {"beta": 0.1},
    "train": {
        "max_steps": 30,
        "train_batch_size": 16,
        "actor_learning_rate": 1e-3,
        "lr_warmup_ratio": 0.0,
        "zero_stage": 0,
    },
    "log": {"output_dir": "runs/dpo-arithmetic"},
}
"""The arithmetic preset's settings (under the user's file and flags)."""


def _build(config: DPOConfig, model_path: str, total_steps: int):
    from rl_learner import DPOLearner, DPOLossConfig, pack_pairs

    learner = build_learner(DPOLearner, config, model_path, total_steps, value=False)
    reference = build_reference(config, model_path)
    loss = DPOLossConfig(
        beta=config.loss.beta, label_smoothing=config.loss.label_smoothing, loss_type=config.loss.loss_type
    )

    def step(micro: list[list[Any]]) -> dict[str, float]:
        batches = [pack_pairs(part) for part in micro]
        for batch, values in zip(batches, reference.logprobs(batches, only_actions=True), strict=True):
            batch.ref_logprobs = values
        return learner.dpo_step(batches, loss, aux_loss_coef=config.loss.aux_loss_coef)

    return learner, step


TASK = Task(
    command="dpo",
    role="policy",
    headline=("dpo/reward_margin", "dpo/reward_accuracy"),
    preset_data="pairs",
    load=load_preferences,
    lengths=pair_tokens,
    build=_build,
)


def run(config: DPOConfig) -> int:
    return run_task(TASK, config)
