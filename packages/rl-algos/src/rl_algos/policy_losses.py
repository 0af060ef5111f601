"""Policy-gradient surrogate losses, found by name in `POLICY_LOSSES`, and the value loss.

Every policy loss has the signature

    loss_fn(logprobs, old_logprobs, advantages, action_mask, **options)
        -> (per_token_loss, metrics)

with `logprobs` `[batch, seq]` (log π_θ of the sampled tokens, carrying the gradient),
`old_logprobs` and `advantages` `[batch, seq]` (treated as constants), and `action_mask`
`[batch, seq]`. The per-token loss (float32; float64 for float64 inputs) is zero where the mask is 0; reduce it with
`rl_algos.aggregate_loss` and a global normaliser. `metrics` holds detached 0-d tensors averaged
over this call's action tokens (ppo_kl = mean(log π_old − log π), clip fractions, ...).

ρ = exp(log π_θ − log π_old), with the log-ratio clamped to ±20 so exp never overflows.

A note users ask about: on-policy with one update per batch, ρ ≡ 1 and the PPO loss value is
−mean(A), about 0 after whitening, while its gradient is the full policy gradient. A flat loss
curve is expected; watch the reward, `ppo_kl` and the clip fractions instead.
"""

from __future__ import annotations

import torch

from ._checks import check_floating, check_ndim, check_positive, check_same_shape, compute_dtype, mask_as
from .masked import masked_mean
from .registry import Registry

__all__ = [
    "LOG_RATIO_CLAMP",
    "POLICY_LOSSES",
    "cispo",
    "clip_cov",
    "gmpo",
    "gspo",
    "gspo_sequence",
    "kl_cov",
    "ppo",
    "reinforce",
    "sapo",
    "value_loss",
    "vanilla",
]

POLICY_LOSSES = Registry("policy loss")

LOG_RATIO_CLAMP = 20.0


