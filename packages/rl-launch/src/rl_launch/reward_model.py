"""The reward model's scores with a deadline and an error policy, as every reward source has.

The reward model (`model.reward_pretrain`, actors `ray.reward_model`) scores a step's samples in
the learners' forwards (`Roles.forwards`). `collect_scores` waits for them at most
`reward.model_timeout_s` from when they were asked; past it they are abandoned (the actors'
calls are never waited on again) and `RewardModelError` says so. A forward that raised (a Ray
task error: out of memory, a bad input) gives `RewardModelError` too; an actor that died does
not: a dead learner stops the run with its diagnosis.

`fallback_scores` applies `reward.on_error` to that failure: `raise` stops the run (the timeout
as a `HealthError`, the forward's error as it came), `fallback` gives every sample of the step the
score `reward.fallback` and marks its record (`extra["reward_fallback_sources"]` gets "model", and
`extra["reward_timeout_sources"]` too on a timeout), so that reward/fallbacks/model,
reward/timeouts and `health.max_fallback_fraction` count them like the other sources' fallbacks.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from rl_data import Trajectory

from .config import PPOConfig
from .diagnosis import _died
from .health import HealthError

__all__ = ["RewardModelError", "collect_scores", "fallback_scores"]

SOURCE = "model"
"""The reward model's name among the reward sources (reward/fallbacks/model)."""


class RewardModelError(HealthError):
    """The reward model gave no scores for a step: past `reward.model_timeout_s` (`timed_out`), or
    its forward raised (`__cause__`)."""

    def __init__(self, message: str, *, timed_out: bool) -> None:
        super().__init__(message)
        self.timed_out = timed_out


def collect_scores(futures: Sequence[Any], config: PPOConfig, asked_at: float) -> list:
    """`ray.get(futures)` (the reward model's ranks' scores), waiting at most
    `reward.model_timeout_s` seconds after `asked_at` (`time.monotonic()` when they were asked).
    Raises `RewardModelError` past the deadline (naming the option and the ranks still out) or
    when a forward raised; a dead actor's `RayActorError` as it came."""
    import ray

    futures = list(futures)
    deadline = config.reward.model_timeout_s
    if deadline is not None:
        left = max(0.0, deadline - (time.monotonic() - asked_at))
        _, waiting = ray.wait(futures, num_returns=len(futures), timeout=left)
        if waiting:
            raise RewardModelError(
                f"the reward model ({config.model.reward_pretrain}, ray.reward_model) did not score the step's "
                f"samples within reward.model_timeout_s = {deadline:g} s ({len(waiting)} of its {len(futures)} "
                "ranks had not answered)",
                timed_out=True,
            )
    try:
        return ray.get(futures)
    except Exception as error:
        if _died(error):
            raise
        first = (str(error).strip().splitlines() or [type(error).__name__])[-1]
        raise RewardModelError(
            f"the reward model's forward ({config.model.reward_pretrain}, ray.reward_model) failed: {first}",
            timed_out=False,
        ) from error


def fallback_scores(
    config: PPOConfig, failure: RewardModelError, records: Sequence[Trajectory]
) -> torch.Tensor:
    """The step's reward-model scores after `failure`, by `reward.on_error`: raise (the timeout
    with what to change; the forward's own error as it came) or `reward.fallback` for every sample,
    its record marked as a fallback of the source "model" (and a timeout, when it was one)."""
    reward = config.reward
    if reward.on_error == "raise":
        if failure.timed_out:
            raise RewardModelError(
                f"{failure}: reward.on_error raise stops the run. Raise reward.model_timeout_s (or set it to "
                "none) when scoring legitimately takes longer, or set reward.on_error fallback to train on "
                "reward.fallback meanwhile (health.max_fallback_fraction still stops a run that only does)",
                timed_out=True,
            ) from None
        raise failure.__cause__ or failure
    for record in records:
        record.extra["reward_fallback_sources"] = [*record.extra.get("reward_fallback_sources", []), SOURCE]
        if failure.timed_out:
            record.extra["reward_timeout_sources"] = [*record.extra.get("reward_timeout_sources", []), SOURCE]
    return torch.full((len(records),), float(reward.fallback), dtype=torch.float32)
