"""In-process stand-ins for the Ray actors of a run: the step loop in milliseconds, without Ray.

What `rl_launch.ppo`, `rl_launch.roles` and `rl_launch.rollouts` need from Ray is small:

- an `ActorGroup`: `submit(method, *args, per_rank=...)`, `call(...)`, `len()`, `kill()` and
  `actors[i].<method>.remote(...)` (what `Rollouts.submit` calls on each engine);
- `ray.get` and `ray.wait` on what those return (imported inside the functions that use them).

`FakeGroup` is that `ActorGroup` over plain Python workers: a call runs at once, in submission
order (as a Ray actor serves its calls in order), and returns a `Done` holding the result or the
error. `use_fake_ray(monkeypatch)` puts a module with only `get` and `wait` in `sys.modules["ray"]`
for the test, so `import ray` inside the loop gets it; a new Ray call in the loop then fails here
by name (AttributeError on the fake module) instead of starting a cluster.

The workers are toys with the real workers' method signatures (`rl_launch.actors.RolloutWorker`,
`LearnerWorker`) and wire formats (encoded `PromptSample`s in, encoded `Trajectory`s out,
`WeightSyncReport`s), deterministic and a few tensors big:

- `ToyEngine`: n responses of `response_length` tokens per prompt, rewards from `reward(prompt,
  sample)`, stamped with the policy version it last received; remembers every generate call.
  `die_on_generate = k`: its k-th generate call (from 1) kills it, and that call and every later
  one fail as a dead Ray actor's do (`RayActorError`); `FakeGroup.replace` puts a new one in its
  place (`rl_launch.supervisor`), from the group's `make_worker`, and marks the old one `killed`.
  `hang_on_generate = k`: its k-th generate call and every later one never return (a hung engine:
  `ray.wait` never reports them, and `ray.get` on one fails the test, as it would hang the run).
- `ToyLearner`: log-probs / values / scores of constant value, a `train_step` that counts
  updates and remembers which groups it saw, a "weight" (the update count) that `sync` puts on
  a `Wire` and the engines read back as their checksum, checkpoints kept in a dict.

`fake_run(config, ...)` builds a real `Roles` (with its `Placement`, hand-off and `WeightSync`),
`Rollouts` and `PPOTrainer` over them.
"""

from __future__ import annotations

import dataclasses
import os
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import torch

from rl_data import PromptSample, Trajectory, WeightSyncReport, decode, encode

# ----------------------------------------------------------------------------------------------
# Futures, ray.get / ray.wait, actor groups


@dataclasses.dataclass
class Done:
    """A call that has run: its result, or the error `ray.get` re-raises."""

    value: Any = None
    error: BaseException | None = None
    ready: bool = True  # False: `ray.wait(..., timeout=0)` reports it as still running
    hung: bool = False  # never finishes: no `ray.wait` reports it, `ray.get` fails the test

    def result(self) -> Any:
        if self.hung:
            raise AssertionError(
                "ray.get on a call that never returns (a hung engine's): the run would hang here"
            )
        if self.error is not None:
            raise self.error
        return self.value


def _get(futures: Any, timeout: float | None = None) -> Any:
    if isinstance(futures, Done):
        return futures.result()
    return [future.result() for future in futures]


def _wait(futures: Sequence[Done], num_returns: int = 1, timeout: float | None = None) -> tuple[list, list]:
    done = [future for future in futures if future.ready]
    # A wait that may block (no timeout, or one > 0) lasts until the oldest calls still running
    # have finished, as many as it needs; timeout=0 only looks.
    if (timeout is None or timeout > 0) and len(done) < num_returns:
        for future in futures:
            if len(done) >= num_returns:
                break
            if future.hung:
                if timeout is None:
                    raise AssertionError(
                        "ray.wait without a timeout on a call that never returns: the run would hang"
                    )
                continue
            if not future.ready:
                future.ready = True
                done.append(future)
        done = [future for future in futures if future.ready]
    return done[:num_returns], [future for future in futures if future not in done[:num_returns]]


class RayError(Exception):
    """`ray.exceptions.RayError` of the fake module (`rl_launch.diagnosis.is_actor_failure`)."""


class RayActorError(RayError):
    """What `ray.get` raises for a call on a dead actor (`rl_launch.diagnosis` knows it by name)."""


FAKE_RAY = types.ModuleType("ray", "ray.get and ray.wait over `Done` values (tests/launch/fakes.py)")
FAKE_RAY.get = _get
FAKE_RAY.wait = _wait
FAKE_RAY.exceptions = types.SimpleNamespace(RayError=RayError, RayActorError=RayActorError)


