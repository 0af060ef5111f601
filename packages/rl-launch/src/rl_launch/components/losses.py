"""Policy losses (`rl_algos.POLICY_LOSSES`): `algo.policy.loss` and its options `algo.policy.options`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from rl_algos import POLICY_LOSSES

from .base import ComponentKind, Selection, component_options, dry_run, format_options
from .estimators import tiny_batch

if TYPE_CHECKING:
    from ..config import PPOConfig

__all__ = ["LOSS_INPUTS", "POLICY_LOSS"]

LOSS_INPUTS = frozenset({"logprobs", "old_logprobs", "advantages", "action_mask"})
"""What the learner hands every policy loss: not options."""


def _options_of(name: str) -> dict[str, Any]:
    return component_options(POLICY_LOSSES[name], inputs=LOSS_INPUTS)


def _select(config: PPOConfig) -> list[Selection]:
    policy = config.algo.policy
    takes = _options_of(policy.loss) if policy.loss in POLICY_LOSSES else None  # none: refused by the caller
    return [Selection("algo.policy.loss", policy.loss, "algo.policy.options", policy.options, takes)]


def _check(config: PPOConfig) -> None:
    policy = config.algo.policy
    fn = POLICY_LOSSES[policy.loss]
    mask = tiny_batch()["action_mask"]
    logprobs = torch.tensor([[-1.0, -0.5, -2.0]] * 4)
    dry_run(
        "algo.policy.options",
        f"policy loss {policy.loss!r}",
        lambda: fn(logprobs, logprobs - 0.1, torch.ones(4, 3), mask, **policy.options),
    )


def _describe(config: PPOConfig) -> str:
    policy = config.algo.policy
    return f"loss {policy.loss}({format_options({**_options_of(policy.loss), **policy.options})})"


POLICY_LOSS = ComponentKind(
    title="policy losses",
    singular="policy loss",
    registry=POLICY_LOSSES,
    where="algo.policy.loss, options: algo.policy.options",
    select=_select,
    options_of=_options_of,
    check=_check,
    describe=_describe,
)
