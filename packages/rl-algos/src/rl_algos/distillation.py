"""On-policy distillation: the student samples, a frozen teacher scores every sampled token.

Notation: y ~ π (the student, the policy being trained) is a sampled response, π_T the teacher,
m_t the action mask, d_t = log π(y_t | y_<t) − log π_T(y_t | y_<t) the per-token log-ratio at
the sampled token. The sequence-level reverse KL factorises over the student's own prefixes:

    KL(π ‖ π_T) = E_{y~π} [ Σ_t d_t ]

so −d_t is a dense per-token reward whose expected return is −KL, and any policy-gradient
estimator that reads token rewards (reinforce, reinforce_baseline, gae, group_reward_to_go)
minimises the reverse KL by maximising it (Agarwal et al. 2024, "GKD"; Lu & Thinking Machines
2025, "On-policy distillation"). Reverse KL is mode-seeking: the student is pushed off tokens the
teacher finds unlikely rather than made to cover every teacher mode.

Two ways in, both named by `rl-launch ppo`'s `algo.distill.mode`:

  reward   `reverse_kl_rewards`: r_t = −β_d·d_t·m_t added to the token rewards (the log-probs
           are constants there; the policy-gradient estimator carries the gradient). With or
           without the outcome reward.
  loss     a KL term in the policy loss, β_d·agg(k(d_t)) with a `kl_penalty` estimator k, as
           the reference KL in the loss (`policy_objective(teacher_logprobs=...)`). Pick the
           estimator for the gradient it gives under the student's own samples: k2's gradient
           d_t·∇log π is the per-token reverse-KL gradient; k3's (1 − π_T/π)·∇log π has the
           expectation −Σ_v π_T ∇log π, the FORWARD KL's gradient; k1's expectation is 0.

Only the sampled token's teacher log-prob is needed (no teacher logits in the experience); a
top-k forward KL from teacher logits is not here.
"""

from __future__ import annotations

import torch

from ._checks import check_floating, check_ndim, check_positive, check_same_shape, compute_dtype, mask_as

__all__ = ["reverse_kl_rewards", "teacher_log_ratio"]


def teacher_log_ratio(
    logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, action_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token d_t = log π − log π_T at the action tokens and its mean over them.

        d_t = (log π(y_t) − log π_T(y_t))·m_t,     mean = Σ d_t / Σ m_t   (0 with no action token)

    The mean is the per-token sample estimate of KL(π ‖ π_T) when y ~ π (it is ≥ 0 only in
    expectation; a batch may give a negative value). `rl-launch ppo` logs it as
    `distill/kl_to_teacher`.

    Args:
      logprobs: `[batch, seq]` log π of the sampled tokens (the student's).
      teacher_logprobs: `[batch, seq]` log π_T of the same tokens.
      action_mask: `[batch, seq]` 1 on tokens the student chose.

    Returns:
      (`[batch, seq]` d·m in float32 (float64 for float64 inputs), 0-d mean of d over action tokens).

    Worked values: log π = [[−1, −2, 0]], log π_T = [[−1.5, −1, 0]], m = [[1, 1, 0]] →
    d·m = [[0.5, −1, 0]], mean −0.25.
    """
    check_ndim("logprobs", logprobs, 2, "[batch, seq]")
    check_floating("logprobs", logprobs)
    check_floating("teacher_logprobs", teacher_logprobs)
    check_same_shape("teacher_logprobs", teacher_logprobs, "logprobs", logprobs)
    dtype = compute_dtype(logprobs, teacher_logprobs)
    mask = mask_as("action_mask", action_mask, logprobs.to(dtype), "logprobs")
    ratio = (logprobs.to(dtype) - teacher_logprobs.to(dtype)) * mask
    return ratio, ratio.sum() / mask.sum().clamp(min=1)


def reverse_kl_rewards(
    logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    coef: float,
) -> torch.Tensor:
    """Dense distillation rewards: r_t = −β_d·(log π(y_t) − log π_T(y_t))·m_t (module docstring).

    Add them to the token rewards (`token_level_rewards`) of an estimator that reads token rewards;
    the return Σ_t r_t of a response is −β_d times its reverse-KL sample estimate. The log-probs
    are detached: the reward carries no gradient.

    Args:
      logprobs: `[batch, seq]` log π of the sampled tokens (the student's, e.g. the old log-probs).
      teacher_logprobs: `[batch, seq]` log π_T of the same tokens.
      action_mask: `[batch, seq]` 1 on tokens the student chose.
      coef: β_d ≥ 0.

    Returns:
      `[batch, seq]` float32 (float64 for float64 inputs), 0 off the action tokens.

    Worked values: log π = [[−1, −2, 0]], log π_T = [[−1.5, −1, 0]], m = [[1, 1, 0]], β_d = 0.5 →
    [[−0.25, 0.5, 0]]: the token the teacher likes less than the student is penalised, the one it
    likes more is rewarded.
    """
    check_positive("coef", coef, allow_zero=True)
    ratio, _ = teacher_log_ratio(logprobs.detach(), teacher_logprobs.detach(), action_mask)
    return -coef * ratio