def use_fake_ray(monkeypatch: Any) -> None:
    """`import ray` gives `FAKE_RAY` until the test ends."""
    monkeypatch.setitem(__import__("sys").modules, "ray", FAKE_RAY)


class CallLog(list):
    """Every call on every fake group, in order: (role, method, rank)."""

    def methods(self, role: str | None = None) -> list[str]:
        """`role.method` of each call (rank 0 only, so one entry per group call)."""
        return [f"{r}.{m}" for r, m, rank in self if rank == 0 and (role is None or r == role)]


class _Handle:
    """`actor.<method>.remote(*args)` for `Rollouts.submit`."""

    def __init__(self, group: FakeGroup, rank: int) -> None:
        self._group, self._rank = group, rank

    def __getattr__(self, method: str) -> Any:
        return types.SimpleNamespace(remote=lambda *args: self._group.run(self._rank, method, args))


class FakeGroup:
    """`rl_launch.actors.ActorGroup` over in-process workers (one per rank)."""

    def __init__(
        self, role: str, workers: Sequence[Any], log: CallLog, make_worker: Callable[[], Any] | None = None
    ) -> None:
        self.role, self.workers, self.log = role, list(workers), log
        self.make_worker = make_worker  # a new worker for `replace`
        self.replaced: list[int] = []  # the ranks `replace` started again, in order
        self.actors = [_Handle(self, rank) for rank in range(len(self.workers))]
        self.late: set[str] = set()  # methods whose results `ray.wait(timeout=0)` sees as not ready
        # which generate calls a blocking `ray.wait` sees as still running (it then finishes the
        # oldest of them): slow(rank, encoded samples) -> True for a long-tailed call
        self.slow: Callable[[int, tuple], bool] | None = None
        self.killed = False
        self.terminated = False

    def __len__(self) -> int:
        return len(self.workers)

    def run(self, rank: int, method: str, args: tuple) -> Done:
        self.log.append((self.role, method, rank))
        ready = method not in self.late and not (
            method == "generate" and self.slow is not None and self.slow(rank, args)
        )
        worker = self.workers[rank]
        if getattr(worker, "dead", False):
            return Done(error=RayActorError(f"The actor {self.role}-{rank} died unexpectedly (a fake death)"))
        try:
            value = getattr(worker, method)(*args)
            if value is HANG:
                return Done(ready=False, hung=True)
            return Done(value, ready=ready)
        except Exception as error:  # re-raised by ray.get, as Ray does
            return Done(error=error)

    def submit(
        self,
        method: str,
        *args: Any,
        per_rank: Sequence[tuple] | None = None,
        concurrency_group: str | None = None,
    ) -> list[Done]:
        calls = per_rank if per_rank is not None else [args] * len(self.workers)
        if len(calls) != len(self.workers):
            raise ValueError(f"FakeGroup {self.role}: {len(calls)} calls for {len(self.workers)} ranks")
        return [self.run(rank, method, tuple(call)) for rank, call in enumerate(calls)]

    def submit_to(self, rank: int, method: str, *args: Any, concurrency_group: str | None = None) -> Done:
        return self.run(rank, method, args)

    def call(self, method: str, *args: Any, per_rank: Sequence[tuple] | None = None) -> list:
        return _get(self.submit(method, *args, per_rank=per_rank))

    def get(self, futures: Sequence[Done]) -> list:
        return _get(list(futures))

    def replace(self, rank: int) -> Any:
        if self.make_worker is None:
            raise RuntimeError(f"FakeGroup {self.role}: replace({rank}) without make_worker")
        self.workers[rank].killed = True  # `ray.kill`, dead already or hung
        self.workers[rank] = self.make_worker()
        self.replaced.append(rank)
        return self.actors[rank]

    def terminate(self) -> list[Done]:
        self.terminated = True
        return [Done(None) for _ in self.workers]

    def kill(self) -> None:
        self.killed = True


# ----------------------------------------------------------------------------------------------
# Toy workers


@dataclasses.dataclass
class Wire:
    """What the policy last sent: (version, checksum); the engines read it on `receive`."""

    version: int = 0
    checksum: int = 0


def alternating_reward(prompt: PromptSample, sample: int) -> float:
    """1 for every other sample: every group has mean 0.5 (kept by dynamic filtering)."""
    return float(sample % 2)


HANG = object()
"""What a toy worker's method returns for a call that never returns (`FakeGroup.run`)."""


