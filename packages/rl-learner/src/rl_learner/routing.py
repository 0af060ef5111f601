"""Mixture-of-experts routing in the learner: routing replay (R3) and the routes a forward used.

Routing replay (Ma et al. 2025, "Stabilizing MoE Reinforcement Learning by Aligning Training and
Inference Routers", R3; verl's `router_replay.mode: R3`): the rollout engine records the top-K
experts of every MoE layer at every token (`rl_data.Trajectory.routed_experts`), and the learner's
forward sends each of those tokens to exactly those experts, with the gate weights recomputed from
its own router logits over the replayed experts (`rl_algos.replayed_gate_weights`). The learner's
log-probs then differ from the engine's only by numerics, not by a different choice of experts,
and the gradient still flows to the routers through the weights.

`MoERouting` is a set of forward hooks on the routers (`rl_data.routes.moe_routers`; the
softmax-top-k family whose router returns (logits, weights, indices): `REPLAYABLE_MODEL_TYPES`),
held for a whole step: `load(routes)` gives the routes of the next forward's row, and the hook
reads them when the router runs, so a gradient-checkpointing recompute during the backward replays
the same experts. Rows whose routes hold −1 (tokens the engine did not run, sequence-parallel
filler) route freely. Every forward also records the router's own top-K (`own`) and the experts
used (`used`), for the metrics (`rl_algos.expert_load_metrics`, `rl_algos.route_mismatch`).
"""

from __future__ import annotations

from typing import Any

import torch

from rl_algos import expert_load_metrics, replayed_gate_weights, route_mismatch
from rl_data.routes import moe_routers

__all__ = [
    "REPLAYABLE_MODEL_TYPES",
    "ROUTER_REPLAY_MODES",
    "MoERouting",
    "routing_metric_keys",
    "routing_metrics",
    "row_routes",
]

ROUTER_REPLAY_MODES = ("disabled", "R3")
"""`router_replay` values (verl's names): "disabled", or "R3" (replay the rollout engine's routes)."""

REPLAYABLE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "qwen3_5_moe", "qwen3_5_moe_text", "olmoe")
"""Models whose router is softmax then top-k (renormalised when `norm_topk_prob`): replay
recomputes their gate weights exactly. Sigmoid / group-limited routers (DeepSeek-V3) are refused."""


def row_routes(routes: torch.Tensor, row_tokens: torch.Tensor) -> torch.Tensor:
    """[R, L, K] routes of the row a forward runs: `routes[row_tokens]`, −1 where `row_tokens`
    is −1 (filler). `routes`: [N, L, K] of the batch; `row_tokens`: [R] int64, the batch token
    each row position runs (the compressed row under prefix sharing, a rank's slice under
    sequence parallelism)."""
    if routes.dim() != 3:
        raise ValueError(f"routes: expected [tokens, layers, top_k], got shape {tuple(routes.shape)}")
    tokens = row_tokens.to(routes.device)
    picked = routes[tokens.clamp(min=0)]
    return torch.where((tokens >= 0)[:, None, None], picked, torch.full_like(picked, -1))


