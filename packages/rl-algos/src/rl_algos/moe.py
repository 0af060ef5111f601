"""Mixture-of-experts auxiliary losses: the router load-balancing loss.

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

__all__ = ["load_balancing_loss"]


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
