"""Health that acts: the step metrics that mean a run is broken, and what the run does about them.

`HealthMonitor.check(step, metrics)` runs after each step is logged. It returns console warnings
and raises `HealthError` (the run stops, exit code 1, the message a diagnosis) for:

- every policy update skipped as non-finite (`policy/skipped` = 1: the loss, an input or the
  gradient norm was NaN or inf, so the learner left the weights alone) for `health.max_skipped_steps`
  steps in a row: the run would go on producing nothing;
- the engines' and the learner's log-probs of the sampled tokens drifting apart
  (`health/logprob_mismatch_mean` above `health.logprob_mismatch_warn`: a warning, at most once
  per ten steps; above `health.logprob_mismatch_stop`: a stop). Right after a weight sync the two
  compute the same policy, so a large gap is a broken sync, a dtype or a kernel mismatch.
"""

from __future__ import annotations

from collections.abc import Mapping

from .config import PPOConfig

__all__ = ["HealthError", "HealthMonitor"]


class HealthError(RuntimeError):
    """The run stops: its steps cannot make progress (the message says why and what to check)."""


class HealthMonitor:
    """The health rules of one run (`health.*` options), with the streaks they count."""

    def __init__(self, config: PPOConfig) -> None:
        self.config = config
        self.skipped_streak: list[int] = []
        self.last_warning_step: int | None = None

    def check(self, step: int, metrics: Mapping[str, float]) -> list[str]:
        """Warnings for the console after `step`; raises HealthError when the run must stop."""
        health = self.config.health
        warnings: list[str] = []
        if metrics.get("policy/skipped", 0.0) >= 1.0:
            self.skipped_streak.append(step)
        else:
            self.skipped_streak = []
        if health.max_skipped_steps is not None and len(self.skipped_streak) >= health.max_skipped_steps:
            first, last = self.skipped_streak[0], self.skipped_streak[-1]
            raise HealthError(
                f"every policy update of steps {first}-{last} was skipped: the loss, an input or the gradient "
                f"was not finite (policy/grad_norm {metrics.get('policy/grad_norm', float('nan'))}), so the "
                f"weights have not changed since step {first - 1}. Check the learning rate "
                f"(train.actor_learning_rate = {self.config.train.actor_learning_rate:g}), the rewards "
                f"(reward/mean = {metrics.get('reward/mean', float('nan')):.4g}) and the loss "
                f"({self.config.algo.policy.loss!r} with {self.config.algo.policy.options or 'its defaults'}); "
                "health.max_skipped_steps sets how many such steps in a row stop the run"
            )
        mismatch = metrics.get("health/logprob_mismatch_mean")
        if mismatch is not None:
            if health.logprob_mismatch_stop is not None and mismatch > health.logprob_mismatch_stop:
                raise HealthError(
                    f"step {step}: the engines' and the learner's log-probs of the sampled tokens differ by "
                    f"{mismatch:.4g} nats per token on average (health.logprob_mismatch_stop = "
                    f"{health.logprob_mismatch_stop:g}; health/sync_checksum_match = "
                    f"{metrics.get('health/sync_checksum_match', float('nan')):g}): the engines do not sample "
                    "from the policy being trained (a broken weight sync, a dtype or kernel mismatch)"
                )
            warn = health.logprob_mismatch_warn
            recent = self.last_warning_step is not None and step - self.last_warning_step < 10
            if warn is not None and mismatch > warn and not recent:
                self.last_warning_step = step
                warnings.append(
                    f"warning: step {step}: engine and learner log-probs differ by {mismatch:.4g} nats per token "
                    f"(> health.logprob_mismatch_warn = {warn:g}); see health/logprob_mismatch_* in metrics.jsonl"
                )
        return warnings
