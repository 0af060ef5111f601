"""Preference losses: learn from comparisons between responses instead of from a reward signal.

Direct alignment (DPO, cDPO, IPO, KTO) trains the policy itself from preferences, with a frozen
reference model standing in for the KL anchor of RLHF; `reward_model_loss` trains a scalar
reward model from the same kind of pairs, for later use by an RL algorithm.

Every sequence-level input is a `[batch]` tensor. Log-probabilities are SUMMED over the response
tokens of each sequence (e.g. `masked_sum(token_logprobs, response_mask, dim=-1)`); any floating
dtype is accepted and the arithmetic is done in float32.

Each function returns `(losses, metrics)`:

  losses   `[batch]` float32 per-example losses. The caller reduces them; the usual choice is
           `losses.sum() / n` where n is the number of examples in the whole optimiser step
           (over micro-batches and ranks), so that gradient accumulation does not change the
           objective. `losses.mean()` is that reduction for a single micro-batch on one rank.
  metrics  a dict of detached 0-d tensors worth logging (means over the local batch).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ._checks import (
    check_choice,
    check_finite,
    check_floating,
    check_ndim,
    check_nonempty,
    check_positive,
    check_same_shape,
)
from .masked import AllReduce, masked_mean

__all__ = ["DPO_LOSS_TYPES", "dpo_loss", "kto_loss", "reward_model_loss"]

DPO_LOSS_TYPES = ("sigmoid", "ipo")
"""Values accepted by `dpo_loss(loss_type=...)`."""


def _check_sequence_values(names_and_values: list[tuple[str, object]]) -> torch.Tensor:
    """Each value must be a non-empty floating `[batch]` tensor shaped like the first."""
    first_name, first = names_and_values[0]
    check_ndim(first_name, first, 1, "[batch]")
    check_floating(first_name, first)
    check_nonempty(first_name, first)
    for name, value in names_and_values[1:]:
        check_ndim(name, value, 1, "[batch]")
        check_floating(name, value)
        check_same_shape(name, value, first_name, first)
    return first


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    reference_chosen_logps: torch.Tensor,
    reference_rejected_logps: torch.Tensor,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    loss_type: str = "sigmoid",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Direct preference optimisation loss on pairs (chosen y_w, rejected y_l) of responses.

    The policy's implicit reward is r(x, y) = β·log(π(y|x) / π_ref(y|x)); DPO fits it to the
    preferences with a Bradley–Terry likelihood. With the log-ratio margin

      z = (log π(y_w|x) − log π(y_l|x)) − (log π_ref(y_w|x) − log π_ref(y_l|x)),

    the per-pair losses are

      "sigmoid":  −(1 − ε)·log σ(β·z) − ε·log σ(−β·z)
      "ipo":      (z − 1/(2β))²

    where ε is `label_smoothing`: with ε > 0 (conservative DPO) each label is assumed flipped
    with probability ε, which bounds the loss's push on z. IPO regresses z onto a finite
    target instead of pushing it to infinity, so it does not overfit deterministic
    preferences. Some implementations feed IPO length-averaged log-probabilities; this one uses
    whatever it is given (summed, per the module convention).

    See "Direct Preference Optimization: Your Language Model is Secretly a Reward Model" by
    Rafailov et al. 2023 (https://arxiv.org/abs/2305.18290); "A General Theoretical Paradigm to
    Understand Learning from Human Preferences" by Azar et al. 2023 (IPO,
    https://arxiv.org/abs/2310.12036); "A note on DPO with noisy preferences & relationship to
    IPO" by Mitchell 2023 (cDPO, https://ericmitchell.ai/cdpo.pdf).

    Args:
      policy_chosen_logps: `[batch]` summed log π(y_w|x) of the chosen responses (with grad).
      policy_rejected_logps: `[batch]` summed log π(y_l|x) of the rejected responses.
      reference_chosen_logps: `[batch]` summed log π_ref(y_w|x) (the reference is frozen, so
        these are usually computed under `torch.no_grad()`).
      reference_rejected_logps: `[batch]` summed log π_ref(y_l|x).
      beta: β > 0, the strength of the implicit KL penalty (smaller β strays further from
        π_ref).
      label_smoothing: ε in [0, 0.5), the assumed probability that a preference label is wrong;
        0 is plain DPO. Only for loss_type "sigmoid".
      loss_type: "sigmoid" (DPO / cDPO) or "ipo".

    Returns:
      (losses, metrics): losses `[batch]` float32; metrics with the means of the implicit
      rewards "chosen_rewards" = β·(log π(y_w|x) − log π_ref(y_w|x)) and "rejected_rewards",
      "reward_margin" (mean of their difference, β·z) and "reward_accuracy" (fraction of pairs
      whose chosen reward is strictly larger).
    """
    check_positive("beta", beta)
    check_choice("loss_type", loss_type, DPO_LOSS_TYPES)
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float)):
        raise TypeError(f"label_smoothing must be a number, got {label_smoothing!r}")
    if not 0.0 <= label_smoothing < 0.5:  # also rejects NaN
        raise ValueError(
            f"label_smoothing must be in [0, 0.5), got {label_smoothing}; at 0.5 the loss ignores the "
            "preference and above 0.5 it prefers the rejected response"
        )
    if loss_type == "ipo" and label_smoothing != 0:
        raise ValueError(
            f"label_smoothing must be 0 with loss_type='ipo' (it applies to 'sigmoid' only), "
            f"got {label_smoothing}"
        )
    _check_sequence_values(
        [
            ("policy_chosen_logps", policy_chosen_logps),
            ("policy_rejected_logps", policy_rejected_logps),
            ("reference_chosen_logps", reference_chosen_logps),
            ("reference_rejected_logps", reference_rejected_logps),
        ]
    )

    chosen_logratios = policy_chosen_logps.float() - reference_chosen_logps.float()
    rejected_logratios = policy_rejected_logps.float() - reference_rejected_logps.float()
    # z grouped by response rather than by model: the two forms are equal, and this one keeps the
    # implicit rewards (needed for the metrics) as intermediate values.
    z = chosen_logratios - rejected_logratios

    if loss_type == "sigmoid":
        # logsigmoid rather than log(sigmoid(.)): the latter underflows to log(0) = -inf once β·z
        # is below about -100 in float32.
        losses = -F.logsigmoid(beta * z)
        if label_smoothing > 0:
            losses = (1 - label_smoothing) * losses - label_smoothing * F.logsigmoid(-beta * z)
    else:
        losses = (z - 1.0 / (2.0 * beta)) ** 2

    with torch.no_grad():
        chosen_rewards = beta * chosen_logratios
        rejected_rewards = beta * rejected_logratios
        metrics = {
            "chosen_rewards": chosen_rewards.mean(),
            "rejected_rewards": rejected_rewards.mean(),
            "reward_margin": (chosen_rewards - rejected_rewards).mean(),
            "reward_accuracy": (chosen_rewards > rejected_rewards).float().mean(),
        }
    return losses, metrics