class ToyEngine:
    """`RolloutWorker`'s methods over a deterministic toy sampler (no model, no tokenizer)."""

    def __init__(
        self,
        wire: Wire,
        *,
        reward: Callable[[PromptSample, int], float] = alternating_reward,
        response_length: int = 3,
        logprob: float = -1.0,
    ) -> None:
        self.wire, self.reward, self.response_length, self.logprob = wire, reward, response_length, logprob
        self.version = 0
        self.generated: list[dict[str, Any]] = []  # one entry per generate call
        self.corrupt = False  # receive reports a checksum that differs from the one sent
        self.asleep = False
        self.die_on_generate: int | None = None  # this generate call (from 1) kills the engine
        self.dead = False  # every call fails as a dead actor's (`FakeGroup.run`)
        self.hang_on_generate: int | None = None  # this generate call (from 1) and later ones never return
        self.killed = False  # `FakeGroup.replace` put a new engine in its place
        self.synced_with: list[Any] = []  # the specs `init_sync` joined

    def ready(self) -> Any:
        from rl_launch.placement import EngineReady

        return EngineReady(sync_size=1, node="node-0")

    def generate(
        self, samples: bytes, sampling: Any, first_group_id: int, greedy_baseline: bool = False
    ) -> bytes:
        prompts = decode(samples, list[PromptSample])
        if self.asleep:
            raise RuntimeError("ToyEngine.generate: the engine is asleep")
        if self.die_on_generate is not None and len(self.generated) + 1 >= self.die_on_generate:
            self.dead = True
            raise RayActorError("The actor died unexpectedly before finishing this task (a fake SIGKILL)")
        if self.hang_on_generate is not None and len(self.generated) + 1 >= self.hang_on_generate:
            return HANG  # a hung call is not in `generated`: the later ones hang too
        self.generated.append(
            {
                "indices": [prompt.index for prompt in prompts],
                "first_group_id": first_group_id,
                "n": sampling.n,
                "seed": sampling.seed,
                "version": self.version,
                "greedy_baseline": greedy_baseline,
            }
        )
        records = []
        for offset, prompt in enumerate(prompts):
            for sample in range(sampling.n):
                response = [
                    3 + (prompt.index + sample + position) % 5 for position in range(self.response_length)
                ]
                reward = self.reward(prompt, sample)
                extra: dict[str, Any] = {
                    "sample_index": prompt.index,
                    "source": prompt.source,
                    "row": prompt.row,
                }
                if greedy_baseline:
                    extra["baseline_reward"] = self.reward(prompt, 0)
                records.append(
                    Trajectory(
                        prompt_ids=prompt.prompt_ids,
                        response_ids=torch.tensor(response),
                        rollout_logprobs=torch.full((self.response_length,), self.logprob),
                        reward=reward,
                        group_id=first_group_id + offset,
                        policy_version=self.version,
                        label=prompt.label,
                        extra=extra,
                    )
                )
        return encode(records)

    def init_sync(self, spec: Any, rank: int) -> None:
        self.synced_with.append((spec, rank))

    def alive(self) -> bool:
        return True

    def helpers(self) -> None:
        return None

    def receive(self, version: int, payload: Any = None) -> WeightSyncReport:
        self.version = version
        checksum = self.wire.checksum + (1 if self.corrupt else 0)
        return WeightSyncReport(version=version, num_bytes=16, seconds=0.0, checksums=(checksum,))

    def can_sleep(self) -> bool:
        return True

    def sleep(self, level: int = 1) -> bool:
        self.asleep = True
        return True

    def wake_up(self) -> bool:
        self.asleep = False
        return True

    def policy_version(self) -> int:
        return self.version

    def activity(self) -> tuple[float, float]:
        """(idle, wall) seconds: a toy engine is idle a quarter of every step."""
        return 0.25, 1.0

    def close(self) -> None:
        pass


