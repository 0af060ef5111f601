"""An example `rl-launch ppo --plugin`: one advantage estimator and one policy loss of its own.

    rl-launch ppo --plugin tests/launch/plugin_example.py \\
        --algo.advantage.estimator plugin_centered --algo.policy.loss plugin_pg

Importing it registers both names; the launcher imports it once in the driver and once in every
Ray actor. Each execution of this file bumps a per-process counter kept on the `sys` module
(which outlives any copy of this module), so a second execution in one process shows as 2, and
prints one line that the tests count in the actors' log files.
"""

from __future__ import annotations

import os
import sys

import torch

from rl_algos import ADVANTAGE_ESTIMATORS, POLICY_LOSSES, group_normalize, masked_mean

IMPORT_LINE = "plugin_example: imported"

sys.plugin_example_executions = getattr(sys, "plugin_example_executions", 0) + 1
EXECUTIONS: int = sys.plugin_example_executions
"""How many times this file has run in this process: 1 unless something imported it twice."""

print(f"{IMPORT_LINE} (execution {EXECUTIONS} in pid {os.getpid()})", flush=True)


@ADVANTAGE_ESTIMATORS.register("plugin_centered")
def plugin_centered(
    *, rewards: torch.Tensor, group_ids: torch.Tensor, action_mask: torch.Tensor, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """A_i = scale·(r_i − mean_g r), broadcast over the action tokens of sample i.

    Args:
      rewards: `[batch]` outcome rewards.
      group_ids: `[batch]` prompt group of each sample (a group of one gets 0).
      action_mask: `[batch, seq]` 1 on tokens the policy chose.
      scale: multiplies every advantage.

    Returns:
      (advantages, returns), both `[batch, seq]` float32, zero off the mask; returns equal the
      advantages (no critic to fit), as for the built-in outcome estimators.
    """
    centred = group_normalize(rewards, group_ids, centre="group", scale="none")
    advantages = scale * centred.float()[:, None] * action_mask.float()
    return advantages, advantages.clone()


@POLICY_LOSSES.register("plugin_pg")
def plugin_pg(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    log_ratio_clamp: float = 20.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A plain importance-weighted policy gradient: l_t = −A_t·ρ_t, no clipping.

    ρ_t = exp(clamp(log π_t − log π_old,t, ±log_ratio_clamp)). The per-token loss is zero off
    the mask; the learner's aggregation (token-mean by default) turns it into the masked token
    mean, like every `rl_algos` policy loss.

    Returns:
      (per-token loss `[batch, seq]` float32, metrics of detached 0-d tensors: ppo_kl, ratio_mean).
    """
    mask = action_mask.float()
    log_ratio = (logprobs.float() - old_logprobs.detach().float()).clamp(-log_ratio_clamp, log_ratio_clamp)
    ratio = log_ratio.exp()
    loss = -advantages.detach().float() * ratio * mask
    metrics = {
        "ppo_kl": masked_mean(-log_ratio.detach(), mask),
        "ratio_mean": masked_mean(ratio.detach(), mask),
    }
    return loss, metrics
