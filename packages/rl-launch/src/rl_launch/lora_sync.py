"""What a LoRA policy's weight sync sends (`model.lora_sync`): its adapter only, or the merged model.

A LoRA policy (`model.lora_rank` > 0) changes only its adapters. With adapter sync each step
sends the adapter tensors alone (`rl_learner.adapter_sync`, through whichever transport
`rollout.weight_sync` chose) and the engines serve them on the base weights they loaded once
(`rl_rollout.adapters`); with merged sync the sender merges the adapters into the base weights
and sends the whole model (`rl_learner.sync`). The decision table (`lora_sync_mode`):

    model.lora_rank 0, rollout.weight_sync none,
    or an engine that cannot receive weights        -> None     (nothing to choose)
    model.lora_sync merged                          -> merged
    model.lora_sync adapter                         -> adapter  (refused for an engine that cannot serve adapters)
    model.lora_sync auto                            -> adapter where the engine can serve adapters
                                                       (`EngineEntry.lora_adapters`: vllm, hf), else merged
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .errors import ConfigError

if TYPE_CHECKING:
    from .config import PPOConfig

__all__ = ["VLLM_LORA_RANKS", "check_lora_sync", "lora_sync_mode", "vllm_max_lora_rank"]

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM takes for `max_lora_rank` (its `LoRAConfig`)."""


def lora_sync_mode(config: PPOConfig) -> str | None:
    """ "adapter", "merged", or None when the run has no LoRA policy or syncs nothing (module docstring)."""
    from .components import ENGINES

    entry = ENGINES.get(config.rollout.engine)
    receives = entry is None or entry.receives_weights
    if config.model.lora_rank == 0 or config.rollout.weight_sync == "none" or not receives:
        return None
    chosen = config.model.lora_sync
    if chosen != "auto":
        return chosen
    return "adapter" if entry is not None and entry.lora_adapters else "merged"


def check_lora_sync(config: PPOConfig) -> None:
    """ConfigError for model.lora_sync adapter with an engine that cannot serve a LoRA adapter."""
    from .components import ENGINES

    entry = ENGINES.get(config.rollout.engine)
    if config.model.lora_sync != "adapter" or config.model.lora_rank == 0 or entry is None:
        return
    if not (entry.lora_adapters and entry.receives_weights):
        able = sorted(name for name in ENGINES if ENGINES[name].lora_adapters)
        raise ConfigError(
            f"model.lora_sync: adapter, but rollout engine {config.rollout.engine!r} cannot serve a LoRA adapter "
            f"on its base weights; engines that can: {', '.join(able)} (or model.lora_sync merged / auto)"
        )


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest `max_lora_rank` vLLM takes that holds an adapter of rank `rank`."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ConfigError(
        f"model.lora_rank: {rank} is over the largest rank vLLM serves ({VLLM_LORA_RANKS[-1]}); "
        "use model.lora_sync merged"
    )


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
