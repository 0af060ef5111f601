"""The algorithm of a step, as pure functions of the config: advantages in the driver, the loss
the learners minimise. No Ray here; `rl_launch.ppo` calls these between the actor calls.

    rewards ──► KL in the reward (algo.kl.reward_estimator) ──► token rewards ──► estimator
    (rule / remote + reward model)   + teacher reward (algo.distill, mode reward)  (algo.advantage.*)
                                                                                  │
    PolicyLossConfig (algo.policy.*, the KL in the loss: algo.kl.loss_*,      ◄── advantages, returns
                      the teacher KL in the loss: algo.distill, mode loss)
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from rl_algos import (
    compute_advantages,
    join_segments,
    kl_penalty,
    overlong_penalty,
    reverse_kl_rewards,
    segment_layout,
    split_segments,
    stop_properly_penalty,
    teacher_log_ratio,
    token_level_rewards,
)
from rl_data import ExperienceBatch, Trajectory

from .components import estimator_needs, estimator_options
from .config import PPOConfig

__all__ = [
    "learners_share_prefix",
    "reward_metrics",
    "score_batch",
    "score_normalization",
    "shape_rewards",
]


def learners_share_prefix(config: PPOConfig) -> bool:
    """Whether the learners run a prompt shared by several sequences once (`model.share_prefix`,
    resolved by the learners' own rule, `rl_learner.config.prefix_sharing_on`)."""
    from rl_learner.config import prefix_sharing_on

    return prefix_sharing_on(config.model.share_prefix, config.model.attn_implementation)


def score_batch(
    config: PPOConfig,
    batch: ExperienceBatch,
    rewards: torch.Tensor,
    *,
    kl_coef: float,
    baseline_rewards: torch.Tensor | None = None,
    episode_ids: torch.Tensor | None = None,
) -> dict[str, float]:
    """Fill `batch.advantages` and `batch.returns` from the outcome `rewards` `[B]`; metrics back.

    With a reference model, the per-token KL `algo.kl.reward_estimator`(old ‖ ref) is measured
    (`kl/mean`, the per-sequence sum averaged) and, unless the KL goes into the loss, subtracted
    from the token rewards with β = `kl_coef`. `reward.clip` clips the outcome rewards; an
    estimator that declares `reward_clip` (reinforce_baseline: OpenRLHF centres, then clips)
    gets the raw rewards and the clip instead. `baseline_rewards` `[B]` (ReMax's greedy
    answers) are clipped like the rewards.

    With a distillation teacher (`batch.teacher_logprobs`), d_t = old − teacher at the action
    tokens is measured (`distill/kl_to_teacher`, its mean per action token); in mode reward
    −β_d·d_t joins the token rewards (`distill/reward_mean`: their per-sequence sum, averaged);
    with `algo.distill.outcome` false the outcome rewards are 0 before the estimator.

    `episode_ids` `[B]` (`rl_rollout.episodes.episode_ids`): rows that are segments of one episode
    (a history the chat template rewrote) go to the estimator as one row, their response tokens
    end to end (`rl_algos.join_segments`), with the reward of the episode's last segment: group
    statistics count the episode once, its return runs across its segments. The advantages go back
    to the segments' own tokens; the loss then normalises per token as for any row.
    """
    kl_config, distill = config.algo.kl, config.algo.distill
    mask = batch.response_action_mask()
    metrics: dict[str, float] = {}
    distill_rewards = None
    if (
        batch.teacher_logprobs is not None
    ):  # never without old log-probs (`components.objective.old_logprobs_from_training`)
        old = batch.response_view(batch.old_logprobs)
        teacher = batch.response_view(batch.teacher_logprobs)
        metrics["distill/kl_to_teacher"] = float(teacher_log_ratio(old, teacher, mask)[1])
        if distill.mode == "reward":
            distill_rewards = reverse_kl_rewards(old, teacher, mask, coef=distill.coef)
            metrics["distill/reward_mean"] = float(distill_rewards.sum(-1).mean())
        if not distill.outcome:
            rewards = torch.zeros_like(rewards)
            baseline_rewards = None if baseline_rewards is None else torch.zeros_like(baseline_rewards)
    kl = None
    if (
        batch.ref_logprobs is not None
    ):  # never without old log-probs (`components.objective.old_logprobs_from_training`)
        kl = kl_penalty(
            batch.response_view(batch.old_logprobs),
            batch.response_view(batch.ref_logprobs),
            kl_config.reward_estimator,
            **kl_config.reward_options,
        )
        kl = kl * mask
        metrics["kl/mean"] = float(kl.sum(-1).mean())
    in_reward = kl is not None and not kl_config.use_kl_loss
    clip = config.reward.clip
    values = batch.response_view(batch.values) if batch.values is not None else None
    group_ids, rows_mask = batch.group_ids, mask
    if episode_ids is not None:  # an episode's segments: one row for the estimator
        layout, (mask, kl, distill_rewards, values) = _joined(
            batch, episode_ids, mask, kl, distill_rewards, values
        )
        rewards, group_ids = rewards[layout.last], group_ids[layout.first]
        baseline_rewards = None if baseline_rewards is None else baseline_rewards[layout.last]
    token_rewards = token_level_rewards(
        rewards, mask, kl=kl if in_reward else None, kl_coef=kl_coef if in_reward else 0.0, reward_clip=clip
    )
    if distill_rewards is not None:
        token_rewards = token_rewards + distill_rewards.to(token_rewards.dtype)
    estimator = config.algo.advantage.estimator
    clips_itself = estimator_needs(estimator).clips_rewards
    inputs: dict[str, Any] = {
        "rewards": rewards if clips_itself or not clip else rewards.clamp(-clip, clip),
        "token_rewards": token_rewards,
        "values": values,
        "action_mask": mask,
        "group_ids": group_ids,
    }
    if clips_itself:
        inputs["reward_clip"] = clip
    if baseline_rewards is not None:
        baseline = baseline_rewards if clips_itself or not clip else baseline_rewards.clamp(-clip, clip)
        inputs["baseline_rewards"] = baseline
        metrics["reward/greedy_baseline_mean"] = float(baseline.mean())
    advantages, returns = compute_advantages(estimator, **inputs, **estimator_options(config))
    if episode_ids is not None:
        advantages, returns, mask = (
            split_segments(advantages, layout),
            split_segments(returns, layout),
            rows_mask,
        )
    batch.advantages = batch.from_response_view(advantages.float())
    batch.returns = batch.from_response_view(returns.float())
    metrics["advantages/mean"] = _masked_mean(advantages, mask)
    metrics["advantages/abs_mean"] = _masked_mean(advantages.abs(), mask)
    return metrics


def _joined(
    batch: ExperienceBatch, episode_ids: torch.Tensor, mask: torch.Tensor, *values: torch.Tensor | None
) -> tuple[Any, list[torch.Tensor | None]]:
    """The layout of `episode_ids`' episodes (`rl_algos.segment_layout`), and `mask` and each of
    `values` (`[B, T]` response views, or None) joined into episode rows."""
    layout = segment_layout(batch.response_lengths, episode_ids, mask.shape[1])
    return layout, [None if value is None else join_segments(value, layout) for value in (mask, *values)]


def score_normalization(model_path: str | os.PathLike[str]) -> tuple[float, float] | None:
    """(mean, std) of a reward model's scores as its config.json records them (`mean`, `std`: a
    reward-model trainer writes them from its evaluation set), for reward.normalize model:
    s ← (s − mean) / std. None when the config has no finite mean and std > 0."""
    path = Path(model_path) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"reward.normalize model: cannot read {path}: {error}") from None
    mean, std = config.get("mean"), config.get("std")
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (mean, std))
    if not numbers or not (math.isfinite(mean) and math.isfinite(std) and std > 0):
        return None
    return float(mean), float(std)


