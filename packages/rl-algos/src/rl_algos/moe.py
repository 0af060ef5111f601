"""Mixture-of-experts math: the router load-balancing loss, replayed gate weights, routing metrics.

Switch Transformer's load-balancing loss (Fedus, Zoph & Shazeer 2021, "Switch Transformers",
eqs. 4-6), in its top-k form as Mixtral and Qwen2-MoE train with it. Over the rows r of every
MoE layer's router logits stacked together (R = layers × tokens rows, E experts):

    p_r   = softmax(router_logits_r)                       [E]
    f_e   = (1/R) Σ_r #{e ∈ topk(p_r, k)}                  (Σ_e f_e = k)
    P_e   = (1/R) Σ_r p_r[e]
    L_aux = E · Σ_e f_e · P_e

L_aux is k for perfectly balanced routing (f_e = k/E, P_e = 1/E) and grows as the routing
concentrates; the gradient flows through P (the top-k counts are constants).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._checks import check_ndim

__all__ = ["expert_load_metrics", "load_balancing_loss", "replayed_gate_weights", "route_mismatch"]


def load_balancing_loss(router_logits: Sequence[torch.Tensor], top_k: int) -> torch.Tensor:
    """L_aux (module docstring), a float32 scalar.

    Args:
      router_logits: one [T, E] tensor per MoE layer (T tokens, E experts), the gate's logits
        before the softmax. Every row is counted: pass only real tokens (a packed row has no
        padding; a padded batch must drop its padding rows first).
      top_k: experts each token is routed to (1 <= top_k <= E).

    Example: two tokens routed with logits [[0, 0], [0, 0]] (E = 2, top_k = 1) give
    p = 1/2 everywhere; topk picks expert 0 for both (ties go to the first), so f = [1, 0],
    P = [1/2, 1/2] and L_aux = 2 · (1 · 1/2 + 0) = 1.
    """
    if not router_logits:
        raise ValueError("router_logits is empty: the model ran no MoE layer")
    if isinstance(top_k, bool) or not isinstance(top_k, int):
        raise TypeError(f"top_k must be an int, got {top_k!r}")
    experts = router_logits[0].shape[-1] if router_logits[0].ndim == 2 else -1
    for index, layer in enumerate(router_logits):
        check_ndim(f"router_logits[{index}]", layer, 2, "[tokens, experts]")
        if layer.shape[-1] != experts:
            raise ValueError(
                f"router_logits[{index}] has {layer.shape[-1]} experts, router_logits[0] has {experts}"
            )
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k must be in [1, {experts}] (the number of experts), got {top_k}")
    probs = torch.cat([layer.float() for layer in router_logits]).softmax(dim=-1)  # [R, E]
    chosen = torch.topk(probs, top_k, dim=-1).indices  # [R, k]
    counts = torch.zeros(experts, dtype=torch.float32, device=probs.device)
    counts.index_add_(0, chosen.reshape(-1), torch.ones(chosen.numel(), device=probs.device))
    rows = probs.shape[0]
    fraction = counts / rows  # f_e, no gradient
    mean_prob = probs.mean(dim=0)  # P_e
    return experts * (fraction * mean_prob).sum()


def replayed_gate_weights(
    router_logits: torch.Tensor, expert_indices: torch.Tensor, *, normalize: bool = True
) -> torch.Tensor:
    """Gate weights [T, K] of the given experts, recomputed from the router's logits (routing
    replay, R3: Ma et al. 2025, "Stabilizing MoE Reinforcement Learning by Aligning Training and
    Inference Routers"):

        p_t = softmax(router_logits_t)          w_t,j = p_t[i_t,j]   (/ Σ_j p_t[i_t,j] if normalize)

    With `normalize` this is R3's softmax of the logits restricted to the replayed experts; it is
    also what a softmax-top-k router (Mixtral, Qwen2/3-MoE with norm_topk_prob) computes for
    its own top-k, so replaying a router's own choice reproduces its weights exactly. The
    gradient flows to the logits through the weights (the indices are constants).

    Args:
      router_logits: [T, E] logits before the softmax.
      expert_indices: [T, K] integer expert indices in [0, E).
      normalize: renormalise the K weights of a token to sum to 1 (the router's norm_topk_prob).

    Returns [T, K] in the logits' dtype (computed in float32).

    Example: logits [[0, ln 3, 0]] and experts [[1, 0]]: p = [0.2, 0.6, 0.2], weights [0.75, 0.25].
    """
    check_ndim("router_logits", router_logits, 2, "[tokens, experts]")
    check_ndim("expert_indices", expert_indices, 2, "[tokens, top_k]")
    if expert_indices.shape[0] != router_logits.shape[0]:
        raise ValueError(
            f"expert_indices has {expert_indices.shape[0]} tokens, router_logits {router_logits.shape[0]}"
        )
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float)
    weights = probs.gather(1, expert_indices.long())
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype)


def expert_load_metrics(expert_indices: Sequence[torch.Tensor], num_experts: int) -> dict[str, torch.Tensor]:
    """Per-layer expert load of the routed tokens: for layer l with n_e,l tokens sent to expert e
    (each token counts once per chosen expert), `layer{l}/load_max_over_mean` = max_e n / mean_e n
    (1 when balanced, E/K when every token goes to the same K experts) and `layer{l}/load_entropy`
    = −Σ_e q_e ln q_e with q = n / Σ n, in nats (ln E when balanced); and their means over layers,
    `load_max_over_mean` and `load_entropy`. Float32 scalars; a layer with no tokens gives 1 and
    ln E.

    Args:
      expert_indices: one [T, K] integer tensor per MoE layer (the experts each token used;
        entries < 0 are skipped).
      num_experts: E.
    """
    if not expert_indices:
        raise ValueError("expert_indices is empty: the model ran no MoE layer")
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be an int >= 1, got {num_experts!r}")
    metrics: dict[str, torch.Tensor] = {}
    ratios, entropies = [], []
    for layer, chosen in enumerate(expert_indices):
        check_ndim(f"expert_indices[{layer}]", chosen, 2, "[tokens, top_k]")
        flat = chosen.reshape(-1).long()
        flat = flat[flat >= 0]
        counts = torch.zeros(num_experts, dtype=torch.float32, device=chosen.device)
        counts.index_add_(0, flat, torch.ones(flat.numel(), dtype=torch.float32, device=chosen.device))
        total = counts.sum()
        if float(total) == 0:
            counts = torch.ones_like(counts)
            total = counts.sum()
        share = counts / total
        ratio = counts.max() / counts.mean()
        entropy = -(share * torch.log(share.clamp_min(1e-30))).sum()
        metrics[f"layer{layer}/load_max_over_mean"] = ratio
        metrics[f"layer{layer}/load_entropy"] = entropy
        ratios.append(ratio)
        entropies.append(entropy)
    metrics["load_max_over_mean"] = torch.stack(ratios).mean()
    metrics["load_entropy"] = torch.stack(entropies).mean()
    return metrics


def route_mismatch(learner: torch.Tensor, engine: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mismatched, compared): how many (token, layer) pairs route to a different top-k SET in
    the learner than in the engine, and how many pairs were compared (those the engine reported:
    no entry < 0). The fraction mismatched / compared is the routing disagreement that routing
    replay removes (0 with replay).

    Args:
      learner: [T, L, K] expert indices the learner's routers chose (order within K ignored).
      engine:  [T, L, K] the engine's, −1 where it did not report the token.
    Returns two float32 scalars.
    """
    check_ndim("learner", learner, 3, "[tokens, layers, top_k]")
    check_ndim("engine", engine, 3, "[tokens, layers, top_k]")
    if learner.shape != engine.shape:
        raise ValueError(f"learner has shape {tuple(learner.shape)}, engine {tuple(engine.shape)}")
    reported = (engine >= 0).all(dim=-1)  # [T, L]
    same = (learner.long().sort(dim=-1).values == engine.long().sort(dim=-1).values).all(dim=-1)
    mismatched = (reported & ~same).sum().float()
    return mismatched, reported.sum().float()
