"""Rollout corrections (`rl_algos.CORRECTIONS`): `algo.policy.correction` and its options
`algo.policy.correction_options`, for the mismatch between the engines' log-probs and the
learner's. `auto` is tis in async mode (rollout.async_train) and none otherwise."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from rl_algos import CORRECTIONS

from ..errors import ConfigError
from .base import ComponentKind, Selection, component_options, dry_run, format_options

if TYPE_CHECKING:
    from ..config import PPOConfig

__all__ = ["CORRECTION", "CORRECTION_INPUTS", "correction_name"]

CORRECTION_INPUTS = frozenset({"old_logprobs", "rollout_logprobs", "action_mask"})
"""What the learner hands every correction: not options."""


def correction_name(config: PPOConfig) -> str:
    """The correction a run uses: `algo.policy.correction`, auto resolved (tis when async, else none)."""
    name = config.algo.policy.correction
    if name == "auto":
        return "tis" if config.rollout.async_train else "none"
    return name


def _options_owner(config: PPOConfig) -> str:
    """Whose options `algo.policy.correction_options` are: the correction's, and with auto tis's
    (unused when auto picks none)."""
    name = config.algo.policy.correction
    return "tis" if name == "auto" else name


def _options_of(name: str) -> dict[str, Any]:
    return component_options(CORRECTIONS[name], inputs=CORRECTION_INPUTS)


def _select(config: PPOConfig) -> list[Selection]:
    policy = config.algo.policy
    name = _options_owner(config)
    takes = _options_of(name) if name in CORRECTIONS else None  # none: refused in _check
    return [
        Selection(
            "algo.policy.correction",
            name,
            "algo.policy.correction_options",
            policy.correction_options,
            takes,
            allowed=("auto", "none"),
        )
    ]


def _check(config: PPOConfig) -> None:
    name, options = _options_owner(config), config.algo.policy.correction_options
    if name == "none":
        if options:
            raise ConfigError(
                f"algo.policy.correction_options: {options!r} given, but algo.policy.correction is none"
            )
        return
    old = torch.tensor([[-1.0, -0.5, -2.0]])
    dry_run(
        "algo.policy.correction_options",
        f"rollout correction {name!r}",
        lambda: CORRECTIONS[name](old, old - 0.1, torch.ones(1, 3), **options),
    )


def _describe(config: PPOConfig) -> str | None:
    name = correction_name(config)
    if name == "none":
        return None
    options = {**_options_of(name), **config.algo.policy.correction_options}
    return f"correction {name}({format_options(options)})"


CORRECTION = ComponentKind(
    title="rollout corrections",
    singular="rollout correction",
    registry=CORRECTIONS,
    where="algo.policy.correction, options: algo.policy.correction_options; also auto and none",
    select=_select,
    options_of=_options_of,
    check=_check,
    describe=_describe,
    extra_names=("auto", "none"),
)
