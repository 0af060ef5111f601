"""`rl-launch kto`: KTO on completions labelled desirable or undesirable (`rl_learner.KTOLearner`).

The reference is a frozen copy of `model.pretrain` (an inference-only learner on the trained
model's backend). KTO's reference point z_ref (an estimate of KL(π ‖ π_ref)) comes from mismatched
pairs: each completion of the step after the prompt of the next item of the step (the last after
the first's), so the estimate does not depend on whether the completions are good. The pairs are
made from the whole step's items before they are split over the ranks, so R ranks estimate the
z_ref one rank would.

Logged: kto/loss, kto/kl (z_ref), kto/desirable_rewards and kto/undesirable_rewards (means of
β·(log π − log π_ref) over each kind, before the update), kto/reward_margin (their difference),
kto/desirable and kto/undesirable (counts).
"""

from __future__ import annotations

from typing import Any

import msgspec

from .common import build_learner, build_reference, read_rows
from .config import KTOConfig
from .loop import Task, run_task

__all__ = ["SETTINGS", "TASK", "KTOItem", "mismatched_pairs", "run"]

SETTINGS: dict[str, Any] = {
    "train": {
        "max_steps": 30,
        "train_batch_size": 16,
        "actor_learning_rate": 1e-3,
        "lr_warmup_ratio": 0.0,
        "zero_stage": 0,
    },
    "log": {"output_dir": "runs/kto-arithmetic"},
}
"""The arithmetic preset's settings (under the user's file and flags)."""


class KTOItem(msgspec.Struct, frozen=True, kw_only=True):
    """One completion of a step and its KL pair (the next item's prompt + this completion)."""

    sample: Any
    """The `rl_data.datasets.UnpairedSample`."""
    kl: Any
    """An `UnpairedSample` holding the mismatched pair (its label is not used)."""


def _split(sample: Any) -> tuple[Any, Any]:
    """(prompt ids, completion ids) of an `UnpairedSample`: the completion starts at its first target."""
    import torch

    start = int(torch.nonzero(sample.loss_mask, as_tuple=True)[0][0])
    return sample.input_ids[:start], sample.input_ids[start:]


def mismatched_pairs(samples: list[Any]) -> list[KTOItem]:
    """Each sample with its KL pair: prompt of sample (i + 1) mod B, completion of sample i."""
    import torch

    from rl_data.datasets import UnpairedSample

    parts = [_split(sample) for sample in samples]
    items = []
    for index, sample in enumerate(samples):
        prompt, _ = parts[(index + 1) % len(samples)]
        _, completion = parts[index]
        ids = torch.cat([prompt, completion])
        mask = torch.cat(
            [torch.zeros(prompt.numel(), dtype=torch.bool), torch.ones(completion.numel(), dtype=torch.bool)]
        )
        items.append(
            KTOItem(sample=sample, kl=UnpairedSample(input_ids=ids, loss_mask=mask, desirable=False))
        )
    return items


def _load(config: KTOConfig, tokenizer: Any, path: str) -> Any:
    from rl_data.datasets import UnpairedPreferenceDataset

    data = config.data
    return UnpairedPreferenceDataset(
        read_rows(config, path),
        tokenizer,
        prompt_key=data.prompt_key,
        completion_key=data.completion_key,
        desirable_key=data.label_key,
        apply_chat_template=data.apply_chat_template,
        max_length=data.max_len,
    )


def _build(config: KTOConfig, model_path: str, total_steps: int):
    from rl_learner import KTOLearner, KTOLossConfig, pack_unpaired

    learner = build_learner(KTOLearner, config, model_path, total_steps, value=False)
    reference = build_reference(config, model_path)
    loss = KTOLossConfig(
        beta=config.loss.beta,
        desirable_weight=config.loss.desirable_weight,
        undesirable_weight=config.loss.undesirable_weight,
    )

    def step(micro: list[list[KTOItem]]) -> dict[str, float]:
        examples = [pack_unpaired([item.sample for item in part]) for part in micro]
        pairs = [pack_unpaired([item.kl for item in part]) for part in micro]
        for batches in (examples, pairs):
            for batch, values in zip(batches, reference.logprobs(batches, only_actions=True), strict=True):
                batch.ref_logprobs = values
        metrics = learner.kto_step(examples, loss, reference_point=learner.reference_point(pairs))
        metrics["reward_margin"] = metrics["desirable_rewards"] - metrics["undesirable_rewards"]
        return metrics

    return learner, step


TASK = Task(
    command="kto",
    role="policy",
    headline=("kto/reward_margin", "kto/loss"),
    preset_data="unpaired",
    load=_load,
    lengths=lambda item: int(item.sample.input_ids.numel() + item.kl.input_ids.numel()),
    build=_build,
    prepare=mismatched_pairs,
)


def run(config: KTOConfig) -> int:
    return run_task(TASK, config)
