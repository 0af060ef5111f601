"""The hybrid engine (`ray.colocate all`): who holds the GPU memory, engines or learners.

The step loop hands the memory over at three points, the same calls with or without colocation:

    generation  ->  `to_training`       the engines sleep, the learners reload their states
    training    ->  `wake_engines`      the engines wake for the weight sync (it reads the
                                        learners' weights on the GPU)
    sync        ->  `offload_learners`  the learners' states leave the GPU for the generation

`HandOff` is the no-op of a run without colocation; `HybridEngine` moves the memory. Given the
step's `PhaseTimer`, a call times itself as a phase ("sleep", "wake", "offload") when the run
hands memory over every step (`swapping`), so the phases appear in the metrics only then.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

from .config import PPOConfig

__all__ = ["HandOff", "HybridEngine", "hand_off_for"]


class HandOff:
    """No colocation: engines and learners keep their memory; every call is a no-op."""

    engines_asleep = False
    swapping = False

    def to_training(self, timer: Any = None) -> None:
        """After generation (and eval): the engines sleep, the learners reload their states."""

    def wake_engines(self, timer: Any = None) -> None:
        """After training: the engines wake before the weight sync."""

    def offload_learners(self, timer: Any = None) -> None:
        """After the weight sync: the learners' states leave the GPU for the generation."""

    def to_generation(self) -> None:
        """Before generating: engines awake, learners' states off the GPU (`to_training`'s inverse)."""
        self.wake_engines()
        self.offload_learners()

    @contextlib.contextmanager
    def learner_states(self) -> Iterator[None]:
        """The learners' states on their device for the duration (a checkpoint, an export)."""
        yield

    def describe(self) -> str | None:
        """The start-up line of the hybrid engine (None without `ray.colocate all`)."""
        return None


def _phase(timer: Any, name: str, swapping: bool) -> Any:
    return timer.phase(name) if timer is not None and swapping else contextlib.nullcontext()


class HybridEngine(HandOff):
    """`ray.colocate all`: engines and learners share the GPUs and take turns holding the memory.

    `groups`: the learner groups (role -> `ActorGroup`), `engines`: the engines' group, `device`:
    "cuda" or "cpu" (the learners offload on GPU runs only)."""

    def __init__(self, config: PPOConfig, groups: Mapping[str, Any], engines: Any, device: str) -> None:
        self.config, self.groups, self.engines, self.device = config, groups, engines, device
        self.engines_asleep = False
        self.learners_offloaded = False

    @property
    def swapping(self) -> bool:
        """Whether GPU memory goes from one side to the other every step (the engines sleep, or the
        learners offload); the step loop times those phases only then."""
        return self.config.ray.engine_sleep or bool(self._offloading())

    def _offloading(self) -> list[str]:
        """The learner roles that free GPU memory while the engines generate (GPU runs only)."""
        return list(self.groups) if self.config.ray.learner_offload and self.device == "cuda" else []

    def _move_learner_states(self, method: str) -> None:
        """`offload_states` or `reload_states` on every rank of every offloading role, at once."""
        import ray

        ray.get([future for role in self._offloading() for future in self.groups[role].submit(method)])

    def to_training(self, timer: Any = None) -> None:
        """Once generation (and eval) are done: the engines sleep (level 1: vLLM keeps the weights in
        host memory and drops its KV cache), then the learners reload their DeepSpeed states for the
        forwards and training."""
        with _phase(timer, "sleep", self.swapping):
            if self.config.ray.engine_sleep and not self.engines_asleep:
                # the engines' `get`: an engine that died is restarted, then put to sleep (`rl_launch.supervisor`)
                self.engines.get(self.engines.submit("sleep", 1))
                self.engines_asleep = True
            if self.learners_offloaded:
                self._move_learner_states("reload_states")
                self.learners_offloaded = False

    def wake_engines(self, timer: Any = None) -> None:
        """After training: the engines wake (before the weight sync, which needs them awake; the
        learners still hold their states, so the sync reads the weights on the GPU)."""
        with _phase(timer, "wake", self.swapping):
            if self.engines_asleep:
                self.engines.get(self.engines.submit("wake_up"))
                self.engines_asleep = False

    def offload_learners(self, timer: Any = None) -> None:
        """After the weight sync: the learners offload their DeepSpeed states (GPU runs) so that the
        engines have the memory to generate."""
        with _phase(timer, "offload", self.swapping):
            if not self.learners_offloaded and self._offloading():
                self._move_learner_states("offload_states")
                self.learners_offloaded = True

    @contextlib.contextmanager
    def learner_states(self) -> Iterator[None]:
        offloaded = self.learners_offloaded
        if offloaded:
            self._move_learner_states("reload_states")
            self.learners_offloaded = False
        try:
            yield
        finally:
            if offloaded:
                self._move_learner_states("offload_states")
                self.learners_offloaded = True

    def describe(self) -> str | None:
        if self.config.ray.engine_sleep:
            line = "hybrid engine (ray.colocate all): the engines sleep after generation and wake before the weight sync"
            if not all(self.engines.call("can_sleep")):
                line += f" (the {self.config.rollout.engine} engine cannot sleep here: the calls are no-ops)"
        else:
            line = "hybrid engine (ray.colocate all): the engines stay awake, weights and KV cache resident (ray.engine_sleep false)"
        if not self.config.ray.learner_offload:
            states = "FSDP2" if self.config.train.backend == "fsdp2" else "DeepSpeed"
            return (
                line
                + f"; the learners keep their {states} states on their devices (ray.learner_offload false)"
            )
        if self.device != "cuda":
            return (
                line + "; DeepSpeed state offload is skipped on CPU (the states already live in host memory)"
            )
        plans = {role: self.groups[role].call("offload_plan")[0] for role in self.groups}
        return (
            line
            + "; learners while the engines generate: "
            + ", ".join(
                f"{role} {'offloads: ' if kind != 'none' else 'stays: '}{why}"
                for role, (kind, why) in plans.items()
            )
        )


def hand_off_for(config: PPOConfig, groups: Mapping[str, Any], engines: Any, device: str) -> HandOff:
    """The hybrid engine under `ray.colocate all`, the no-op otherwise."""
    return HybridEngine(config, groups, engines, device) if config.ray.colocate == "all" else HandOff()