class ToyLearner:
    """`LearnerWorker`'s methods over a toy model whose one "weight" counts its updates."""

    def __init__(self, role: str, rank: int, wire: Wire, checkpoints: dict, *, logprob: float = -1.0) -> None:
        self.role, self.rank, self.wire, self.checkpoints = role, rank, wire, checkpoints
        self.logprob = logprob
        self.updates = 0
        self.trained: list[dict[str, Any]] = []  # one entry per train_step: groups and loss
        self.offloaded = False
        self.saves: list[dict[str, Any]] = []  # one entry per save: step, keep_last, keep_tags

    def _per_token(self, parts: list, value: float) -> list[torch.Tensor]:
        return [torch.full(part.input_ids.shape, value) * part.action_mask for part in parts]

    def logprobs(
        self, parts: list, temperature: float, router_replay: str = "disabled"
    ) -> list[torch.Tensor]:
        return self._per_token(parts, self.logprob)

    def values(self, parts: list) -> list[torch.Tensor]:
        return self._per_token(parts, 0.25)

    def scores(self, parts: list) -> list[torch.Tensor]:
        return [torch.full(part.rewards.shape, 0.5) for part in parts]

    def train_step(self, parts: list, loss: Any) -> dict[str, float]:
        if self.offloaded:
            raise RuntimeError(f"ToyLearner {self.role}: train_step with the states offloaded")
        self.updates += 1
        groups = sorted({int(g) for part in parts for g in part.group_ids.tolist()})
        sequences = [
            (int(group), tuple(part.input_ids[start:end].tolist()))
            for part in parts
            for group, start, end in zip(part.group_ids, part.cu_seqlens[:-1], part.cu_seqlens[1:])
        ]
        advantages = [part.advantages for part in parts if part.advantages is not None]
        self.trained.append(
            {
                "teacher_logprobs": [part.teacher_logprobs for part in parts],
                "groups": groups,
                "sequences": sorted(sequences),
                "loss": loss,
                "has_advantages": len(advantages) == len(parts),
            }
        )
        return {"loss": 1.0 / self.updates, "grad_norm": 0.5}

    def sync_layout(self, dtype: str) -> None:
        return None

    def init_sync(self, spec: Any) -> None:
        self.synced_with = [*getattr(self, "synced_with", []), spec]

    def sync(self, version: int) -> tuple[WeightSyncReport, None]:
        """(report, payload) like `LearnerWorker.sync`; a toy transport has no payload."""
        if self.rank == 0:
            self.wire.version, self.wire.checksum = version, self.updates
        return WeightSyncReport(version=version, num_bytes=16, seconds=0.0, checksums=(self.updates,)), None

    def release_sync(self) -> None:
        pass

    def offload_states(self) -> bool:
        self.offloaded = True
        return True

    def reload_states(self) -> bool:
        self.offloaded = False
        return True

    def save(self, root: str, step: int, state: Any, keep_last: int, keep_tags: tuple[str, ...] = ()) -> str:
        path = os.path.join(root, f"global_step{step}")
        self.saves.append({"step": step, "keep_last": keep_last, "keep_tags": tuple(keep_tags)})
        # as on disk: the state comes back as JSON (`rl_learner.load_checkpoint`)
        self.checkpoints[(root, f"global_step{step}", self.rank)] = (msgspec.json.encode(state), self.updates)
        return path

    def load(self, root: str, tag: str) -> Any:
        from rl_learner import TrainingState

        state, self.updates = self.checkpoints[(root, tag, self.rank)]
        return msgspec.json.decode(state, type=TrainingState)

    def close(self) -> None:
        pass


# ----------------------------------------------------------------------------------------------
# A run over the toys


class RecordingTracker:
    """`rl_launch.tracking.Tracker`'s loop-facing methods: what was logged, in order."""

    def __init__(self) -> None:
        self.logged: list[tuple[int, dict[str, float]]] = []
        self.completions: list[tuple[int, list]] = []
        self.messages: list[str] = []
        self.restored: list[tuple[int, dict]] = []
        self.warnings: list[str] = []  # the console's warning lines (an engine's restart)

    def restore_step(self, step: int, metrics: dict | None) -> None:
        if metrics:
            self.restored.append((step, dict(metrics)))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.logged.append((step, dict(metrics)))

    def log_completions(self, step: int, rows: list) -> None:
        self.completions.append((step, rows))

    def message(self, text: str) -> None:
        self.messages.append(text)

    def steps(self) -> list[int]:
        return [step for step, _ in self.logged]


class ToyTokenizer:
    """`decode` for the `log.completions` rows: token ids as text."""

    def decode(self, ids: list[int]) -> str:
        return " ".join(str(token) for token in ids)


def toy_prompts(count: int, *, source: str = "toy.jsonl") -> list[PromptSample]:
    """`count` prompts of 4 tokens each; `index` and `row` are their positions."""
    return [
        PromptSample(
            prompt_ids=torch.tensor([1, 2, 3, 4 + i % 7]), index=i, source=source, row=i, label=str(i)
        )
        for i in range(count)
    ]


@dataclasses.dataclass
class FakeRun:
    """A real `PPOTrainer` with real `Roles` and `Rollouts` over toy workers."""

    trainer: Any
    roles: Any
    rollouts: Any
    engines: list[ToyEngine]
    learners: dict[str, list[ToyLearner]]
    log: CallLog
    wire: Wire
    checkpoints: dict
    tracker: RecordingTracker = dataclasses.field(default_factory=RecordingTracker)

    def fit(self, start: Any = None) -> RecordingTracker:
        from rl_learner import TrainingState

        self.trainer.fit(self.tracker, start if start is not None else TrainingState(step=0))
        return self.tracker