def shape_rewards(
    config: PPOConfig, rewards: torch.Tensor, response_lengths: torch.Tensor, truncated: torch.Tensor
) -> tuple[torch.Tensor, dict[str, float]]:
    """The outcome rewards `[B]` after OpenRLHF's reward shaping, and its metrics.

    With L = rollout.generate_max_len, in this order:
      overlong (DAPO; reward.overlong_buffer_len = L_buf, reward.overlong_penalty_factor = f):
          r ← r − f·min(len − (L − L_buf), L_buf)/L_buf   where len > L − L_buf;
      stop-properly (reward.stop_properly_penalty_coef = c), for `truncated` responses:
          r ← c·r (0 ≤ c ≤ 1) or r ← c (c < 0).
    `response_lengths` `[B]` counts response tokens, `truncated` `[B]` bool marks responses cut at L
    (finish reason "length"). Each penalty's mean change over the batch is logged
    (`reward/overlong_penalty_mean`, `reward/stop_properly_penalty_mean`, ≤ 0 for rewards ≥ 0).
    """
    reward = config.reward
    metrics: dict[str, float] = {}
    shaped = rewards
    if reward.overlong_buffer_len is not None:
        penalised = overlong_penalty(
            shaped,
            response_lengths.long(),
            max_new_tokens=config.rollout.generate_max_len,
            buffer_length=reward.overlong_buffer_len,
            penalty_factor=reward.overlong_penalty_factor,
        )
        metrics["reward/overlong_penalty_mean"] = float((penalised - shaped).mean())
        metrics["reward/overlong_fraction"] = float((penalised < shaped).float().mean())
        shaped = penalised
    if reward.stop_properly_penalty_coef is not None:
        penalised = stop_properly_penalty(shaped, truncated.bool(), reward.stop_properly_penalty_coef)
        metrics["reward/stop_properly_penalty_mean"] = float((penalised - shaped).mean())
        shaped = penalised
    if metrics:
        metrics["reward/shaped_mean"] = float(shaped.mean())
    return shaped, metrics


def reward_metrics(records: Sequence[Trajectory]) -> dict[str, float]:
    """Step means of what the rollout workers wrote into the records (`actors.RewardSources`):
    `reward/<source>_mean` for each reward source, `reward/extra/<key>` for each `extra_logs` key of
    the reward functions (averaged over the records that carry it)."""
    sums: dict[str, list[float]] = {}
    for record in records:
        for source, value in record.extra.get("reward_sources", {}).items():
            sums.setdefault(f"reward/{source}_mean", []).append(float(value))
        for key, value in record.extra.get("reward_logs", {}).items():
            sums.setdefault(f"reward/extra/{key}", []).append(float(value))
    return {name: sum(values) / len(values) for name, values in sums.items()}


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    count = mask.sum()
    return float((values * mask).sum() / count) if count > 0 else 0.0
