"""What the learners minimise, from the chosen components: the policy's and the critic's loss configs.

`policy_loss_config` gathers `algo.policy` (loss, rollout correction and their options, verbatim),
the KL in the loss (`algo.kl.loss_*`) and the teacher KL in the loss (`algo.distill`, mode loss)
into the learner's `rl_learner.PolicyLossConfig`; `check_components` builds it once as a dry run,
and `rl_launch.ppo` every step (β from the KL controller).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .corrections import correction_name

if TYPE_CHECKING:
    from rl_learner import PolicyLossConfig, ValueLossConfig

    from ..config import PPOConfig

__all__ = ["old_logprobs_from_training", "policy_loss_config", "value_loss_config"]


def old_logprobs_from_training(config: PPOConfig) -> bool:
    """True when the old log-probs equal the training forward's own log-probs, detached.

    That holds when each batch gets exactly one optimizer step (one epoch, one mini-batch): the
    weights that would score the batch are the weights that train on it. The separate forward is
    then skipped (TRL does the same) and the learner uses its own detached log-probs, so the
    ratio is exactly 1. It also needs a run without a reference model (β = 0): the KL and its
    controller are computed from the old log-probs before training. In async mode the rollout
    weights lag, but the old log-probs are still those of the current weights, so the rule is the
    same; the rollout correction compares them with the sampler's log-probs inside the learner.
    A distillation teacher also needs them in the driver (the teacher reward and
    `distill/kl_to_teacher` compare the policy's log-probs with the teacher's before training).
    """
    samples = config.rollout.rollout_batch_size * config.rollout.n_samples_per_prompt
    one_step = config.train.max_epochs == 1 and (config.train.train_batch_size or samples) >= samples
    return one_step and not config.needs_reference and not config.needs_teacher


def policy_loss_config(config: PPOConfig, *, kl_coef: float) -> PolicyLossConfig:
    """The learner's objective: `algo.policy` (the loss, the rollout correction and their options,
    verbatim; correction auto resolved by rollout.async_train), the KL in the loss
    (`algo.kl.loss_*`, β = `kl_coef`) when `algo.kl.use_kl_loss`, and the KL to the teacher
    (`algo.distill.estimator`, β_d = `algo.distill.coef`) with a teacher in mode loss.

    Raises ValueError naming the `PolicyLossConfig` field for a combination it refuses.
    """
    from rl_learner import PolicyLossConfig

    policy, kl, distill = config.algo.policy, config.algo.kl, config.algo.distill
    distill_in_loss = config.needs_teacher and distill.mode == "loss"
    correction, correction_options = correction_name(config), dict(policy.correction_options)
    if correction == "none":
        correction_options = {}  # auto's options are tis's, unused when it picks none
    return PolicyLossConfig(
        name=policy.loss,
        options=dict(policy.options),
        aggregation=policy.aggregation,
        horizon=config.rollout.generate_max_len if policy.aggregation == "seq-mean-token-sum-norm" else None,
        kl_coef=kl_coef if kl.use_kl_loss else 0.0,
        kl_estimator=kl.loss_estimator,
        kl_options=dict(kl.loss_options),
        distill_coef=distill.coef if distill_in_loss else 0.0,
        distill_estimator=distill.estimator,
        entropy_coef=policy.entropy_coef,
        aux_loss_coef=policy.aux_loss_coef,
        router_replay=policy.router_replay,
        correction=correction,
        correction_options=correction_options,
        temperature=config.rollout.temperature,
        old_logprobs_from_forward=old_logprobs_from_training(config),
    )


def value_loss_config(config: PPOConfig, policy: PolicyLossConfig) -> ValueLossConfig:
    """The critic's clipped value loss, aggregated like the policy loss."""
    from rl_learner import ValueLossConfig

    return ValueLossConfig(
        clip_range=config.algo.value_clip, aggregation=policy.aggregation, horizon=policy.horizon
    )
