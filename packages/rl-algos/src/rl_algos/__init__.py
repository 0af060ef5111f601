"""rl_algos: advantage estimators and losses for RL post-training of language models.

Pure functions over torch tensors; torch and the standard library are the only imports.
Shapes follow one convention: `[batch, seq]` for per-token tensors (response tokens, with an
`action_mask` that is 1 on tokens the policy chose) and `[batch]` for per-sequence ones.

    from rl_algos import ADVANTAGE_ESTIMATORS, POLICY_LOSSES, aggregate_loss

    advantages, returns = compute_advantages("grpo", rewards=r, group_ids=g, action_mask=m)
    per_token, metrics = POLICY_LOSSES["ppo"](logprobs, old_logprobs, advantages, m)
    loss = aggregate_loss(per_token, m, "token-mean", normalizer=global_token_count)

    # or the whole objective (policy term × IS weights + β·KL − c·entropy) in one call:
    loss, metrics = policy_objective(logprobs, old_logprobs, advantages, m, loss="ppo",
                                     normalizer=global_token_count, ref_logprobs=ref, kl_coef=0.01)
"""

from .__about__ import __version__
from .aggregation import AGGREGATION_MODES, aggregate_loss, loss_normalizer
from .corrections import (
    CORRECTION_GATINGS,
    CORRECTION_LEVELS,
    CORRECTION_METHODS,
    CORRECTION_MODES,
    CORRECTIONS,
    MASK_WEIGHTS,
    mismatch_metrics,
    rollout_correction,
)
from .distillation import reverse_kl_rewards, teacher_log_ratio
from .estimators import ADVANTAGE_ESTIMATORS, REWARD_TO_GO_PRESETS, compute_advantages
from .group import CENTRES, GROUP_NORM_PRESETS, SCALES, SINGLETON_POLICIES, group_normalize
from .kl import KL_ESTIMATORS, AdaptiveKLController, FixedKLController, StraightThroughKL, kl_penalty
from .logprobs import default_chunk_size, entropy_from_logits, logprobs_from_logits
from .masked import last_action_index, masked_mean, masked_mean_var, masked_sum, masked_whiten
from .moe import expert_load_metrics, load_balancing_loss, replayed_gate_weights, route_mismatch
from .objective import policy_objective
from .policy_losses import POLICY_LOSSES, value_loss
from .preference import dpo_loss, kto_loss, reward_model_loss
from .registry import Registry, UnknownNameError
from .returns import compute_discounted_returns, compute_gae, discounted_reverse_cumsum
from .rewards import (
    clip_rewards,
    dynamic_filter_mask,
    overlong_penalty,
    stop_properly_penalty,
    token_level_rewards,
)
from .rows import (
    SegmentLayout,
    contiguous_group_ids,
    expand_to_tokens,
    join_segments,
    segment_layout,
    split_segments,
)
from .running import RunningMoments, merge_moments
from .supervised import distillation_loss, prm_loss, sft_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATION_MODES",
    "CENTRES",
    "CORRECTIONS",
    "CORRECTION_GATINGS",
    "CORRECTION_LEVELS",
    "CORRECTION_METHODS",
    "CORRECTION_MODES",
    "GROUP_NORM_PRESETS",
    "KL_ESTIMATORS",
    "MASK_WEIGHTS",
    "POLICY_LOSSES",
    "REWARD_TO_GO_PRESETS",
    "SCALES",
    "SINGLETON_POLICIES",
    "AdaptiveKLController",
    "FixedKLController",
    "Registry",
    "RunningMoments",
    "SegmentLayout",
    "StraightThroughKL",
    "UnknownNameError",
    "__version__",
    "aggregate_loss",
    "clip_rewards",
    "compute_advantages",
    "compute_discounted_returns",
    "compute_gae",
    "contiguous_group_ids",
    "default_chunk_size",
    "discounted_reverse_cumsum",
    "distillation_loss",
    "dpo_loss",
    "dynamic_filter_mask",
    "entropy_from_logits",
    "expand_to_tokens",
    "expert_load_metrics",
    "group_normalize",
    "join_segments",
    "kl_penalty",
    "kto_loss",
    "last_action_index",
    "load_balancing_loss",
    "logprobs_from_logits",
    "loss_normalizer",
    "masked_mean",
    "masked_mean_var",
    "masked_sum",
    "masked_whiten",
    "merge_moments",
    "mismatch_metrics",
    "overlong_penalty",
    "policy_objective",
    "prm_loss",
    "replayed_gate_weights",
    "reverse_kl_rewards",
    "reward_model_loss",
    "rollout_correction",
    "route_mismatch",
    "segment_layout",
    "sft_loss",
    "split_segments",
    "stop_properly_penalty",
    "teacher_log_ratio",
    "token_level_rewards",
    "value_loss",
]