class MoERouting:
    """Forward hooks on every router of an MoE model (module docstring), as a context manager.

    Args:
      module: the (unwrapped) transformers model.
      replay: send tokens to the loaded routes' experts; False only records.

    Raises ValueError for a dense model, or with `replay` for a model whose router is not in
    `REPLAYABLE_MODEL_TYPES`.
    """

    def __init__(self, module: Any, *, replay: bool) -> None:
        self.routers, self.top_k = moe_routers(module)
        config = getattr(module, "config", None)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        model_type = getattr(text, "model_type", None)
        if replay and model_type not in REPLAYABLE_MODEL_TYPES:
            raise ValueError(
                f"router_replay: {type(module).__name__} ({model_type!r}) has a router whose gate weights "
                f"replay cannot recompute; supported model types: {', '.join(REPLAYABLE_MODEL_TYPES)}"
            )
        self.replay = replay
        self.num_experts = int(getattr(text, "num_experts", 0) or getattr(text, "num_local_experts", 0) or 0)
        self.routes: torch.Tensor | None = None
        self.own: list[torch.Tensor] = []
        self.used: list[torch.Tensor] = []
        self._handles: list[Any] = []

    @property
    def num_layers(self) -> int:
        """L, the MoE layers."""
        return len(self.routers)

    def load(self, routes: torch.Tensor | None) -> None:
        """The routes [R, L, K] of the next forward's row (None: route freely); clears the records."""
        if routes is not None and (
            routes.dim() != 3 or tuple(routes.shape[1:]) != (self.num_layers, self.top_k)
        ):
            raise ValueError(
                f"routed_experts: shape {tuple(routes.shape)}, but the model has {self.num_layers} MoE layers "
                f"with top-{self.top_k} routing: expected [tokens, {self.num_layers}, {self.top_k}] (routes "
                "recorded by an engine running another model?)"
            )
        if (
            routes is not None
            and self.num_experts
            and routes.numel()
            and int(routes.max()) >= self.num_experts
        ):
            raise ValueError(
                f"routed_experts: expert index {int(routes.max())}, but the model has {self.num_experts} experts"
            )
        self.routes = routes
        self.own, self.used = [], []

    def _hook(self, layer: int) -> Any:
        def hook(module: torch.nn.Module, _inputs: Any, output: Any) -> Any:
            logits, weights, indices = output
            self.own.append(indices.detach())
            if not self.replay or self.routes is None:
                self.used.append(indices.detach())
                return None
            replayed = self.routes[:, layer].to(device=indices.device)
            if replayed.shape[0] != indices.shape[0]:
                raise ValueError(
                    f"router_replay: layer {layer}'s router runs {indices.shape[0]} tokens but "
                    f"{replayed.shape[0]} routes were loaded for this forward"
                )
            known = (replayed >= 0).all(dim=-1, keepdim=True)
            chosen = torch.where(known, replayed.to(indices.dtype), indices)
            normalize = bool(getattr(module, "norm_topk_prob", True))
            recomputed = replayed_gate_weights(logits, chosen, normalize=normalize)
            self.used.append(chosen.detach())
            return logits, torch.where(known, recomputed, weights), chosen

        return hook

    def __enter__(self) -> MoERouting:
        self.load(None)
        self._handles = [
            router.register_forward_hook(self._hook(layer)) for layer, router in enumerate(self.routers)
        ]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.routes = None


def routing_metric_keys(num_layers: int) -> list[str]:
    """The keys `routing_metrics` returns for a model of `num_layers` MoE layers."""
    per_layer = [f"moe_layer{layer}/{name}" for layer in range(num_layers) for name in _LOAD_NAMES]
    return [*per_layer, *(f"moe_{name}" for name in _LOAD_NAMES), *_ROUTE_KEYS]


_LOAD_NAMES = ("load_max_over_mean", "load_entropy")
_ROUTE_KEYS = ("moe_route_mismatch", "moe_route_mismatch_used", "moe_routes_reported")


def routing_metrics(routing: MoERouting) -> dict[str, torch.Tensor]:
    """Metrics of the last forward through `routing`'s hooks (`routing_metric_keys`):

    - moe_layer{l}/load_max_over_mean, moe_layer{l}/load_entropy and their means over layers
      moe_load_max_over_mean, moe_load_entropy: the load of the experts the tokens used
      (`rl_algos.expert_load_metrics`);
    - moe_route_mismatch: the fraction of (token, layer) pairs the engine reported whose top-k set
      the learner's own routers choose differently (`rl_algos.route_mismatch`): what replay removes;
    - moe_route_mismatch_used: the same for the experts the forward used (0 under replay);
    - moe_routes_reported: 1 when the batch had the engine's routes (the two above are 0 otherwise).
    """
    layers = routing.num_layers
    if len(routing.used) < layers:
        raise RuntimeError(f"routing_metrics: the forward ran {len(routing.used)} of {layers} MoE layers")
    used, own = routing.used[:layers], routing.own[:layers]
    metrics = {f"moe_{key}": value for key, value in expert_load_metrics(used, routing.num_experts).items()}
    zero = torch.zeros((), dtype=torch.float32, device=used[0].device)
    if routing.routes is None:
        return {**metrics, **dict.fromkeys(_ROUTE_KEYS, zero)}
    routes = routing.routes.to(used[0].device)
    mismatched, compared = route_mismatch(torch.stack(own, dim=1), routes)
    mismatched_used, _ = route_mismatch(torch.stack(used, dim=1), routes)
    compared = compared.clamp_min(1.0)
    return {
        **metrics,
        "moe_route_mismatch": mismatched / compared,
        "moe_route_mismatch_used": mismatched_used / compared,
        "moe_routes_reported": zero + 1.0,
    }
