"""The policy's weights to the engines, at run time: start once, send every step, settle at the end.

`WeightSync.start` resolves `rollout.weight_sync` (auto from the `Placement`) and, for a LoRA
policy, `model.lora_sync` (`rl_launch.lora_sync`: the adapter only, or the merged model), runs the chosen
strategy's start in the driver (`rl_launch.components.weight_sync`, given a typed `SyncContext`)
and has policy rank 0 and every engine worker join the spec it returns. `send(version)` is one
sync; in async mode an engine takes a version after the generations queued before it, so the
receipts of a sync are compared later (`settle`). `rejoin(index)` joins an engine restarted in
place (`rl_launch.supervisor`) and gives it the last version sent before it serves. `sweep`
removes what a killed sender left.

The driver waits for the engines' receipts at most `rollout.weight_sync_timeout_s` +
`RECEIPT_MARGIN_S` (an engine's receive gives up on its peers within weight_sync_timeout_s and
says so); an engine that has not answered by then is hung (`EngineHung`, which the supervisor
restarts it for), never waited on forever.
"""

from __future__ import annotations

from typing import Any

import msgspec

from rl_data import compare_checksums

from .actors import RECEIVE_GROUP
from .components.weight_sync import SYNC_STRATEGIES, SyncContext, SyncPlacement, choose_weight_sync
from .config import PPOConfig
from .handoff import HandOff
from .health import EngineHung
from .lora_sync import describe as describe_lora_sync
from .lora_sync import lora_sync_mode
from .placement import Placement

__all__ = ["WeightSync", "weight_sync_strategy"]

NONE_DESCRIPTION = "none (the engines keep the weights they started with; the run is off-policy after step 1)"


def sync_placement(config: PPOConfig, placement: Placement) -> SyncPlacement:
    """The facts `weight_sync.choose_weight_sync` decides auto from."""
    from .components import ENGINES

    return SyncPlacement(
        device=placement.device,
        engine_receives=ENGINES[config.rollout.engine].receives_weights,
        engines_on_policy_gpus=bool(placement.engines)
        and all(rank is not None for rank in placement.engine_policy_ranks()),
        engines_on_policy_node=all(node == placement.policy_node for node in placement.engine_nodes),
    )


def weight_sync_strategy(config: PPOConfig, placement: Placement) -> str:
    """`rollout.weight_sync`, with auto resolved from the placement (`weight_sync.choose_weight_sync`):
    none for an engine that cannot receive, ipc for engines on the policy's GPUs, broadcast
    across GPUs (NCCL) or nodes (gloo), shm for CPU engines on the node of policy rank 0."""
    chosen = config.rollout.weight_sync
    return choose_weight_sync(sync_placement(config, placement)) if chosen == "auto" else chosen


RECEIPT_MARGIN_S = 30.0
"""Seconds beyond rollout.weight_sync_timeout_s the driver waits for an engine's receipt (the
engine's own timeout error on its way back)."""


def _sync_metrics(report: Any) -> dict[str, float]:
    return {"sync/seconds": float(report.seconds), "sync/gigabytes": report.num_bytes / 1e9}


