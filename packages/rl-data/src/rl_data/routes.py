"""Mixture-of-experts routes: which experts each token of a record was sent to.

An engine that reports routes puts them on the record as `Trajectory.routed_experts`, one
[T, L, K] int16 tensor (T tokens of prompt ‖ response, L MoE layers, the top-K expert indices of
each, −1 where the engine did not run the token), and the learner can replay them (routing replay,
"R3": Ma et al. 2025, "Stabilizing MoE Reinforcement Learning by Aligning Training and Inference
Routers"). Both sides find a model's routers with `moe_routers`: the modules transformers records
as `router_logits` (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, ...), whose forward returns
`(router_logits [T, E], gate_weights [T, K], expert_indices [T, K])`.
"""

from __future__ import annotations

from typing import Any

import torch

from .records import ROUTE_DTYPE

__all__ = ["ROUTE_DTYPE", "moe_routers", "unreported_routes"]


def moe_routers(model: Any) -> tuple[list[torch.nn.Module], int]:
    """(the routers of every MoE layer of `model`, in layer order; top-K per token).

    `model`: a transformers model (or a wrapper with `.module` / `get_base_model()`). Raises
    ValueError for a model without such routers (a dense model) or without num_experts_per_tok."""
    module = getattr(model, "module", model)
    base = module.get_base_model() if hasattr(module, "get_base_model") else module
    recorder = getattr(base, "_can_record_outputs", None) or {}
    target = getattr(recorder.get("router_logits"), "target_class", None)
    routers = [m for m in base.modules() if target is not None and isinstance(m, target)]
    if not routers:
        raise ValueError(
            f"{type(base).__name__} has no mixture-of-experts router whose logits transformers records "
            "(router_logits): only mixture-of-experts models such as Mixtral, Qwen2-MoE or Qwen3-MoE have them"
        )
    config = getattr(base, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    top_k = int(getattr(text, "num_experts_per_tok", 0) or 0)
    if top_k < 1:
        raise ValueError(f"{type(base).__name__}'s config has no num_experts_per_tok >= 1")
    return routers, top_k


def unreported_routes(tokens: int, layers: int, top_k: int) -> torch.Tensor:
    """[tokens, layers, top_k] of −1: routes of tokens an engine did not run."""
    return torch.full((tokens, layers, top_k), -1, dtype=ROUTE_DTYPE)
