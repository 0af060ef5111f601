"""A `--plugin` that registers one component of every kind, none of them in the packages:

    advantage estimator  plugin_td          takes `values`, so the run starts and trains a critic
    rollout engine       plugin_hf          the transformers engine, built through its own entry
    rollout executor     plugin_tagged      single-turn episodes that tag their records
    rollout correction   plugin_capped      importance weights capped from above only
    weight sync          toy_folder         buckets through a folder of the run (its wire spec, sender
                                            and receiver: tests/integration/_toy_transport.py)

Each component leaves a trace the tests read: the engine and executor print a line into their
actor's log, the executor's tag arrives as the metric `rollout/agent/plugin_tag`, and the
correction's own metric `plugin_cap_fraction` reaches the policy's metrics.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import tests.integration._toy_transport as toy_transport
from rl_algos import ADVANTAGE_ESTIMATORS, CORRECTIONS, compute_gae, masked_mean
from rl_data.sync import WeightSyncSpec
from rl_launch.components import ENGINES, EXECUTORS, SYNC_STRATEGIES

ENGINE_LINE = "plugin_every_kind: engine built"
EXECUTOR_LINE = "plugin_every_kind: executor built"


@ADVANTAGE_ESTIMATORS.register("plugin_td")
def plugin_td(
    *, token_rewards: torch.Tensor, values: torch.Tensor, action_mask: torch.Tensor, gamma: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """One-step TD advantages, A_t = r_t + γ·V_{t+1} − V_t (GAE with λ = 0), returns A + V.

    Shapes: `[batch, seq]` in and out. Taking `values` is all it takes to get a critic."""
    return compute_gae(token_rewards, values, action_mask, gamma=gamma, lam=0.0)


@CORRECTIONS.register("plugin_capped")
def plugin_capped(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    cap: float = 5.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token importance weights w_t = exp(log π_old − log π_rollout), capped from above: min(w_t, cap).

    Shapes: `[batch, seq]` in and out (float32, detached, 0 off the mask); the metric
    `plugin_cap_fraction` is the share of action tokens whose weight was capped."""
    if not cap > 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    mask = action_mask.float()
    weights = (old_logprobs.detach().float() - rollout_logprobs.detach().float()).clamp(max=20.0).exp()
    capped = weights > cap
    return (weights.clamp(max=cap) * mask).detach(), {
        "plugin_cap_fraction": masked_mean(capped.float(), mask)
    }


@ENGINES.register("plugin_hf", receives_weights=True, sleeps=True)
def plugin_hf(spec: Any, **options: Any) -> Any:
    """The transformers engine, registered under a plugin's name (its options are the hf engine's)."""
    print(ENGINE_LINE, flush=True)
    return ENGINES["hf"].build(spec, **options)


class _Tagged:
    """Runs an executor and marks every record it returns with `extra_logs[plugin_tag]`."""

    def __init__(self, inner: Any, tag: float) -> None:
        self.inner, self.tag = inner, tag

    def run(self, samples: Any) -> list:
        records = self.inner.run(samples)
        for record in records:
            record.extra["extra_logs"] = {**(record.extra.get("extra_logs") or {}), "plugin_tag": self.tag}
        return records


@EXECUTORS.register("plugin_tagged")
def plugin_tagged(
    *,
    engine: Any,
    reward_fn: Any,
    tokenizer: Any,
    sampling: Any,
    first_group_id: int,
    agent_func_path: str | None,
    tag: float = 1.0,
) -> Any:
    """Single-turn episodes whose records carry `tag` (logged as rollout/agent/plugin_tag)."""
    print(EXECUTOR_LINE, flush=True)
    inner = EXECUTORS["single_turn"].build(
        engine=engine,
        reward_fn=reward_fn,
        tokenizer=tokenizer,
        sampling=sampling,
        first_group_id=first_group_id,
        agent_func_path=agent_func_path,
    )
    return _Tagged(inner, tag)


@SYNC_STRATEGIES.register(toy_transport.NAME, sender_first=True)
def toy_folder_sync(context: Any, layout: Any) -> tuple[Any, str]:
    """Buckets copied through `<log.output_dir>/toy_sync` (the receivers read once the sender wrote)."""
    folder = Path(context.config.log.output_dir).resolve() / "toy_sync"
    folder.mkdir(parents=True, exist_ok=True)
    spec = WeightSyncSpec(
        transport=toy_transport.NAME,
        layout=layout,
        options={"folder": str(folder)},
        timeout_s=context.config.rollout.weight_sync_timeout_s,
    )
    return spec, f"toy folder ({folder})"