def kto_loss(
    policy_logps: torch.Tensor,
    reference_logps: torch.Tensor,
    desirable: torch.Tensor,
    policy_kl_logps: torch.Tensor,
    reference_kl_logps: torch.Tensor,
    *,
    beta: float = 0.01,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    all_reduce: AllReduce | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Kahneman–Tversky optimisation loss on unpaired responses labelled good or bad.

    Each example is a single response y to a prompt x with a binary label. With the log-ratio
    ρ = log π(y|x) − log π_ref(y|x) and a reference point z_ref estimating KL(π ‖ π_ref),

      z_ref = max(0, mean_j [log π(y'_j|x_j) − log π_ref(y'_j|x_j)])   (no gradient)
      desirable:    λ_D·(1 − σ(β·(ρ − z_ref)))
      undesirable:  λ_U·(1 − σ(β·(z_ref − ρ)))

    The KL pairs (x_j, y'_j) are deliberately mismatched (a completion paired with another
    example's prompt, as OpenRLHF built them), so the estimate does not depend on whether the
    examples themselves are good. z_ref is a baseline, not a quantity to optimise, hence it
    carries no gradient. λ_D and λ_U compensate for an imbalance of desirable and undesirable
    examples; the paper suggests λ_D·n_D / (λ_U·n_U) in [1, 4/3].

    See "KTO: Model Alignment as Prospect Theoretic Optimization" by Ethayarajh et al. 2024
    (https://arxiv.org/abs/2402.01306).

    Args:
      policy_logps: `[batch]` summed log π(y|x) of each example's response (with grad).
      reference_logps: `[batch]` summed log π_ref(y|x).
      desirable: `[batch]` bool, True where the response is labelled desirable.
      policy_kl_logps: `[kl_batch]` summed log π(y'|x) on the mismatched KL pairs.
      reference_kl_logps: `[kl_batch]` summed log π_ref(y'|x) on the same pairs.
      beta: β > 0, the scale of the implicit reward β·ρ.
      desirable_weight: λ_D ≥ 0, the weight of desirable examples' losses.
      undesirable_weight: λ_U ≥ 0, the weight of undesirable examples' losses.
      all_reduce: optional callable that sums a tensor over data-parallel ranks in place (e.g.
        ``lambda t: torch.distributed.all_reduce(t)``); z_ref is then the mean over every
        rank's KL pairs rather than this rank's alone. Every rank must make the call.

    Returns:
      (losses, metrics): losses `[batch]` float32; metrics "kl" (z_ref), "desirable_rewards"
      and "undesirable_rewards" (means of β·ρ over each subset, 0 for an empty subset),
      "num_desirable" and "num_undesirable" (local counts).
    """
    check_positive("beta", beta)
    check_positive("desirable_weight", desirable_weight, allow_zero=True)
    check_positive("undesirable_weight", undesirable_weight, allow_zero=True)
    first = _check_sequence_values([("policy_logps", policy_logps), ("reference_logps", reference_logps)])
    check_same_shape("desirable", desirable, "policy_logps", first)
    if desirable.dtype != torch.bool:
        raise TypeError(f"desirable must be a bool tensor, got dtype {desirable.dtype} (use .bool())")
    check_ndim("policy_kl_logps", policy_kl_logps, 1, "[kl_batch]")
    check_floating("policy_kl_logps", policy_kl_logps)
    check_ndim("reference_kl_logps", reference_kl_logps, 1, "[kl_batch]")
    check_floating("reference_kl_logps", reference_kl_logps)
    check_same_shape("reference_kl_logps", reference_kl_logps, "policy_kl_logps", policy_kl_logps)

    with torch.no_grad():
        kl_diff = policy_kl_logps.float() - reference_kl_logps.float()
        # (sum, count) rather than a per-rank mean, so ranks holding different numbers of KL
        # pairs are weighted by what they hold.
        sums = torch.stack([kl_diff.sum(), kl_diff.new_tensor(float(kl_diff.numel()))])
        if all_reduce is not None:
            all_reduce(sums)
        # Clamped because the true KL is non-negative; a negative estimate is sampling noise and
        # would move the reference point the wrong way.
        kl = (sums[0] / sums[1].clamp(min=1)).clamp(min=0)

    logratios = policy_logps.float() - reference_logps.float()
    desirable_losses = desirable_weight * (1 - torch.sigmoid(beta * (logratios - kl)))
    undesirable_losses = undesirable_weight * (1 - torch.sigmoid(beta * (kl - logratios)))
    losses = torch.where(desirable, desirable_losses, undesirable_losses)

    with torch.no_grad():
        rewards = beta * logratios
        undesirable = ~desirable
        metrics = {
            "kl": kl,
            "desirable_rewards": masked_mean(rewards, desirable),
            "undesirable_rewards": masked_mean(rewards, undesirable),
            "num_desirable": desirable.sum().float(),
            "num_undesirable": undesirable.sum().float(),
        }
    return losses, metrics


def reward_model_loss(
    chosen_rewards: torch.Tensor,
    rejected_rewards: torch.Tensor,
    *,
    margin: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Pairwise (Bradley–Terry) loss for training a scalar reward model.

    Under the Bradley–Terry model P(y_w ≻ y_l | x) = σ(r(x, y_w) − r(x, y_l)); the loss is the
    negative log-likelihood of the observed preference, optionally asking the chosen reward to
    win by at least a margin m (larger for pairs rated as clearly different, as in Llama 2):

      −log σ(r_w − r_l − m)

    See "Training language models to follow instructions with human feedback" by Ouyang et al.
    2022 (https://arxiv.org/abs/2203.02155); Bradley & Terry 1952; the margin follows
    "Llama 2: Open Foundation and Fine-Tuned Chat Models" by Touvron et al. 2023.

    Args:
      chosen_rewards: `[batch]` r(x, y_w), the reward model's score of the preferred response.
      rejected_rewards: `[batch]` r(x, y_l), its score of the other response.
      margin: m, None (no margin), a finite number for every pair, or a `[batch]` float tensor
        with one margin per pair.

    Returns:
      (losses, metrics): losses `[batch]` float32; metrics "accuracy" (fraction of pairs with
      r_w > r_l), "chosen_reward" and "rejected_reward" (means) and "reward_margin" (mean of
      r_w − r_l, without m).
    """
    first = _check_sequence_values(
        [("chosen_rewards", chosen_rewards), ("rejected_rewards", rejected_rewards)]
    )
    if isinstance(margin, torch.Tensor):
        check_ndim("margin", margin, 1, "[batch]")
        check_floating("margin", margin)
        check_same_shape("margin", margin, "chosen_rewards", first)
        check_finite("margin", margin)
        margin_value: float | torch.Tensor = margin.float()
    elif margin is None:
        margin_value = 0.0
    elif isinstance(margin, bool) or not isinstance(margin, (int, float)):
        raise TypeError(f"margin must be None, a number or a [batch] tensor, got {type(margin).__name__}")
    elif not math.isfinite(margin):
        raise ValueError(f"margin must be finite, got {margin}")
    else:
        margin_value = float(margin)

    difference = chosen_rewards.float() - rejected_rewards.float()
    losses = -F.logsigmoid(difference - margin_value)

    with torch.no_grad():
        metrics = {
            "accuracy": (difference > 0).float().mean(),
            "chosen_reward": chosen_rewards.float().mean(),
            "rejected_reward": rejected_rewards.float().mean(),
            "reward_margin": difference.mean(),
        }
    return losses, metrics
