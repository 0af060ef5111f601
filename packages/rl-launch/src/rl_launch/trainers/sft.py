"""`rl-launch sft`: supervised fine-tuning on prompt / response rows (`rl_learner.SFTLearner`).

The loss is the NLL of the response tokens (token-mean over the step by default,
`loss.aggregation`); logged as sft/loss and sft/nll (token-mean NLL, whatever the aggregation).
"""

from __future__ import annotations

from typing import Any

from .common import build_learner, read_rows
from .config import SFTConfig
from .loop import Task, run_task

__all__ = ["SETTINGS", "TASK", "run"]

SETTINGS: dict[str, Any] = {
    "train": {
        "max_steps": 60,
        "train_batch_size": 16,
        "actor_learning_rate": 3e-3,
        "lr_warmup_ratio": 0.0,
        "zero_stage": 0,
    },
    "log": {"output_dir": "runs/sft-arithmetic"},
}
"""The arithmetic preset's settings (under the user's file and flags)."""


def _load(config: SFTConfig, tokenizer: Any, path: str) -> Any:
    from rl_data.datasets import SFTDataset

    data = config.data
    return SFTDataset(
        read_rows(config, path),
        tokenizer,
        input_key=data.input_key,
        output_key=data.output_key,
        messages_key=data.messages_key,
        pretrain_mode=data.pretrain_mode,
        apply_chat_template=data.apply_chat_template,
        max_length=data.max_len,
    )


def _build(config: SFTConfig, model_path: str, total_steps: int):
    from rl_learner import SFTLearner, pack_sequences

    learner = build_learner(SFTLearner, config, model_path, total_steps, value=False)

    def step(micro: list[list[Any]]) -> dict[str, float]:
        batches = [pack_sequences([(s.input_ids, s.loss_mask) for s in part]) for part in micro]
        return learner.sft_step(
            batches, aggregation=config.loss.aggregation, aux_loss_coef=config.loss.aux_loss_coef
        )

    return learner, step


TASK = Task(
    command="sft",
    role="policy",
    headline=("sft/loss", "sft/nll"),
    preset_data="sft",
    load=_load,
    lengths=lambda sample: int(sample.input_ids.numel()),
    build=_build,
)


def run(config: SFTConfig) -> int:
    return run_task(TASK, config)