def _prepare(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, action_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Check shapes; return (logπ, logπ_old detached, A detached, mask) in the compute dtype."""
    check_ndim("logprobs", logprobs, 2, "[batch, seq]")
    check_floating("logprobs", logprobs)
    check_same_shape("old_logprobs", old_logprobs, "logprobs", logprobs)
    check_same_shape("advantages", advantages, "logprobs", logprobs)
    dtype = compute_dtype(logprobs)
    mask = mask_as("action_mask", action_mask, logprobs, "logprobs").to(dtype)
    return logprobs.to(dtype), old_logprobs.detach().to(dtype), advantages.detach().to(dtype), mask


def _mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return masked_mean(values.detach(), mask).float()


def _check_epsilons(epsilon_low: float, epsilon_high: float | None) -> float:
    check_positive("epsilon_low", epsilon_low)
    if epsilon_low >= 1:
        raise ValueError(
            f"epsilon_low must be in (0, 1) so that the lower bound 1 − ε is positive, got {epsilon_low}"
        )
    if epsilon_high is None:
        return epsilon_low
    return check_positive("epsilon_high", epsilon_high)


def _ppo_clip(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    epsilon_low: float,
    epsilon_high: float,
    dual_clip: float | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - epsilon_low, 1.0 + epsilon_high)
    loss = torch.maximum(unclipped, clipped)
    metrics = {
        "clip_fraction": _mean((clipped > unclipped).float(), mask),
        "clip_fraction_low": _mean(((ratio < 1.0 - epsilon_low) & (advantages < 0)).float(), mask),
        "clip_fraction_high": _mean(((ratio > 1.0 + epsilon_high) & (advantages > 0)).float(), mask),
    }
    if dual_clip is not None:
        # For A < 0 the clipped objective is unbounded as ρ grows; cap the loss at −c·A.
        cap = -dual_clip * advantages
        dual = (advantages < 0) & (loss > cap)
        loss = torch.where(dual, cap, loss)
        metrics["dual_clip_fraction"] = _mean(dual.float(), mask)
    return loss * mask, metrics


@POLICY_LOSSES.register("ppo")
def ppo(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped PPO surrogate (Schulman et al., 2017) with clip-higher and dual clip.

        l_t = max(−ρ_t·A_t, −clip(ρ_t, 1 − ε_low, 1 + ε_high)·A_t)
        dual clip (A_t < 0):  l_t = min(l_t, −c·A_t)

    Worked values, ε_low 0.2, ε_high 0.28, c 3: A = [1, −1, 1, −1], ρ = [1.5, 1.5, 0.5, 5.0]
    → l = [−1.28, 1.5, −0.5, 3.0].

    Args:
      epsilon_low: ε_low in (0, 1); default 0.2.
      epsilon_high: ε_high > 0 (DAPO clip-higher: 0.28); None means ε_low.
      dual_clip: c > 1 (Ye et al., 2020; verl uses 3), or None for no dual clip.
    """
    logp, old, adv, mask = _prepare(logprobs, old_logprobs, advantages, action_mask)
    epsilon_high = _check_epsilons(epsilon_low, epsilon_high)
    _check_dual_clip(dual_clip)
    log_ratio = (logp - old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    loss, metrics = _ppo_clip(log_ratio.exp(), adv, mask, epsilon_low, epsilon_high, dual_clip)
    metrics["ppo_kl"] = _mean(-log_ratio, mask)
    return loss, metrics


@POLICY_LOSSES.register("gspo")
def gspo(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    epsilon_low: float = 3e-4,
    epsilon_high: float | None = 4e-4,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (Zheng et al., 2025), GSPO-token form (verl): PPO clipping on the sequence ratio.

        log s_i = Σ_t m·(log π − log π_old) / L_i
        ρ_{i,t} = exp(log π_t − sg(log π_t) + sg(log s_i))   (value s_i, gradient of log π_t)
        l_{i,t} = max(−ρ_{i,t}·A_{i,t}, −clip(ρ_{i,t}, 1 − ε_low, 1 + ε_high)·A_{i,t})

    Aggregate with `seq-mean-token-mean` for the paper's sequence-level objective. The paper's
    clip range is tiny (3e-4, 4e-4) because it applies to a length-normalised ratio. Token t's
    gradient is −A_{i,t}·s_i/L_i (unclipped); OpenRLHF differentiates s_i itself instead, which
    is `gspo_sequence` (equal for advantages constant over a sequence).
    """
    logp, old, adv, mask = _prepare(logprobs, old_logprobs, advantages, action_mask)
    epsilon_high = _check_epsilons(epsilon_low, epsilon_high)
    lengths = mask.sum(-1, keepdim=True).clamp(min=1)
    seq_log_ratio = (((logp - old) * mask).sum(-1, keepdim=True) / lengths).clamp(
        -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP
    )
    token_log_ratio = logp - logp.detach() + seq_log_ratio.detach()
    loss, metrics = _ppo_clip(token_log_ratio.exp(), adv, mask, epsilon_low, epsilon_high, None)
    metrics["ppo_kl"] = _mean(old - logp, mask)
    metrics["sequence_ratio_mean"] = _mean(seq_log_ratio.exp().expand_as(mask), mask)
    return loss, metrics


@POLICY_LOSSES.register("gmpo")
def gmpo(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    epsilon_low: float = 0.4,
    epsilon_high: float | None = 0.4,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GMPO (Zhao et al., 2025): maximise the geometric mean of clipped token ratios.

    With log-space clipping of d_t = log π_t − log π_old,t to [−ε_low, ε_high], sign-aware like
    PPO (s = sign(Â_i)):
        d̃_t = s·min(s·d_t, s·clip(d_t, −ε_low, ε_high))
        l_i = −Â_i·exp(Σ_t m·d̃_t / L_i),   Â_i = Σ_t m·A_{i,t} / L_i
    The sequence loss l_i is placed on every action token of i, so `seq-mean-token-mean`
    aggregation gives mean_i l_i (the paper's objective) and each token gets l_i's gradient.
    """
    logp, old, adv, mask = _prepare(logprobs, old_logprobs, advantages, action_mask)
    epsilon_high = _check_epsilons(epsilon_low, epsilon_high)
    lengths = mask.sum(-1).clamp(min=1)
    log_ratio = (logp - old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    seq_adv = (adv * mask).sum(-1) / lengths
    sign = torch.sign(seq_adv)[:, None]
    clipped = log_ratio.clamp(-epsilon_low, epsilon_high)
    chosen = sign * torch.minimum(sign * log_ratio, sign * clipped)
    seq_loss = -seq_adv * ((chosen * mask).sum(-1) / lengths).exp()
    metrics = {
        "clip_fraction": _mean((chosen != log_ratio).float(), mask),
        "ppo_kl": _mean(-log_ratio, mask),
    }
    return seq_loss[:, None] * mask, metrics


@POLICY_LOSSES.register("cispo")
def cispo(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    epsilon_low: float | None = None,
    epsilon_high: float = 4.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO (MiniMax, 2025): clip the importance weight, never the gradient.

        l_t = −sg(clip(ρ_t, 1 − ε_low, 1 + ε_high))·A_t·log π_t

    Every token keeps a gradient, scaled by its truncated weight. `epsilon_low=None` caps ρ from
    above only (TRL; the default cap 1 + 4.0 = 5.0 is TRL's recommended 5); give ε_low to clip
    both sides (verl).
    """
    logp, old, adv, mask = _prepare(logprobs, old_logprobs, advantages, action_mask)
    check_positive("epsilon_high", epsilon_high)
    lower = None
    if epsilon_low is not None:
        _check_epsilons(epsilon_low, epsilon_high)
        lower = 1.0 - epsilon_low
    log_ratio = (logp - old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = log_ratio.exp().detach()
    weight = ratio.clamp(min=lower, max=1.0 + epsilon_high)
    loss = -weight * adv * logp
    metrics = {"clip_fraction": _mean((weight != ratio).float(), mask), "ppo_kl": _mean(-log_ratio, mask)}
    return loss * mask, metrics


@POLICY_LOSSES.register("sapo")
def sapo(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    tau_positive: float = 1.0,
    tau_negative: float = 1.05,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SAPO (Gao et al., 2025): a smooth, temperature-controlled gate instead of a hard clip.

        l_t = −σ(τ·(ρ_t − 1))·(4/τ)·A_t,   τ = τ_pos if A_t > 0 else τ_neg

    At ρ = 1 the gradient equals the policy gradient (σ'(0)·4 = 1) and it decays smoothly as ρ
    moves away; a larger τ_neg damps negative-advantage tokens faster.
    """
    logp, old, adv, mask = _prepare(logprobs, old_logprobs, advantages, action_mask)
    check_positive("tau_positive", tau_positive)
    check_positive("tau_negative", tau_negative)
    log_ratio = (logp - old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = log_ratio.exp()
    tau = torch.where(adv > 0, tau_positive, tau_negative)
    loss = -torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau) * adv
    metrics = {"ppo_kl": _mean(-log_ratio, mask), "ratio_mean": _mean(ratio, mask)}
    return loss * mask, metrics


@POLICY_LOSSES.register("reinforce", aliases=("gpg",))
def reinforce(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """REINFORCE / GPG: no ratio and no clip, l_t = −A_t·log π_t (verl's `gpg`).

    `old_logprobs` is used only for the `ppo_kl` metric. Not verl's `vanilla`, which is the
    clipped PPO loss (see `vanilla`).
    """
    logp, old, adv, mask = _prepare(logprobs, old_logprobs, advantages, action_mask)
    return -adv * logp * mask, {"ppo_kl": _mean(old - logp, mask)}


@POLICY_LOSSES.register("vanilla")
def vanilla(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
    dual_clip: float | None = 3.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """verl's `vanilla` policy loss: clipped PPO with the dual clip on (c = 3) by default.

    The same per-token loss as `ppo` (see there); only the `dual_clip` default differs, so a
    verl config that names `vanilla` gets verl's algorithm. REINFORCE (−A·log π, no ratio) is
    `reinforce` / `gpg`. Worked value: log π = log π_old = −1, A = 1 → l = −1.
    """
    return ppo(
        logprobs,
        old_logprobs,
        advantages,
        action_mask,
        epsilon_low=epsilon_low,
        epsilon_high=epsilon_high,
        dual_clip=dual_clip,
    )


@POLICY_LOSSES.register("gspo_sequence")
def gspo_sequence(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    epsilon_low: float = 3e-4,
    epsilon_high: float | None = 4e-4,
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO as OpenRLHF computes it: the clipped loss of the sequence ratio itself.

        s_i = exp(clamp(Σ_t m·(log π − log π_old) / L_i, ±20))      (carries the gradient)
        l_{i,t} = max(−s_i·A_{i,t}, −clip(s_i, 1 − ε_low, 1 + ε_high)·A_{i,t})   (+ dual clip)

    Every token's loss depends on every log π of its sequence: ∂l_{i,t}/∂log π_{i,k} =
    −A_{i,t}·s_i/L_i (unclipped). `gspo` (verl, the paper's GSPO-token) gives token t only its
    own −A_{i,t}·s_i/L_i·[t = k]. The two are equal when A is constant over each sequence (the
    outcome estimators) and differ otherwise. Worked gradients, one sequence of two tokens,
    π = π_old, A = [1, 3], `seq-mean-token-mean`: `gspo` [−0.5, −1.5]; `gspo_sequence`
    [−1.0, −1.0]. OpenRLHF aggregates GSPO per sequence (`seq-mean-token-mean`).
    """
    logp, old, adv, mask = _prepare(logprobs, old_logprobs, advantages, action_mask)
    epsilon_high = _check_epsilons(epsilon_low, epsilon_high)
    _check_dual_clip(dual_clip)
    lengths = mask.sum(-1, keepdim=True).clamp(min=1)
    seq_log_ratio = (((logp - old) * mask).sum(-1, keepdim=True) / lengths).clamp(
        -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP
    )
    ratio = seq_log_ratio.exp().expand_as(logp)
    loss, metrics = _ppo_clip(ratio, adv, mask, epsilon_low, epsilon_high, dual_clip)
    metrics["ppo_kl"] = _mean(old - logp, mask)
    metrics["sequence_ratio_mean"] = _mean(ratio, mask)
    return loss, metrics


def _centred_covariance(
    logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(A − mean A)·(log π − mean log π) per token, means over this call's action tokens; and
    the number of action tokens."""
    keep = mask > 0
    count = keep.sum()
    adv_mean = masked_mean(adv, mask)
    logp_mean = masked_mean(logp.detach(), mask)
    return (adv - adv_mean) * (logp.detach() - logp_mean), count


@POLICY_LOSSES.register("clip_cov")
def clip_cov(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
    clip_cov_ratio: float = 2e-4,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clip-Cov (Cui et al., 2025, "The Entropy Mechanism of RL for Reasoning LMs"; verl).

    PPO's clipped loss, with the gradient cut off on a few tokens whose centred covariance
    between advantage and log-probability is large (they drive entropy collapse):

        c_t = (A_t − mean A)·(log π_t − mean log π)     (means over this call's action tokens)
        candidates: action tokens not already clipped by PPO with lb < c_t < ub
        n = max(1, ⌊r·N⌋) of them (N action tokens; a random subset if there are more)
        l_t = 0 on those n tokens, the PPO loss max(−ρA, −clip(ρ)·A) elsewhere

    Args:
      clip_cov_ratio: r, the fraction of action tokens to cut (verl: 2e-4).
      clip_cov_lb, clip_cov_ub: the covariance window (verl: 1, 5).
      generator: for the random choice when more than n tokens qualify (None: torch's global RNG).

    The covariance is over the tokens of this call (verl: the micro-batch), not the whole step.
    """
    logp, old, adv, mask = _prepare(logprobs, old_logprobs, advantages, action_mask)
    epsilon_high = _check_epsilons(epsilon_low, epsilon_high)
    _check_fraction("clip_cov_ratio", clip_cov_ratio)
    if not clip_cov_lb < clip_cov_ub:
        raise ValueError(f"clip_cov_lb must be < clip_cov_ub, got {clip_cov_lb} and {clip_cov_ub}")
    log_ratio = (logp - old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = log_ratio.exp()
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - epsilon_low, 1.0 + epsilon_high)
    clipped_by_ppo = clipped > unclipped
    covariance, count = _centred_covariance(logp, adv, mask)
    eligible = (mask > 0) & ~clipped_by_ppo & (covariance > clip_cov_lb) & (covariance < clip_cov_ub)
    candidates = eligible.flatten().nonzero().flatten()
    budget = max(int(clip_cov_ratio * int(count)), 1)
    if candidates.numel() > budget:
        order = torch.randperm(candidates.numel(), generator=generator).to(candidates.device)
        candidates = candidates[order[:budget]]
    keep = torch.ones(mask.numel(), dtype=mask.dtype, device=mask.device)
    keep[candidates] = 0.0
    keep = keep.view_as(mask)
    loss = torch.maximum(unclipped, clipped) * keep * mask
    metrics = {
        "clip_fraction": _mean(clipped_by_ppo.float(), mask),
        "cov_clip_fraction": _mean((keep == 0).float(), mask),
        "ppo_kl": _mean(-log_ratio, mask),
    }
    return loss, metrics


@POLICY_LOSSES.register("kl_cov")
def kl_cov(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    kl_cov_ratio: float = 2e-4,
    ppo_kl_coef: float = 0.1,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL-Cov (Cui et al., 2025; verl): a KL penalty on the tokens of largest covariance.

        c_t = (A_t − mean A)·(log π_t − mean log π)     (means over this call's action tokens)
        K = the n = max(1, ⌊r·N⌋) action tokens of largest c_t
        l_t = −ρ_t·A_t + k·|log π_t − log π_old,t|·[t ∈ K]

    No ratio clipping anywhere (ρ's log is clamped to ±20 only against overflow).

    Args:
      kl_cov_ratio: r, the fraction of action tokens to penalise (verl: 2e-4).
      ppo_kl_coef: k ≥ 0 (verl's config default, `actor.policy_loss.ppo_kl_coef: 0.1`; its
        loss function falls back to 1 only when the config holds None).

    Worked values (token-mean): A = [2, 1, 0, −3], log π = [−1, −2, −3, −4], log π_old = log π −
    0.1, defaults: one token (covariance 4.5, the last) is penalised, l = ρ·[−2, −1, 0, 3] +
    [0, 0, 0, 0.1·0.1], mean 0.0025 (k = 1 gave 0.025).
    """
    logp, old, adv, mask = _prepare(logprobs, old_logprobs, advantages, action_mask)
    _check_fraction("kl_cov_ratio", kl_cov_ratio)
    check_positive("ppo_kl_coef", ppo_kl_coef, allow_zero=True)
    log_ratio = (logp - old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    loss = -adv * log_ratio.exp()
    covariance, count = _centred_covariance(logp, adv, mask)
    penalised = torch.zeros(mask.numel(), dtype=torch.bool, device=mask.device)
    if int(count) > 0:
        chosen = max(1, int(int(count) * kl_cov_ratio))
        scores = torch.where(mask > 0, covariance, -torch.inf).flatten()
        penalised[scores.topk(chosen).indices] = True
    penalised = penalised.view_as(mask)
    loss = torch.where(penalised, loss + ppo_kl_coef * (logp - old).abs(), loss)
    metrics = {
        "kl_cov_fraction": _mean(penalised.float(), mask),
        "ppo_kl": _mean(-log_ratio, mask),
        "ppo_kl_abs": _mean(log_ratio.abs(), mask),
    }
    return loss * mask, metrics


def _check_fraction(name: str, value: float) -> None:
    check_positive(name, value)
    if value > 1:
        raise ValueError(f"{name} must be a fraction of the action tokens in (0, 1], got {value}")


def _check_dual_clip(dual_clip: float | None) -> None:
    if dual_clip is not None and not dual_clip > 1:
        raise ValueError(
            f"dual_clip must be > 1 (it caps the loss of negative advantages at c·|A|), got {dual_clip}"
        )


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    clip_range: float | None = 0.5,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss (PPO2 / OpenRLHF).

        V_clip = V_old + clip(V − V_old, −ε, ε)
        l_t = 0.5·max((V_t − R_t)², (V_clip,t − R_t)²)      (ε = None: 0.5·(V_t − R_t)²)

    Args:
      values: `[batch, seq]` current critic values (carry the gradient).
      old_values: `[batch, seq]` values when the experience was made.
      returns: `[batch, seq]` targets R.
      action_mask: `[batch, seq]`.
      clip_range: ε > 0, or None for the unclipped loss.

    Returns:
      (per-token loss `[batch, seq]` f32, metrics: value_clip_fraction, value_mean).
    """
    check_ndim("values", values, 2, "[batch, seq]")
    check_floating("values", values)
    check_same_shape("old_values", old_values, "values", values)
    check_same_shape("returns", returns, "values", values)
    dtype = compute_dtype(values)
    mask = mask_as("action_mask", action_mask, values, "values").to(dtype)
    v = values.to(dtype)
    targets = returns.detach().to(dtype)
    unclipped = (v - targets).square()
    metrics = {"value_mean": _mean(v, mask)}
    if clip_range is None:
        return 0.5 * unclipped * mask, metrics
    check_positive("clip_range", clip_range)
    old = old_values.detach().to(dtype)
    # V itself where |V − V_old| ≤ ε: old + (V − old) is V only up to round-off (~3 % of such
    # tokens in float32), which counted ~0.3 % of the unclipped tokens as clipped
    outside = (v - old).abs() > clip_range
    v_clipped = torch.where(outside, old + (v - old).clamp(-clip_range, clip_range), v)
    clipped = (v_clipped - targets).square()
    metrics["value_clip_fraction"] = _mean((clipped > unclipped).float(), mask)
    return 0.5 * torch.maximum(unclipped, clipped) * mask, metrics
