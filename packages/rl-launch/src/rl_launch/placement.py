"""Where a run's actors ended up: one frozen record, built once every actor is up.

`EngineReady` is what each engine actor answers to `ready` (`rl_launch.actors.RolloutWorker`);
`Placement` gathers those answers with the policy ranks' locations (Ray node, GPU ids) and the
device the run resolved. The weight-sync strategies (`rl_launch.components.weight_sync`) decide
from it, the start-up line describes the engines' context from it; nothing changes it afterwards.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

__all__ = ["EngineReady", "Placement"]


class EngineReady(msgspec.Struct, frozen=True, kw_only=True):
    """One engine actor, once started (`RolloutWorker.ready`)."""

    sync_size: int
    """Weight-sync ranks this engine takes (its TP x PP workers; 0 when it receives nothing)."""
    kv_cache_bytes: int | None = None
    """Its KV cache's bytes, None where the engine does not say (vLLM sizes it)."""
    node: str = ""
    """The Ray node id it runs on."""
    gpus: tuple[str, ...] = ()
    """The GPU ids Ray gave it."""
    max_model_len: int | None = None
    """The longest sequence it takes, None where the engine does not say."""
    kv_cache_tokens: int | None = None
    """Tokens its KV cache holds, None without a paged cache (transformers)."""


class Placement(msgspec.Struct, frozen=True, kw_only=True):
    """The placement facts of a started run."""

    device: str
    """"cuda" or "cpu": where the learners and the engines run."""
    engines: tuple[EngineReady, ...] = ()
    policy_locations: tuple[tuple[str, tuple[str, ...]], ...] = ()
    """(Ray node id, GPU ids) of every policy rank, in rank order; rank 0 sends the weights."""

    @classmethod
    def of(
        cls, device: str, engines: Sequence[EngineReady], policy_locations: Sequence[Sequence]
    ) -> Placement:
        return cls(
            device=device,
            engines=tuple(engines),
            policy_locations=tuple((str(node), tuple(gpus)) for node, gpus in policy_locations),
        )

    @property
    def policy_node(self) -> str:
        """The node of policy rank 0 (the sender)."""
        return self.policy_locations[0][0]

    @property
    def engine_nodes(self) -> list[str]:
        return [engine.node for engine in self.engines]

    @property
    def engine_sync_sizes(self) -> list[int]:
        return [engine.sync_size for engine in self.engines]

    def engine_policy_ranks(self) -> list[int | None]:
        """For each engine, the policy rank whose GPU it runs on (it holds exactly that one GPU, on
        that rank's node), or None: the engines a CUDA IPC sync can reach from each rank."""
        ranks: list[int | None] = []
        for engine in self.engines:
            match = None
            if len(engine.gpus) == 1:
                for rank, (policy_node, policy_gpus) in enumerate(self.policy_locations):
                    if policy_node == engine.node and list(policy_gpus) == list(engine.gpus):
                        match = rank
                        break
            ranks.append(match)
        return ranks

    def describe_engine_context(self) -> str | None:
        """The engines' context and KV cache in words (None when they say nothing): the longest
        sequence they take (`max_model_len`), the cache's size and how many sequences of that
        length it holds at once (fewer than max_num_seqs: the others wait for room)."""
        lengths = {engine.max_model_len for engine in self.engines} - {None}
        tokens = [engine.kv_cache_tokens for engine in self.engines if engine.kv_cache_tokens]
        sizes = {engine.kv_cache_bytes for engine in self.engines if engine.kv_cache_bytes is not None}
        words = []
        if lengths:
            words.append(f"max_model_len {'/'.join(str(n) for n in sorted(lengths))}")
        if sizes:
            words.append(f"KV cache {max(sizes) / 2**20:.0f} MiB each")
        if tokens and len(lengths) == 1:
            (length,) = lengths
            fewest = min(tokens)
            words.append(f"{fewest} tokens: {fewest / length:.2f} sequences of {length} tokens at once")
        return "; ".join(words) or None
