"""Rollout engines that come back: a dead or hung engine is restarted in place, re-synced, re-asked.

At scale an engine dies every few hours (the OOM killer, a crashed kernel, a lost GPU). With
`rollout.engine_restarts` N > 0 the run goes on; `EngineSupervisor` stands where the rollouts
used the engines' `ActorGroup` (same `submit` / `submit_to` / `actors`, plus `get`) and, when a
call on an engine fails because the engine died:

    detect    Ray's `RayActorError` names the dead actor (vLLM's `EngineDeadError` from an engine
              actor counts: its engine core died); any other failure of an engine call is a death
              only when a probe (`RolloutWorker.alive`, in `ACTIVITY_GROUP`) of that engine fails
              so (the probe's error is then the death's report: a broadcast's learner side that
              lost its peer fails before Ray reports the engine dead), and errors of live engines
              go up as before
    restart   `Roles.restart_engine(i)`: what the dead actor left is swept (vLLM's engine core),
              a new actor starts from the same spec on the same placement bundle
    re-sync   `WeightSync.rejoin(i)`: it joins the weight sync and receives the last version sent
              before it serves (broadcast: the group is formed again with every engine)
    re-issue  the calls made through the supervisor that were in flight on the dead engine (the
              generations, with their prompts, sampling seed and group ids; the hybrid engine's
              sleep / wake-up; `activity`) are submitted again to the new one with the same
              arguments, and `get` returns their results in place of the lost ones

A death found by a weight sync (`send`, `settle`) restarts the engine and sends that version
again to every engine. Each restart writes two console lines (`notify`): when the death is found
(which engine, Ray's words, why: `rl_launch.diagnosis`) and when the engine serves again (seconds
to start it and to sync it, calls issued again); `metrics()` gives engine/restarts (so far in
this run) and engine/restart_s (the seconds restarts took since the last step's line). Once N
restarts are spent, the next death goes up as with N = 0: the run stops with its diagnosis
after the learners save the last finished step. A learner's death is never restarted.

A hung engine is restarted the same way (its actor killed, its calls never waited on again,
the re-issued calls' results standing in for theirs); an engine is hung when

    generation    a step's generation waited `health.engine_stall_stop_s` on it (the rollouts
                  hand it to `restart(index, why)`; their next `get`, or a `ray.wait` on
                  `current(future)`, sees the re-issued calls)
    get           any other call through `get` (activity, sleep, wake-up) is still out after
                  `health.engine_stall_stop_s`
    weight sync   its receipt is still out after `rollout.weight_sync_timeout_s` + a margin
                  (`EngineHung` from `WeightSync`), or a sync failed and it does not answer a
                  probe within `PROBE_S`

`metrics()` counts the restarts by cause too: engine/restarts/dead, engine/restarts/hung. Once
the restarts are spent, a hung engine stops the run with `EngineHung` (a `HealthError`) naming
it, how long it kept the run waiting and the options to raise.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from .actors import ACTIVITY_GROUP
from .health import EngineHung

__all__ = ["EngineRestart", "EngineSupervisor"]

PROBE_S = 10.0
"""Seconds a probe of the engines waits for their answers after a failed call."""


@dataclasses.dataclass(frozen=True)
class EngineRestart:
    """One restart: which engine, why, and how long each part took."""

    index: int
    cause: str
    kind: str  # "dead" (the engine died: Ray or vLLM said so) or "hung" (a caller's deadline passed)
    start_s: float  # the new actor, from the kill until it was ready
    sync_s: float  # joining the weight sync and receiving the last version
    version: int  # the policy version it was given
    reissued: int  # generation calls submitted to it again

    @property
    def seconds(self) -> float:
        return self.start_s + self.sync_s


@dataclasses.dataclass
class _Call:
    """A call made through the supervisor, kept until `get` returned its result."""

    future: Any
    index: int
    method: str
    args: tuple
    concurrency_group: str | None


def _died(error: BaseException) -> bool:
    return "RayActorError" in {cls.__name__ for cls in type(error).__mro__}


def _engine_dead(error: BaseException) -> bool:
    """vLLM's `EngineDeadError` (its engine core died: the actor lives on but cannot generate), as
    Ray reports it from the actor (a `RayTaskError` whose cause it is)."""
    return any(
        "EngineDeadError" in {cls.__name__ for cls in type(each).__mro__}
        for each in (error, getattr(error, "cause", None))
        if each is not None
    )


class EngineSupervisor:
    """The engines of a run as the rollouts call them, restarted in place when one dies.

    `roles`: the run's `Roles` (its `engines`, `weights`, `restart_engine`, `actor_names`);
    `notify`: where the console lines go; `log_dir`: the actors' logs (why an engine died)."""

    def __init__(
        self,
        config: Any,
        roles: Any,
        *,
        notify: Callable[[str], None] | None = None,
        log_dir: str | None = None,
    ) -> None:
        self.config, self.roles, self.log_dir = config, roles, log_dir
        self.notify = notify or (lambda line: print(f"rl-launch: {line}", file=sys.stderr, flush=True))
        self.limit = config.rollout.engine_restarts
        self.restarts: list[EngineRestart] = []
        self._calls: dict[int, _Call] = {}  # id(future) -> the call, until collected
        self._replaced: dict[int, tuple[Any, Any]] = {}  # id(lost future) -> (it, its re-issued call)
        self._unlogged_s = 0.0  # restart seconds since the last `metrics()`
        # engines restarted by a sync's failure, their calls issued once it is sent again:
        # index -> (cause, kind, start seconds, when the sync began)
        self._unfinished: dict[int, tuple[str, str, float, float]] = {}

    # ------------------------------------------------------------------------------------------
    # The ActorGroup the rollouts use

    @property
    def engines(self) -> Any:
        return self.roles.engines

    @property
    def actors(self) -> list:
        return self.engines.actors

    def __len__(self) -> int:
        return len(self.engines)

    def submit_to(self, rank: int, method: str, *args: Any, concurrency_group: str | None = None) -> Any:
        """`ActorGroup.submit_to`, remembered until `get` returns its result (to issue it again
        should the engine die meanwhile)."""
        future = self.engines.submit_to(rank, method, *args, concurrency_group=concurrency_group)
        self._calls[id(future)] = _Call(future, rank, method, args, concurrency_group)
        return future

    def submit(
        self,
        method: str,
        *args: Any,
        per_rank: Sequence[tuple] | None = None,
        concurrency_group: str | None = None,
    ) -> list:
        calls = per_rank if per_rank is not None else [args] * len(self)
        return [
            self.submit_to(rank, method, *call, concurrency_group=concurrency_group)
            for rank, call in enumerate(calls)
        ]

    def get(self, futures: Sequence[Any]) -> list:
        """`ray.get(futures)`; when an engine died, or has calls still out after
        `health.engine_stall_stop_s` (hung), it is restarted (`restart`), the calls lost with it
        are issued again and their results stand in for the lost ones. Any other error, and a
        death once `rollout.engine_restarts` are spent, is raised as it came (a hang as `EngineHung`)."""
        import ray

        futures = list(futures)
        deadline = self.config.health.engine_stall_stop_s
        while True:
            current = [self._current(future) for future in futures]
            if deadline is not None and current:
                _, waiting = ray.wait(current, num_returns=len(current), timeout=deadline)
                if waiting:
                    self._recover(self._hung(waiting, deadline), send=True)
                    continue
            try:
                results = ray.get(current)
            except Exception as error:
                self._recover(error, send=True)
                continue
            for future in [*futures, *current]:
                self._calls.pop(id(future), None)
                self._replaced.pop(id(future), None)
            return results

    def call(self, method: str, *args: Any, per_rank: Sequence[tuple] | None = None) -> list:
        return self.get(self.submit(method, *args, per_rank=per_rank))

    # ------------------------------------------------------------------------------------------
    # Weight syncs that find a dead engine

    def send(self, version: int) -> dict[str, float]:
        """`WeightSync.send(version)`; when an engine died, it is restarted and joined (without
        a version of its own), the sync is sent again to every engine, and only then are the
        restarted engine's lost calls issued again (on the weights of `version`)."""
        while True:
            try:
                metrics = self.roles.weights.send(version)
                break
            except Exception as error:
                self._recover(error, send=False)
        unfinished, self._unfinished = self._unfinished, {}
        for index, (cause, kind, start_s, synced_from) in unfinished.items():
            self._finish(index, cause, kind, start_s, time.perf_counter() - synced_from, sent=True)
        return metrics

    def settle(self) -> dict[str, float]:
        """`WeightSync.settle()`; a dead engine's receipts are dropped by its restart."""
        while True:
            try:
                return self.roles.weights.settle()
            except Exception as error:
                self._recover(error, send=True)

    # ------------------------------------------------------------------------------------------
    # Restarts

    def metrics(self) -> dict[str, float]:
        """engine/restarts (so far in this run), of them engine/restarts/dead (engines that died)
        and engine/restarts/hung (engines a deadline gave up on), and engine/restart_s (seconds the
        restarts took since the last call)."""
        took, self._unlogged_s = self._unlogged_s, 0.0
        hung = sum(restart.kind == "hung" for restart in self.restarts)
        return {
            "engine/restarts": float(len(self.restarts)),
            "engine/restarts/dead": float(len(self.restarts) - hung),
            "engine/restarts/hung": float(hung),
            "engine/restart_s": took,
        }

    @property
    def restarts_left(self) -> int:
        """Restarts `rollout.engine_restarts` still allows in this run."""
        return max(self.limit - len(self.restarts) - len(self._unfinished), 0)

    def current(self, future: Any) -> Any:
        """The call that stands for `future` now: its re-issued call on a restarted engine (after
        any number of restarts), else `future` itself. Wait on this, never on a hung engine's call."""
        return self._current(future)

    def _hung(self, waiting: Sequence[Any], deadline: float) -> EngineHung:
        """The engines of the calls `waiting` (still out after `deadline` seconds of `get`)."""
        out = {id(future) for future in waiting}
        calls = [call for call in self._calls.values() if id(call.future) in out]
        methods = ", ".join(sorted({call.method for call in calls})) or "a call"
        return EngineHung(
            sorted({call.index for call in calls}),
            f"no answer to {methods} within {deadline:g} s (health.engine_stall_stop_s)",
        )

    def dead_engines(self, error: BaseException) -> list[int]:
        """The indices of the engines that died, as far as `error` and a probe tell: the actor a
        `RayActorError` names, else every engine whose probe fails with one. [] when `error` is
        not a death (nor a failure an engine's death can cause: Ray's report of a failed call)."""
        return list(self._failed_engines(error)[0])

    def _failed_engines(self, error: BaseException) -> tuple[dict[int, BaseException], list[int]]:
        """(dead, silent): each dead engine's index with the error that shows its death (`error`
        when it names the engine, else the engine's failed probe: a learner's broadcast that lost
        its peer is not why the engine died), and the engines whose probe did not answer within
        `PROBE_S` (hung: a live engine answers `alive` from a thread of its own at once)."""
        import ray

        from .diagnosis import is_actor_failure

        ids = {}
        for index, actor in enumerate(self.actors):
            try:
                ids[actor._actor_id.hex()] = index
            except AttributeError:  # the in-process fakes have no actor ids
                continue
        actor_id = getattr(error, "actor_id", None)
        named = ids.get(
            actor_id.hex() if hasattr(actor_id, "hex") and not isinstance(actor_id, str) else actor_id
        )
        if named is not None and (_died(error) or _engine_dead(error)):
            return {named: error}, []
        if not (_died(error) or is_actor_failure(error)):
            return {}, []
        probes = [
            self.engines.submit_to(index, "alive", concurrency_group=ACTIVITY_GROUP)
            for index in range(len(self))
        ]
        answered, _ = ray.wait(probes, num_returns=len(probes), timeout=PROBE_S)
        answered_ids = {id(probe) for probe in answered}
        dead: dict[int, BaseException] = {}
        silent: list[int] = []
        for index, probe in enumerate(probes):
            if id(probe) not in answered_ids:
                silent.append(index)
                continue
            try:
                ray.get(probe)
            except Exception as failure:
                if _died(failure):
                    dead[index] = failure
        return dead, silent

    def _recover(self, error: BaseException, *, send: bool) -> None:
        """Restart the engines that `error` (or a probe after it) says died or hung; raise `error`
        when none did, and when the restarts left cannot cover them (a hang as `EngineHung`,
        naming the options)."""
        if isinstance(error, EngineHung):
            dead, hung, what = {}, error.engines, error.what
        else:
            dead, hung = self._failed_engines(error)
            what = f"no answer to a probe within {PROBE_S:g} s after: {str(error).strip()[:200]}"
        if not dead and not hung:
            raise error
        if len(dead) + len(hung) > self.restarts_left:
            if not hung:
                raise error
            spent = (
                f"rollout.engine_restarts = {self.limit} restarts are spent"
                if self.limit
                else "rollout.engine_restarts is 0 (a hung engine is not restarted)"
            )
            raise EngineHung(
                hung,
                f"{what}; the run stops, as {spent}. Raise rollout.engine_restarts to restart hung engines "
                "more often, or the deadline named when an engine legitimately takes longer",
            ) from error
        for index, death in dead.items():
            self.restart(index, death, send=send)
        for index in hung:
            self.restart(index, f"hung: {what}", send=send)

    def restart(self, index: int, why: BaseException | str, *, send: bool = True) -> EngineRestart | None:
        """Kill engine `index` (dead already, or hung: `why` says so in words), start it again on
        its bundle, join it to the weight sync and give it the last version sent, then issue its
        lost calls again; the record. `why` a string: the engine hung (the caller's words, counted
        in engine/restarts/hung); an error: it died. With `send` False (a sync found the death) it only joins:
        `send` sends the version to every engine again and then issues the calls (None here).
        Raises RuntimeError when `rollout.engine_restarts` are spent."""
        name = f"engine-{index}"
        cause = self._cause(why)
        kind = "hung" if isinstance(why, str) else "dead"
        if len(self.restarts) + len(self._unfinished) >= self.limit:
            raise RuntimeError(f"{name} {cause}; rollout.engine_restarts = {self.limit} restarts are spent")
        count = len(self.restarts) + len(self._unfinished) + 1
        self.notify(
            f"{name} {cause}; restarting it (restart {count} of {self.limit}, rollout.engine_restarts)"
        )
        weights = self.roles.weights
        began = time.perf_counter()
        self.roles.restart_engine(index)
        started = time.perf_counter()
        if not send:
            if weights is not None:
                weights.rejoin(index, send=False)
            self._unfinished[index] = (cause, kind, started - began, started)
            return None
        if weights is not None:
            weights.rejoin(index)
        return self._finish(
            index, cause, kind, started - began, time.perf_counter() - started, sent=weights is not None
        )

    def _finish(
        self, index: int, cause: str, kind: str, start_s: float, sync_s: float, *, sent: bool
    ) -> EngineRestart:
        """Issue engine `index`'s lost calls again, keep the record, say it on the console."""
        version = self.roles.weights.version if self.roles.weights is not None else 0
        record = EngineRestart(index, cause, kind, start_s, sync_s, version, self._reissue(index))
        self.restarts.append(record)
        self._unlogged_s += record.seconds
        given = f"weights of version {version} in {sync_s:.1f} s" if sent else "no weight sync"
        self.notify(
            f"engine-{index} restarted in {record.seconds:.1f} s (started in {start_s:.1f} s, {given}); "
            f"{record.reissued} generation call{'s' if record.reissued != 1 else ''} issued again"
        )
        return record

    def _cause(self, why: BaseException | str) -> str:
        """ "died (Ray's words); why: ..." for an error, the words themselves for a hang."""
        if isinstance(why, str):
            return why
        from .diagnosis import death_cause, describe_actor_failure

        names = self.roles.actor_names()
        name, text = describe_actor_failure(why, names, self.log_dir)
        text = text.splitlines()[0].removeprefix(f"{name or 'a Ray actor'} ").rstrip(".")
        reason = death_cause(why, names, self.log_dir)
        return text + (f"; why: {reason}" if reason else "")

    def _current(self, future: Any) -> Any:
        """The call standing for `future`: its re-issued call after restarts, else itself."""
        while id(future) in self._replaced:
            future = self._replaced[id(future)][1]
        return future

    def _reissue(self, index: int) -> int:
        """Submit every call of engine `index` that did not return a result again, on its new
        actor; the number of generation calls among them."""
        import ray

        lost = [call for call in self._calls.values() if call.index == index]
        count = 0
        for call in lost:
            ready, _ = ray.wait([call.future], num_returns=1, timeout=0)
            if ready:
                try:
                    ray.get(call.future)
                    continue  # it finished before the engine died: its result stands
                except Exception:
                    pass
            del self._calls[id(call.future)]
            new = self.submit_to(index, call.method, *call.args, concurrency_group=call.concurrency_group)
            self._replaced[id(call.future)] = (call.future, new)
            count += call.method == "generate"
        return count
