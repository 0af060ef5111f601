"""Health that acts: the step metrics that mean a run is broken, and what the run does about them.

`HealthMonitor.check(step, metrics)` runs after each step is logged. It returns console warnings
and raises `HealthError` (the run stops, exit code 1, the message a diagnosis) for:

- every policy update skipped as non-finite (`policy/skipped` = 1: the loss, an input or the
  gradient norm was NaN or inf, so the learner left the weights alone) for `health.max_skipped_steps`
  steps in a row: the run would go on producing nothing;
- the engines' and the learner's log-probs of the sampled tokens drifting apart
  (`health/logprob_mismatch_mean` above `health.logprob_mismatch_warn`: a warning, at most once
  per ten steps; above `health.logprob_mismatch_stop`: a stop). Right after a weight sync the two
  compute the same policy, so a large gap is a broken sync, a dtype or a kernel mismatch;
- more than `health.max_fallback_fraction` of a step's samples trained on a fallback reward
  (`reward/fallback_fraction`: a dead reward server or a failing reward function under
  `reward.on_error fallback`, failing episodes) for `health.max_fallback_steps` steps in a row: the
  run would train on constants. The diagnosis names the failing sources.
"""

from __future__ import annotations

from collections.abc import Mapping

from .config import PPOConfig

__all__ = ["EngineHung", "HealthError", "HealthMonitor"]


class HealthError(RuntimeError):
    """The run stops: its steps cannot make progress (the message says why and what to check)."""


class EngineHung(HealthError):
    """Rollout engines that did not answer a call within its deadline: `engines` (their indices)
    and `what` (the call, the seconds, the option that sets them). `rl_launch.supervisor` restarts
    them while `rollout.engine_restarts` allow; raised past that, the run stops with this message
    (`message`: a whole message of its own instead of "engine-0 hung: <what>")."""

    def __init__(self, engines: list[int], what: str, *, message: str | None = None) -> None:
        self.engines, self.what = list(engines), what
        super().__init__(message or f"{', '.join(f'engine-{index}' for index in self.engines)} hung: {what}")


class HealthMonitor:
    """The health rules of one run (`health.*` options), with the streaks they count."""

    def __init__(self, config: PPOConfig) -> None:
        self.config = config
        self.skipped_streak: list[int] = []
        self.fallback_streak: list[int] = []
        self.last_warning_step: int | None = None

    def _check_fallbacks(self, step: int, metrics: Mapping[str, float]) -> None:
        """Stop a run whose steps train mostly on fallback rewards (`health.max_fallback_fraction`)."""
        health, fraction = self.config.health, metrics.get("reward/fallback_fraction")
        if health.max_fallback_fraction is None or fraction is None:
            return
        if fraction > health.max_fallback_fraction:
            self.fallback_streak.append(step)
        else:
            self.fallback_streak = []
        if len(self.fallback_streak) < health.max_fallback_steps:
            return
        first, last = self.fallback_streak[0], self.fallback_streak[-1]
        prefix = "reward/fallbacks/"
        failing = {key[len(prefix) :]: value for key, value in metrics.items() if key.startswith(prefix)}
        named = "; ".join(
            f"{self._source_name(source)}: {count:g} samples" for source, count in failing.items() if count
        )
        raise HealthError(
            f"steps {first}-{last} trained mostly on fallback rewards ({fraction:.0%} of step {last}'s samples; "
            f"health.max_fallback_fraction = {health.max_fallback_fraction:g} for health.max_fallback_steps = "
            f"{health.max_fallback_steps} steps in a row), from {named or 'unnamed sources'} "
            f"(reward/timeouts = {metrics.get('reward/timeouts', 0.0):g}). The rewards are constants, not "
            "the task's: check the sources named (a reward server that is down, a reward function or model that "
            "raises or runs past reward.function_timeout_s / model_timeout_s, a judge that answers without a "
            "score or past reward.judge_timeout_s, episodes that fail: see the "
            "rollout workers' logs)"
        )

    def _source_name(self, source: str) -> str:
        """A reward source of `reward/fallbacks/<source>` as the options name it."""
        reward = self.config.reward
        if source == "function":
            return f"reward.function ({reward.function or 'the preset'!s})"
        if source.startswith("remote_") and source[7:].isdigit() and int(source[7:]) < len(reward.urls):
            return f"reward.remote_url {reward.urls[int(source[7:])]}"
        if source == "judge":
            return f"the judge (reward.judge_pretrain {reward.judge_pretrain}; reward.judge_timeout_s = {reward.judge_timeout_s})"
        if source == "model":
            return f"the reward model ({self.config.model.reward_pretrain}; reward.model_timeout_s = {reward.model_timeout_s})"
        if source == "episode":
            return f"failed episodes (rollout.executor {self.config.rollout.executor or 'by the preset'})"
        return source

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
        self._check_fallbacks(step, metrics)
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