def fake_run(
    config: Any,
    *,
    prompts: Sequence[PromptSample] | None = None,
    eval_prompts: Sequence[PromptSample] | None = None,
    ranks: int = 1,
    engines: int = 1,
    reward: Callable[[PromptSample, int], float] = alternating_reward,
    shuffle: bool = True,
    ckpt_root: Path | str = "/nonexistent/checkpoints",
    resume_from: dict[str, Path] | None = None,
    checkpoints: dict | None = None,
    device: str = "cpu",
) -> FakeRun:
    """Build the loop of `config` over toy workers: `ranks` per learner role (policy, plus ref /
    teacher / critic / reward_model when the config needs them; the reward model scores 0.5; the teacher's log-probs are −1.5, the others'
    −1), `engines` toy engines. Call under `use_fake_ray`.

    `resume_from` (role -> checkpoint folder) and `checkpoints` (an earlier run's store) make the
    run plan resume, as `rl_launch.runs` would after a restart. `shuffle`: the prompt loader's.
    `device`: the run's ("cuda": the hybrid engine's learners offload their states).
    """
    from rl_data.datasets import PromptLoader
    from rl_launch.components.estimators import estimator_needs
    from rl_launch.handoff import hand_off_for
    from rl_launch.placement import Placement
    from rl_launch.ppo import PPOTrainer
    from rl_launch.roles import Roles
    from rl_launch.rollouts import make_rollouts
    from rl_launch.runs import RunPlan
    from rl_launch.supervisor import EngineSupervisor
    from rl_launch.weights import WeightSync, weight_sync_strategy

    log, wire = CallLog(), Wire()
    store = checkpoints if checkpoints is not None else {}
    roles = Roles(config)
    roles.device, roles.dtype = device, "fp32"
    names = (
        ["policy"]
        + (["ref"] if config.needs_reference else [])
        + (["teacher"] if config.needs_teacher else [])
        + (["critic"] if estimator_needs(config.algo.advantage.estimator).critic else [])
        + (["reward_model"] if config.model.reward_pretrain is not None else [])
    )
    # a teacher that likes every sampled token less than the policy does: d_t = −1 − (−1.5) = 0.5
    logprob = {"teacher": -1.5}
    learners = {
        name: [ToyLearner(name, rank, wire, store, logprob=logprob.get(name, -1.0)) for rank in range(ranks)]
        for name in names
    }
    roles.groups = {name: FakeGroup(name, workers, log) for name, workers in learners.items()}
    toy_engines = [ToyEngine(wire, reward=reward) for _ in range(engines)]

    def new_engine() -> ToyEngine:  # a restarted engine (`Roles.restart_engine`)
        engine = ToyEngine(wire, reward=reward)
        toy_engines.append(engine)
        return engine

    roles.engines = FakeGroup("engine", list(toy_engines), log, make_worker=new_engine)
    roles.placement = Placement.of(
        device, [engine.ready() for engine in toy_engines], [("node-0", ())] * ranks
    )
    tracker = RecordingTracker()
    roles.supervisor = EngineSupervisor(config, roles, notify=tracker.warnings.append)
    roles.hand_off = hand_off_for(config, roles.groups, roles.supervisor, device)
    # the strategy as `WeightSync.start` resolves it, without its rendezvous (the toys need none)
    strategy = weight_sync_strategy(config, roles.placement)
    roles.weights = WeightSync(
        config, strategy, roles.groups["policy"], roles.engines, roles.placement, roles.hand_off
    )
    data = list(prompts if prompts is not None else toy_prompts(4 * config.rollout.rollout_batch_size))
    loader = PromptLoader(
        data, batch_size=config.rollout.prompts_per_round, seed=config.train.seed, shuffle=shuffle
    )
    rollouts = make_rollouts(config, roles.supervisor, loader)
    plan = RunPlan(
        run_id="fake",
        fingerprint="fake",
        output_dir=Path(ckpt_root).parent,
        ckpt_root=Path(ckpt_root),
        resume=resume_from is not None,
        step=0,
        checkpoints=dict(resume_from or {}),
        changes=[],
        message="",
    )
    eval_data = list(eval_prompts) if eval_prompts else None
    trainer = PPOTrainer(config, roles, rollouts, eval_data, plan, tokenizer=ToyTokenizer())
    return FakeRun(trainer, roles, rollouts, toy_engines, learners, log, wire, store, tracker)