class WeightSync:
    """Policy DP rank 0 sends, every engine worker receives (`weight_sync.SYNC_STRATEGIES`).

    `name`: the resolved strategy ("none": nothing is sent), `policy` / `engines`: the policy's
    and the engines' `ActorGroup`s, `placement`: where they run, `hand_off`: the hybrid engine
    (a sync needs the engines awake), `spec`: the `WeightSyncSpec` both sides joined."""

    def __init__(
        self,
        config: PPOConfig,
        name: str,
        policy: Any,
        engines: Any,
        placement: Placement,
        hand_off: HandOff,
        spec: Any = None,
    ) -> None:
        self.config, self.name, self.policy, self.engines = config, name, policy, engines
        self.placement, self.hand_off, self.spec = placement, hand_off, spec
        # async mode: syncs whose receipts are not compared yet, (report, {engine index: receipt})
        self._receipts: list[tuple[Any, dict[int, Any]]] = []
        self.version = 0  # the last version a send finished (the engines' start: 0)
        self.layout: Any = None  # policy rank 0's WeightSyncMeta, for a restart of the strategy
        self.adapter: Any = None  # LoRA adapter sync: the rl_data.LoraAdapter the engines serve

    @classmethod
    def start(
        cls, config: PPOConfig, policy: Any, engines: Any, placement: Placement, hand_off: HandOff, dtype: str
    ) -> tuple[WeightSync, str]:
        """The strategy's rendezvous, joined by both sides; the sync and its start-up description."""

        name = weight_sync_strategy(config, placement)
        if name == "none":
            return cls(config, name, policy, engines, placement, hand_off), NONE_DESCRIPTION
        sync = cls(config, name, policy, engines, placement, hand_off)
        mode = lora_sync_mode(config, use_gpus=placement.device == "cuda")
        if mode == "adapter":  # the adapter's layout and configuration (rl_launch.lora_sync)
            sync.layout, sync.adapter, merged_bytes = policy.call("adapter_layout", dtype)[0]
            what = describe_lora_sync(mode, sync.layout.total_bytes, merged_bytes)
        else:
            sync.layout = policy.call("sync_layout", dtype)[0]
            what = describe_lora_sync(mode, 0, sync.layout.total_bytes)
        return sync, what + sync._start_strategy()

    def _start_strategy(self) -> str:
        """The strategy's rendezvous, joined by policy rank 0 and every engine; its description."""
        import ray

        policy = self.policy
        context = SyncContext(
            self.config, self.placement, lambda fn: ray.get(policy.actors[0].prepare_sync.remote(fn))
        )
        self.spec, description = SYNC_STRATEGIES[self.name].start(context, self.layout)
        if self.adapter is not None:  # every strategy's spec carries the adapter the same way
            self.spec = msgspec.structs.replace(self.spec, adapter=self.adapter)
        futures = policy.submit("init_sync", self.spec)
        futures += self.engines.submit("init_sync", per_rank=[(self.spec, o) for o in self._offsets()])
        ray.get(futures)
        return description

    def _offsets(self) -> list[int]:
        """Each engine's first receiver rank (rank 0 is the sender)."""
        sizes = self.placement.engine_sync_sizes
        return [1 + sum(sizes[:i]) for i in range(len(sizes))]

    def rejoin(self, index: int, *, send: bool = True) -> dict[str, float]:
        """Engine `index`, restarted in place, joins the sync and receives the last version sent
        (`self.version`; nothing at 0: it loaded the starting weights) before it serves.

        A strategy whose every receiver takes part in every send (`SyncStrategy.whole_group`:
        broadcast) starts again for the sender and every engine, and that version goes to all of
        them (the others get the weights they hold); otherwise the new engine joins the spec alone
        and the sender sends that version again to it alone (shm and file publish the version
        number again, ipc packs it again; the other engines do not read it). The dead engine's receipts are dropped. Metrics as `send`'s. `send` False:
        only join (the caller sends a version to every engine next: a sync that an engine's death
        interrupted, sent again)."""
        import ray

        for _, receipts in self._receipts:
            receipts.pop(index, None)
        if self.name == "none":
            return {}
        if SYNC_STRATEGIES[self.name].whole_group:
            self._start_strategy()
            targets = list(range(len(self.engines)))
        else:
            ray.get(self.engines.submit_to(index, "init_sync", self.spec, self._offsets()[index]))
            targets = [index]
        if self.version == 0 or not send:
            return {}
        report, received, mismatched = self._transfer(self.version, targets)
        if mismatched is None:
            mismatched = sum(len(compare_checksums(report, other)) for other in self._receipts_of(received))
        return _sync_metrics(report) | {"health/sync_checksum_match": float(mismatched == 0)}

    def send(self, version: int) -> dict[str, float]:
        """Send the policy's weights to every engine as `version`; time, size and checksum match.

        How is the strategy's data (`weight_sync.SyncStrategy`): with `sender_first` the engines
        start receiving once the sender returned; with `per_rank_payload` (CUDA IPC) every policy
        rank returns a payload with its report, each engine receives the payload of the rank on
        its GPU, then the ranks release them. Every policy rank returns (report, payload): the
        report is None off the sending ranks, the payload None where the transport carries it all.
        """

        if self.name == "none":
            return {}
        if self.hand_off.engines_asleep:
            raise RuntimeError("WeightSync.send: the engines are asleep; call hand_off.to_generation() first")
        report, received, mismatched = self._transfer(version, list(range(len(self.engines))))
        self.version = version
        if mismatched is None and self.config.rollout.async_train:
            self._receipts.append((report, received))
            return _sync_metrics(report) | self._settle_receipts(wait=False)
        if mismatched is None:
            mismatched = sum(len(compare_checksums(report, other)) for other in self._receipts_of(received))
        return _sync_metrics(report) | {"health/sync_checksum_match": float(mismatched == 0)}

    def _transfer(self, version: int, targets: list[int]) -> tuple[Any, dict[int, Any], int | None]:
        """One send of `version` to the engines `targets`: (the sender's report, {engine index: the
        future of its report}, None), the receipts not waited for; with per-rank payloads, which
        are released once every engine has its weights, (rank 0's report, {}, the number of
        checksums that differ between each engine and the rank whose payload it took)."""
        import ray

        strategy = SYNC_STRATEGIES[self.name]
        # partial rollout: the engines take the weights now, between two decoding steps of the
        # generations in flight, instead of after them
        group = RECEIVE_GROUP if self.config.rollout.partial_rollout else None

        sent = self.policy.submit("sync", version)
        if strategy.per_rank_payload:
            shared = ray.get(sent)
            ranks = self.placement.engine_policy_ranks()
            received = {
                index: self.engines.submit_to(
                    index, "receive", version, shared[ranks[index]][1], concurrency_group=group
                )
                for index in targets
            }
            reports = dict(zip(received, self._receipts_of(received), strict=True))
            ray.get(self.policy.submit("release_sync"))
            mismatched = sum(
                len(compare_checksums(shared[ranks[index]][0], other)) for index, other in reports.items()
            )
            return shared[0][0], {}, mismatched
        if strategy.sender_first:  # a reader does not wait for the data: it must be sent first
            ray.get(sent)
        received = {
            index: self.engines.submit_to(index, "receive", version, concurrency_group=group)
            for index in targets
        }
        return ray.get(sent)[0][0], received, None

    def _settle_receipts(self, *, wait: bool) -> dict[str, float]:
        """Async mode: an engine receives a version after the generations queued before it, so the
        driver does not wait for that: each sync's receipts are compared once they are all in (at
        a later step's sync, oldest first). `health/sync_checksum_match` covers the versions
        settled in this call (absent when none was); `sync/unsettled_versions` counts the rest.
        `wait`: settle every version (the end of the run)."""
        import ray

        settled = []
        while self._receipts:
            futures = list(self._receipts[0][1].values())
            if (
                futures
                and not wait
                and len(ray.wait(futures, num_returns=len(futures), timeout=0)[0]) < len(futures)
            ):
                break
            settled.append(self._receipts.pop(0))
        metrics = {"sync/unsettled_versions": float(len(self._receipts))}
        if settled:
            mismatched = sum(
                len(compare_checksums(sent, other))
                for sent, futures in settled
                for other in self._receipts_of(futures)
            )
            metrics["health/sync_checksum_match"] = float(mismatched == 0)
        return metrics

    def _receipts_of(self, received: dict[int, Any]) -> list:
        """The engines' receipts ({engine index: future}), in order, waited for at most
        rollout.weight_sync_timeout_s + RECEIPT_MARGIN_S; `EngineHung` naming the engines still out."""
        import ray

        futures = list(received.values())
        if not futures:
            return []
        limit = self.config.rollout.weight_sync_timeout_s + RECEIPT_MARGIN_S
        _, waiting = ray.wait(futures, num_returns=len(futures), timeout=limit)
        if waiting:
            out = {id(future) for future in waiting}
            raise EngineHung(
                [index for index, future in received.items() if id(future) in out],
                f"no weight-sync receipt within {limit:g} s (rollout.weight_sync_timeout_s = "
                f"{self.config.rollout.weight_sync_timeout_s:g} s + {RECEIPT_MARGIN_S:g} s)",
            )
        return ray.get(futures)

    def settle(self) -> dict[str, float]:
        """Wait for the receipts async mode has not compared yet; their metrics ({} when none)."""
        return self._settle_receipts(wait=True) if self._receipts else {}

    def sweep(self) -> None:
        """After the actors are gone: what a killed policy rank left (shm: its folder)."""
        strategy = SYNC_STRATEGIES.get(self.name) if self.spec is not None else None
        if strategy is not None and strategy.sweep is not None:
            strategy.sweep(self.spec)
