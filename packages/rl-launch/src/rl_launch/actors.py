"""The Ray actors of a run: DeepSpeed learners (one per data-parallel rank) and rollout engines.

A `LearnerWorker` holds one rank of one role: the policy and the critic train, the reference
and the reward model only run forwards. The ranks of a role form their own torch.distributed
world (their own master port), so roles never share a process group. A `RolloutWorker` holds one
engine (vLLM or transformers) and runs an `rl_rollout` executor with the reward function next
to it; records travel back in the `rl_data` wire format.

`ActorGroup` is the driver's handle on the actors of one role: it starts them in their placement
group and calls a method on every rank at once.
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from rl_learner import DeepSpeedConfig, LoraOptions, OptimizerConfig

from .config import RewardConfig
from .placement import EngineReady
from .plugins import PluginRef, import_plugins

__all__ = ["ActorGroup", "EngineActivity", "EngineSpec", "LearnerSpec", "LearnerWorker", "RolloutWorker"]

LEARNER_ROLES = ("policy", "ref", "teacher", "critic", "reward_model")
CAUSAL_LM_ROLES = ("policy", "ref", "teacher")
"""The roles whose model is a causal LM scored by its token log-probs (`PolicyLearner`)."""


class LearnerSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What one learner rank builds: the model, its DeepSpeed engine and (if it trains) optimizer."""

    role: str
    model_path: str
    dtype: str
    deepspeed: DeepSpeedConfig
    optimizer: OptimizerConfig | None = None
    total_steps: int = 1
    lora: LoraOptions | None = None
    seed: int = 42
    on_non_finite: str = "skip"
    ema_beta: float | None = None
    """The policy only: keep a `rl_learner.WeightEMA` of its weights with this decay (train.ema_beta)."""
    log_dir: str | None = None
    """Folder of the actor's output file (`<role>-<rank>.log`); None: Ray's own handling."""
    plugins: tuple[PluginRef, ...] = ()
    """User modules (`--plugin`) imported before anything else, so their registered losses resolve here."""


class EngineSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What one rollout worker builds: the engine, the tokenizer and the reward function."""

    kind: str
    """The engine's name in `rl_launch.components.ENGINES` (rollout.engine)."""
    options: dict[str, Any] = msgspec.field(default_factory=dict)
    """Keyword options of that engine, verbatim (rollout.engine_options)."""
    executor: str = "single_turn"
    """The executor's name in `rl_launch.components.EXECUTORS` (`components.executor_name`)."""
    executor_options: dict[str, Any] = msgspec.field(default_factory=dict)
    """Keyword options of that executor, verbatim (rollout.executor_options)."""
    agent_func_path: str | None = None
    """rollout.agent_func_path as an absolute path (the agent file multi_turn runs)."""
    model_path: str
    dtype: str
    max_model_len: int
    seed: int
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.6
    max_num_seqs: int | None = None
    enforce_eager: bool = False
    reward_function: str | None = None
    """reward.function, or the preset's when no reward source is given."""
    reward: RewardConfig = msgspec.field(default_factory=RewardConfig)
    """The reward section: the servers, weights and request options (`build_reward`)."""
    log_dir: str | None = None
    """Folder of the actor's output file (`engine-<index>.log`); None: Ray's own handling."""
    plugins: tuple[PluginRef, ...] = ()
    """User modules (`--plugin`) imported before anything else, so their registrations exist here."""
    partial_rollout: bool = False
    """rollout.partial_rollout: weight syncs reach the engine while it generates (`RECEIVE_GROUP`)."""
    streaming: bool = False
    """rollout.streaming: one `generate` call per group, several at once (`GENERATE_GROUP`)."""
    vllm_logging_level: str = "ERROR"
    """VLLM_LOGGING_LEVEL in the actor, set before anything imports vLLM (the driver's, or ERROR)."""
    lora_rank: int = 0
    """The policy's LoRA rank when the engine serves its adapter (model.lora_sync adapter,
    `rl_launch.lora_sync`): vLLM starts with LoRA enabled for that rank; 0: no adapter."""


def send_output_to(log_dir: str | None, name: str) -> None:
    """Point this process's stdout and stderr at `log_dir/name.log` (appending).

    The file descriptors themselves are replaced, so C++ and child-process output (vLLM's engine
    core, DeepSpeed's op builds, NCCL) land there too. Nothing changes when `log_dir` is None.
    """
    if log_dir is None:
        return
    path = Path(log_dir) / f"{name}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(descriptor, 1)
    os.dup2(descriptor, 2)
    os.close(descriptor)
    print(f"{name}: pid {os.getpid()} on {socket.gethostname()}", flush=True)  # for a diagnosis


class LearnerWorker:
    """One data-parallel rank of one role (Ray actor class; see `ActorGroup`).

    Started in two phases (`rl_launch.rendezvous`): the constructor only records who it is;
    `node` reports where the actor runs (rank 0 also opens the rendezvous store there and reports
    its port); `setup` joins the role's process group at rank 0's address and builds the model
    and its DeepSpeed engine.
    """

    def __init__(self, spec: LearnerSpec, rank: int, world_size: int) -> None:
        send_output_to(spec.log_dir, f"{spec.role}-{rank}")
        # First: a PolicyLossConfig checks its loss name against POLICY_LOSSES as it arrives here.
        import_plugins(spec.plugins)
        self.spec, self.rank, self.world_size = spec, rank, world_size
        self.learner = None
        self.ema = None
        self.sender = None
        self._store = None
        self._sync_holds: list[Any] = []

    def node(self, timeout_s: float) -> tuple[str, str, int | None]:
        """(Ray node id, node IP address, rendezvous port on rank 0 / None on the others)."""
        import ray

        from .rendezvous import open_master_store

        port = None
        if self.rank == 0:
            self._store = open_master_store(self.world_size, timeout_s)
            port = self._store.port
        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), port

    def setup(self, master_addr: str, master_port: int, node_local_rank: int, timeout_s: float) -> bool:
        """Join the role's process group at `master_addr:master_port`, then build the learner."""
        self.join(master_addr, master_port, node_local_rank, timeout_s)
        self._build()
        return True

    def join(self, master_addr: str, master_port: int, node_local_rank: int, timeout_s: float) -> None:
        """Join the role's process group at `master_addr:master_port` (LOCAL_RANK set first)."""
        import ray

        from .rendezvous import device_local_rank, join_process_group

        spec, world_size = self.spec, self.world_size
        local_rank = device_local_rank(
            node_local_rank, ray.get_gpu_ids(), os.environ.get("CUDA_VISIBLE_DEVICES")
        )
        os.environ["LOCAL_RANK"] = str(local_rank)
        print(
            f"{spec.role} rank {self.rank}/{world_size} on node {ray.util.get_node_ip_address()} "
            f"(LOCAL_RANK {local_rank}) joins at {master_addr}:{master_port}",
            flush=True,
        )
        join_process_group(
            store=self._store,
            master_addr=master_addr,
            master_port=master_port,
            rank=self.rank,
            world_size=world_size,
            timeout_s=timeout_s,
        )

    def _build(self) -> None:
        """The role's model, its DeepSpeed engine and (for the policy, when asked) its EMA."""
        import torch

        from rl_learner import PolicyLearner, ValueLearner, apply_lora, load_causal_lm, load_value_model

        from .learner_settings import model_load_options

        spec = self.spec
        torch.manual_seed(spec.seed)
        options = model_load_options(spec.deepspeed, spec.optimizer, world_size=self.world_size)
        if spec.role in CAUSAL_LM_ROLES:
            model = load_causal_lm(spec.model_path, **options)
        else:
            model = load_value_model(spec.model_path, head_seed=spec.seed, **options)
        if spec.lora is not None:
            model = apply_lora(model, spec.lora)
        learner_class = PolicyLearner if spec.role in CAUSAL_LM_ROLES else ValueLearner
        self.learner = learner_class(
            model,
            deepspeed=spec.deepspeed,
            optimizer=spec.optimizer,
            total_steps=spec.total_steps,
            on_non_finite=spec.on_non_finite,
        )
        offload = " (CPU offload)" if getattr(self.learner.engine, "cpu_offload", False) else ""
        print(
            f"{spec.role} rank {self.rank}: {type(self.learner.engine).__name__} built{offload}", flush=True
        )
        if spec.ema_beta is not None:
            from rl_learner import WeightEMA

            self.ema = WeightEMA(self.learner.engine, spec.ema_beta)

    def logprobs(self, parts: list, temperature: float, router_replay: str = "disabled") -> list:
        """Log-probs at the action tokens (0 elsewhere): the loop reads nothing else."""
        return self.learner.logprobs(
            parts, temperature=temperature, only_actions=True, router_replay=router_replay
        )

    def values(self, parts: list) -> list:
        return self.learner.values(parts)

    def scores(self, parts: list) -> list:
        return self.learner.scores(parts)

    def train_step(self, parts: list, loss: Any) -> dict[str, float]:
        """One optimizer step (policy or critic: `loss` is a PolicyLossConfig or ValueLossConfig);
        the EMA of the weights follows every applied step (a skipped one changed nothing)."""
        metrics = self.learner.train_step(parts, loss)
        if self.ema is not None and not metrics.get("skipped"):
            self.ema.update(self.learner.engine)
        return metrics

    def sync_layout(self, dtype: str) -> Any:
        """The `WeightSyncMeta` the engines must accept: names, shapes and `dtype` of every tensor."""
        from rl_learner import sync_layout
        from rl_learner.config import torch_dtype

        return sync_layout(self.learner.engine, dtype=torch_dtype(dtype))

    def adapter_layout(self, dtype: str) -> tuple[Any, Any, int]:
        """LoRA adapter sync (`rl_learner.adapter_sync`): (the `WeightSyncMeta` of the adapter tensors
        in `dtype`, the `LoraAdapter` the engines serve, the merged model's bytes for comparison)."""
        from rl_learner import adapter_layout, lora_adapter, sync_layout
        from rl_learner.config import torch_dtype

        engine, wire = self.learner.engine, torch_dtype(dtype)
        merged = sync_layout(engine, dtype=wire).total_bytes
        return adapter_layout(engine, dtype=wire), lora_adapter(engine), merged

    def prepare_sync(self, fn: Any) -> Any:
        """`fn(self)` for a weight-sync strategy's start (`SyncContext.on_policy_rank_0`, rank 0): what it
        makes on this node (a port, a folder); `hold_until_sync` keeps a resource open meanwhile."""
        return fn(self)

    def hold_until_sync(self, resource: Any) -> None:
        """Keep `resource` (with a `close()`: a socket holding a port) until `init_sync` has built
        the sender, which then serves what it held."""
        self._sync_holds.append(resource)

    def location(self) -> tuple[str, list[str]]:
        """(Ray node id, the GPU ids Ray gave this actor): where the hybrid engine and the sync
        strategy (`rl_launch.placement.Placement`) look for engines on the same GPU."""
        import ray

        return ray.get_runtime_context().get_node_id(), [str(gpu) for gpu in ray.get_gpu_ids()]

    def offload_plan(self) -> tuple[str, str]:
        """What `offload_states` does on this rank (`rl_learner.Learner.offload_plan`)."""
        return self.learner.offload_plan()

    def offload_states(self) -> bool:
        """Hybrid engine: free this rank's GPU memory while the engines generate."""
        return self.learner.offload_states()

    def reload_states(self) -> bool:
        """Hybrid engine: bring the states back before forwards and training."""
        return self.learner.reload_states()

    def init_sync(self, spec: Any) -> None:
        """Join the weight-sync transport of `spec` (blocks until every engine has joined a group)."""
        from rl_learner import make_sender

        if self.sender is not None:  # a new group after an engine restart (`WeightSync.rejoin`)
            with contextlib.suppress(Exception):  # its peers may be gone
                self.sender.close()
            self.sender = None
        try:
            self.sender = make_sender(spec, self.learner.engine)
        finally:
            held, self._sync_holds = self._sync_holds, []
            for resource in held:  # the sender serves what they held now
                resource.close()

    def sync(self, version: int) -> tuple[Any, Any]:
        """Send the current weights; every rank calls. (the `WeightSyncReport`, None off the sending
        ranks; the sender's `payload` for the engines, None where the transport carries it all:
        CUDA IPC's `IpcPayload`, whose buffers stay until `release_sync`)."""
        report = self.sender.send(version)
        return report, self.sender.payload

    def release_sync(self) -> None:
        """Free what the last send keeps for the engines (`WeightSender.release`)."""
        self.sender.release()

    def save(self, root: str, step: int, state: Any, keep_last: int, keep_tags: tuple[str, ...] = ()) -> str:
        """A checkpoint of this role (the EMA too, when there is one); rotation keeps the newest
        `keep_last` and the tags in `keep_tags` (the best checkpoint)."""
        from rl_learner import save_checkpoint

        tensors = {"ema": self.ema.state_dict()} if self.ema is not None else None
        return str(
            save_checkpoint(
                root,
                step,
                {self.spec.role: self.learner.engine},
                state,
                keep_last=keep_last,
                keep_tags=tuple(keep_tags),
                tensors=tensors,
            )
        )

    def load(self, root: str, tag: str) -> Any:
        from rl_learner import load_checkpoint, load_checkpoint_tensors

        state = load_checkpoint(root, {self.spec.role: self.learner.engine}, tag=tag)
        if self.ema is not None:
            saved = load_checkpoint_tensors(root, "ema", tag=tag)
            if saved is None:
                raise RuntimeError(
                    f"checkpoint {root}/{tag} holds no EMA of the policy, but train.ema_beta is set "
                    "(the run that wrote it kept none)"
                )
            self.ema.load_state_dict(saved if self.rank == 0 else {}, updates=self.learner.step)
        return state

    def export(self, path: str, tokenizer_path: str) -> str:
        from rl_learner import export_hf

        return str(export_hf(self.learner.engine, path, tokenizer=_exported_processor(tokenizer_path)))

    def export_ema(self, path: str, tokenizer_path: str) -> str:
        """The EMA of the policy's weights as an HF folder (the model's own weights elsewhere:
        buffers, and anything that does not train)."""
        from rl_learner import export_hf

        replace = self.ema.export_names(self.learner.engine)
        return str(
            export_hf(
                self.learner.engine, path, tokenizer=_exported_processor(tokenizer_path), replace=replace
            )
        )

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
            self.sender = None


def build_reward(spec: EngineSpec, judge: Any = None) -> RewardSources:
    """The reward of a rollout worker: Σ_k w_k·r_k over its sources (`RewardConfig.sources`).

    The sources are `spec.reward_function` (a registered reward, `rl_launch.components.REWARDS`,
    or an OpenRLHF `reward_func` file; the zero reward when there is no source at all), then one
    `rl_rollout.RemoteRewardClient` per URL of `reward.remote_url`, with the request options of
    the reward section, then the judge when reward.judge_pretrain is set (`rl_launch.judge.build_judge`
    over the engine `judge`: a `RemoteJudgeEngine` in a rollout actor). The values of
    `reward.headers_env` name environment variables of this actor; their values become the headers
    (a missing variable is an error naming the option).
    `spec.reward_function` runs with the deadline `reward.function_timeout_s` per call and the
    policy `reward.on_error` / `reward.fallback` (`rl_rollout.BatchedReward`), as the servers do.
    """
    from rl_rollout import BatchedReward, RemoteRewardClient, WeightedSumReward, load_reward_function

    from .components import REWARDS

    reward = spec.reward
    headers = {}
    for header, variable in reward.headers_env.items():
        if variable not in os.environ:
            raise RuntimeError(
                f"reward.headers_env.{header}: the environment variable {variable} is not set in the rollout actor"
            )
        headers[header] = os.environ[variable]
    functions: list[Any] = []
    name = spec.reward_function
    if name is not None:
        policy = {
            "on_error": reward.on_error,
            "fallback": reward.fallback,
            "timeout_s": reward.function_timeout_s,
        }
        if name in REWARDS:
            functions.append(BatchedReward(REWARDS[name](), name=f"reward.function {name}", **policy))
        else:
            functions.append(load_reward_function(name, **policy))
    elif not reward.urls and reward.judge_pretrain is None:
        functions.append(BatchedReward(lambda queries, prompts, labels: [0.0] * len(queries), name="zero"))
    for url in reward.urls:
        functions.append(
            RemoteRewardClient(
                url,
                batch_size=reward.batch_size,
                timeout_s=reward.timeout_s,
                max_retries=reward.retries,
                on_error=reward.on_error,
                fallback=reward.fallback,
                headers=headers,
            )
        )
    if reward.judge_pretrain is not None:
        if judge is None:
            raise RuntimeError("reward.judge_pretrain is set, but this rollout actor was given no judge")
        from .judge import build_judge

        functions.append(build_judge(spec, judge))
    # the preset's function stands in only where no source is given (`preflight.resolve_inputs`),
    # so the functions line up with RewardConfig.sources
    sources = reward.sources
    weights = reward.weights or [1.0] * len(sources)
    kept = {source: _KeepExtraLogs(function) for source, function in zip(sources, functions, strict=True)}
    combined = WeightedSumReward({source: (kept[source], weight) for source, weight in zip(sources, weights)})
    return RewardSources(combined, kept)


class _KeepExtraLogs:
    """A reward source that remembers the `extra_logs` of its last call on each thread
    (`WeightedSumReward` keeps only each source's rewards; a streaming engine scores on many)."""

    def __init__(self, function: Any) -> None:
        import threading

        self.function = function
        self._local = threading.local()

    @property
    def extra_logs(self) -> dict[str, Any]:
        return getattr(self._local, "extra_logs", {})

    @property
    def failed(self) -> tuple[list[int], list[int]]:
        """(fallback indices, timeout indices) of this thread's last call."""
        return getattr(self._local, "failed", ([], []))

    def __call__(self, queries: Any, prompts: Any, labels: Any) -> Any:
        output = self.function(queries, prompts, labels)
        self._local.extra_logs = output.extra_logs
        self._local.failed = (list(output.fallback_indices), list(output.timeout_indices))
        return output


class RewardSources:
    """The weighted sum of a worker's reward sources, able to write its last call's logs into records.

    After a call on B samples, `annotate(records)` (the B records of those samples, in order) sets
    `record.extra["reward_sources"]` = {source: its own reward of that sample} and
    `record.extra["reward_logs"]` = {key: value} from the sources' `extra_logs`: a list of B numbers
    gives each record its own; a number, or a list of another length (one value per request),
    gives every record the mean. Values that are not numbers are left out. The driver averages
    both over a step (`rl_launch.algorithm.reward_metrics`). A record some source gave a fallback
    gets `record.extra["reward_fallback_sources"]` (their names) and, when it was for a timeout,
    `record.extra["reward_timeout_sources"]` (`rl_launch.rollouts.rollout_metrics` counts them). The last call is remembered per
    thread: a streaming engine runs several generate calls at once, each scores and annotates its own.
    """

    def __init__(self, combined: Any, sources: dict[str, _KeepExtraLogs]) -> None:
        import threading

        self.combined = combined
        self.sources = sources
        self.name = combined.name
        self._local = threading.local()

    def __call__(self, queries: Any, prompts: Any, labels: Any) -> Any:
        self._local.last = self.combined(queries, prompts, labels)
        return self._local.last

    def annotate(self, records: list) -> None:
        last, self._local.last = getattr(self._local, "last", None), None
        size = len(records)
        # Only when one call scored exactly these records (an executor may score otherwise).
        if last is None or len(last.rewards) != size:
            return
        per_source = {source: last.extra_logs[source] for source in self.sources}
        logs: dict[str, list[float]] = {}
        for source in self.sources.values():
            for key, value in source.extra_logs.items():
                values = _numbers(value)
                if values:
                    logs[str(key)] = values if len(values) == size else [sum(values) / len(values)] * size
        fell_back: dict[int, list[str]] = {}
        timed_out: dict[int, list[str]] = {}
        for name, source in self.sources.items():
            fallbacks, timeouts = source.failed
            for index in fallbacks:
                fell_back.setdefault(index, []).append(name)
            for index in timeouts:
                timed_out.setdefault(index, []).append(name)
        for index, record in enumerate(records):
            record.extra["reward_sources"] = {source: float(r[index]) for source, r in per_source.items()}
            if logs:
                record.extra["reward_logs"] = {key: values[index] for key, values in logs.items()}
            if index in fell_back:  # which sources gave this record a fallback (rollout_metrics)
                record.extra["reward_fallback_sources"] = fell_back[index]
            if index in timed_out:
                record.extra["reward_timeout_sources"] = timed_out[index]


def _numbers(value: Any) -> list[float]:
    """`value` as a list of finite floats ([] when it holds anything else)."""
    items = value if isinstance(value, (list, tuple)) else [value]
    out = []
    for item in items:
        if isinstance(item, bool) or not isinstance(item, (int, float)) or not math.isfinite(item):
            return []
        out.append(float(item))
    return out


CALL_COUNTERS = ("rollout/server_busy", "rollout/server_unauthorized", "rollout/loop_blocked")
"""Counts an executor keeps of one `generate` call (its `last_metrics`) that no record carries:
the agent server's refusals (503 busy, 401 unauthorized) and event-loop stalls. They ride in the
call's first record as `extra["call_counters"]`, and `rl_launch.rollouts.rollout_metrics` sums
them over the step."""

GENERATE_GROUP = "generate"
"""The Ray concurrency group a streaming run calls `RolloutWorker.generate` in, one call per group
(`rl_launch.rollouts`): its threads run many calls at once and the engine batches them (vLLM's
scheduler takes requests from every thread; `HFEngine` decodes one call at a time)."""

ACTIVITY_GROUP = "activity"
"""The Ray concurrency group of `RolloutWorker.activity`: it answers while generations run."""

RECEIVE_GROUP = "weight_sync"
"""The Ray concurrency group a partial-rollout run calls `RolloutWorker.receive` in: its own thread,
so a sync reaches the engine while a `generate` call runs (an actor otherwise serves its calls one
at a time, and a sync would wait behind the generations queued before it)."""


class _SyncGate:
    """Generations share the engine, a weight sync takes it alone (a readers-writer lock that
    prefers the writer): `receive` waits for the generate calls running, and calls arriving
    meanwhile wait for the sync. What a streaming run without partial rollout needs, where the
    generate calls run in `GENERATE_GROUP` beside the sync instead of queueing before it."""

    def __init__(self) -> None:
        import threading

        self._condition = threading.Condition()
        self._running = 0
        self._syncing = False
        self._waiting_syncs = 0

    def generation(self) -> Any:
        import contextlib

        @contextlib.contextmanager
        def held() -> Any:
            with self._condition:
                self._condition.wait_for(lambda: not self._syncing and not self._waiting_syncs)
                self._running += 1
            try:
                yield
            finally:
                with self._condition:
                    self._running -= 1
                    self._condition.notify_all()

        return held()

    def sync(self) -> Any:
        import contextlib

        @contextlib.contextmanager
        def held() -> Any:
            with self._condition:
                self._waiting_syncs += 1
                self._condition.wait_for(lambda: not self._syncing and not self._running)
                self._waiting_syncs -= 1
                self._syncing = True
            try:
                yield
            finally:
                with self._condition:
                    self._syncing = False
                    self._condition.notify_all()

        return held()


class EngineActivity:
    """How long an engine had no generate call in flight: idle_s over a window of wall_s seconds.

    `begin` / `end` bracket every call (calls may overlap: the engine is busy while any runs);
    `window()` returns (idle seconds, wall seconds) since the last window and starts the next.
    The engine's idle fraction over a step is idle_s / wall_s (time/engine_idle_fraction)."""

    def __init__(self, clock: Any = None) -> None:
        import threading
        import time

        self._clock = clock or time.monotonic
        self._lock = threading.Lock()
        self._running = 0
        self._start = self._idle_since = self._clock()
        self._idle = 0.0

    def begin(self) -> None:
        with self._lock:
            if self._running == 0:
                self._idle += self._clock() - self._idle_since
            self._running += 1

    def end(self) -> None:
        with self._lock:
            self._running -= 1
            if self._running == 0:
                self._idle_since = self._clock()

    def window(self) -> tuple[float, float]:
        with self._lock:
            now = self._clock()
            idle = self._idle + (now - self._idle_since if self._running == 0 else 0.0)
            wall = now - self._start
            self._start, self._idle = now, 0.0
            if self._running == 0:
                self._idle_since = now
            return idle, wall


class EngineHolder:
    """The shutdown calls of an actor that holds an engine in `self.engine` (`RolloutWorker`,
    `rl_launch.judge_worker.JudgeWorker`)."""

    engine: Any

    def helpers(self) -> Any:
        """This actor's process, its engine's helper processes (vLLM's engine core and workers)
        and the shared memory they map: what the driver sweeps should the actor die unclosed."""
        from .leftovers import HelperProcesses

        return HelperProcesses.of_this_process()

    def close(self) -> None:
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()


class RolloutWorker(EngineHolder):
    """One rollout engine with its tokenizer and reward function (Ray actor class).

    Started with the concurrency group `ACTIVITY_GROUP` (`activity` answers while it generates);
    with `EngineSpec.partial_rollout` also `RECEIVE_GROUP`, in which the driver calls `receive`;
    with `EngineSpec.streaming` also `GENERATE_GROUP`, in which the driver calls `generate`, one
    group per call, many at once (without partial rollout a sync then waits for the calls
    running and holds back new ones: `_SyncGate`).
    """

    def __init__(self, spec: EngineSpec, index: int = 0, judge: Any = None) -> None:
        os.environ["VLLM_LOGGING_LEVEL"] = spec.vllm_logging_level  # read when vLLM is imported
        send_output_to(spec.log_dir, f"engine-{index}")
        import_plugins(spec.plugins)
        from transformers import AutoTokenizer

        from rl_data.vision import VisionProcessor, is_vision_model

        from .components import ENGINES, EXECUTORS

        self.spec = spec
        self.tokenizer = AutoTokenizer.from_pretrained(spec.model_path)
        # a VL policy's processor, for an executor that places images an environment returns
        self.vision = (
            VisionProcessor.from_pretrained(spec.model_path, self.tokenizer)
            if EXECUTORS[spec.executor].takes_vision and is_vision_model(spec.model_path)
            else None
        )
        if judge is not None:  # a JudgeWorker handle (reward.judge_pretrain, `rl_launch.judge`)
            from .judge import RemoteJudgeEngine

            judge = RemoteJudgeEngine(judge, spec.reward.judge_timeout_s)
        self.reward_fn = build_reward(spec, judge)

        self.receives_weights = ENGINES[spec.kind].receives_weights
        self.engine = ENGINES[spec.kind].build(spec, **spec.options)
        if spec.partial_rollout and not self.engine.supports("partial_rollout"):
            raise ValueError(
                f"rollout.partial_rollout: rollout engine {spec.kind!r} ({self.engine.name}) cannot take a "
                "weight sync while requests are in flight, with the options it was given or the library installed "
                "(supports('partial_rollout') is False; vllm needs its engine core in the actor and a vLLM that labels "
                "tokens by weight version, LLMEngine.set_weight_version: 0.32 has it, 0.26 does not); drop "
                "rollout.partial_rollout or use an engine that can"
            )
        self.gate = _SyncGate() if spec.streaming and not spec.partial_rollout else None
        self.busy = EngineActivity()

    def ready(self) -> EngineReady:
        """This engine once started (`rl_launch.placement.EngineReady`): the weight-sync ranks it
        takes, its KV-cache bytes (None where vLLM sizes it), the Ray node it runs on, the GPU ids
        Ray gave it, its context (max_model_len, kv_cache_tokens) as the engine has them."""
        import ray

        # A receiving engine takes one rank of a broadcast group per worker process (vLLM: its TP
        # x PP workers, `sync_world_size`; transformers: itself); one that receives nothing, none.
        return EngineReady(
            sync_size=getattr(self.engine, "sync_world_size", 1) if self.receives_weights else 0,
            kv_cache_bytes=getattr(self.engine, "kv_cache_bytes", None),
            node=ray.get_runtime_context().get_node_id(),
            gpus=tuple(str(gpu) for gpu in ray.get_gpu_ids()),
            max_model_len=getattr(self.engine, "max_model_len", None),
            kv_cache_tokens=getattr(self.engine, "kv_cache_tokens", None),
        )

    def generate(
        self, samples: bytes, sampling: Any, first_group_id: int, greedy_baseline: bool = False
    ) -> bytes:
        """Run the run's executor (`EngineSpec.executor`) on encoded `PromptSample`s; encoded
        `Trajectory`s back.

        With `greedy_baseline` (ReMax) each prompt is also answered greedily (one greedy episode
        with multi_turn), and every sampled record of that prompt carries the greedy answer's reward
        as `extra["baseline_reward"]`. What the executor knows about each record rides in
        `record.extra` (multi_turn: turns, episode_error, the agent's extra_logs; single_turn:
        reward_fallback), and the driver logs it (`rl_launch.rollouts.rollout_metrics`).
        """
        import msgspec

        from rl_data import PromptSample, Trajectory, decode, encode

        from .components import EXECUTORS

        prompts = decode(samples, list[PromptSample])
        spec = self.spec

        entry = EXECUTORS[spec.executor]
        vision = {"vision": self.vision} if self.vision is not None else {}

        def run(params: Any) -> list[Trajectory]:
            executor = entry.build(
                engine=self.engine,
                reward_fn=self.reward_fn,
                tokenizer=self.tokenizer,
                sampling=params,
                first_group_id=first_group_id,
                agent_func_path=spec.agent_func_path,
                **vision,
                **spec.executor_options,
            )
            records = executor.run(prompts)
            counters = {
                key: float(value)
                for key, value in getattr(executor, "last_metrics", {}).items()
                if key in CALL_COUNTERS
            }
            if records and counters:
                records[0].extra["call_counters"] = counters
            return records

        import contextlib

        with self.gate.generation() if self.gate is not None else contextlib.nullcontext():
            self.busy.begin()
            try:
                records = run(sampling)
                self.reward_fn.annotate(records)  # per-source rewards and extra_logs ride in record.extra
                if greedy_baseline:
                    greedy = run(msgspec.structs.replace(sampling, n=1, temperature=0.0))
                    baseline = {record.group_id: record.reward for record in greedy}
                    for record in records:
                        record.extra["baseline_reward"] = baseline[record.group_id]
            finally:
                self.busy.end()
        return encode(records)

    def activity(self) -> tuple[float, float]:
        """(seconds with no generate call in flight, wall seconds) since the last call (`EngineActivity`)."""
        return self.busy.window()

    def alive(self) -> bool:
        """True: the driver's probe of a live engine (`rl_launch.supervisor`, in `ACTIVITY_GROUP`, so
        it answers while the engine generates); a dead one's call raises instead."""
        return True

    def init_sync(self, spec: Any, rank: int) -> None:
        self.engine.init_weight_sync(spec, rank=rank)

    def receive(self, version: int, payload: Any = None) -> Any:
        """Receive weights `version` (`payload`: the `IpcPayload` of a CUDA IPC sync, else None)."""
        import contextlib

        with self.gate.sync() if self.gate is not None else contextlib.nullcontext():
            if payload is None:
                return self.engine.receive_weights(version=version)
            return self.engine.receive_weights(version=version, payload=payload)

    def can_sleep(self) -> bool:
        return self.engine.supports("sleep")

    def sleep(self, level: int = 1) -> bool:
        """Hybrid engine: free the engine's memory until `wake_up`; False when it cannot sleep."""
        if not self.engine.supports("sleep"):
            return False
        self.engine.sleep(level)
        return True

    def wake_up(self) -> bool:
        """Undo `sleep`; False when the engine cannot sleep."""
        if not self.engine.supports("sleep"):
            return False
        self.engine.wake_up()
        return True

    def policy_version(self) -> int:
        return self.engine.policy_version


class ActorGroup:
    """The actors of one role, placed on the bundles of a placement group (one actor per bundle)."""

    def __init__(
        self,
        role: str,
        actor_class: type,
        args_per_rank: Sequence[tuple],
        *,
        placement_group: Any,
        num_gpus: float,
        num_cpus: float,
        env: dict[str, str] | None = None,
        concurrency_groups: dict[str, int] | None = None,
    ) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.role = role
        # concurrency groups are a property of the actor class in Ray (not an .options() field)
        remote_class = (
            ray.remote(concurrency_groups=concurrency_groups)(actor_class)
            if concurrency_groups
            else ray.remote(actor_class)
        )

        def start(rank: int) -> Any:
            return remote_class.options(
                num_gpus=num_gpus,
                num_cpus=num_cpus,
                name=None,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=placement_group, placement_group_bundle_index=rank
                ),
                runtime_env={"env_vars": env} if env else None,
            ).remote(*args_per_rank[rank])

        self._start = start
        self.actors = [start(rank) for rank in range(len(args_per_rank))]

    def __len__(self) -> int:
        return len(self.actors)

    def submit(
        self,
        method: str,
        *args: Any,
        per_rank: Sequence[tuple] | None = None,
        concurrency_group: str | None = None,
    ) -> list:
        """Call `method` on every actor without waiting: the same `args`, or `per_rank[i]` on actor i;
        in `concurrency_group` (one the actors were started with) when given."""
        calls = per_rank if per_rank is not None else [args] * len(self.actors)
        return [
            self.submit_to(rank, method, *call, concurrency_group=concurrency_group)
            for rank, call in zip(range(len(self.actors)), calls, strict=True)
        ]

    def submit_to(self, rank: int, method: str, *args: Any, concurrency_group: str | None = None) -> Any:
        """Call `method` on actor `rank` alone without waiting (in `concurrency_group` when given)."""
        bound = getattr(self.actors[rank], method)
        if concurrency_group is not None:
            bound = bound.options(concurrency_group=concurrency_group)
        return bound.remote(*args)

    def call(self, method: str, *args: Any, per_rank: Sequence[tuple] | None = None) -> list:
        """`submit` and wait for every actor's result."""
        return self.get(self.submit(method, *args, per_rank=per_rank))

    def get(self, futures: Sequence[Any]) -> list:
        """The results of calls on these actors (`ray.get`; `rl_launch.supervisor` restarts an engine
        that died instead)."""
        import ray

        return ray.get(list(futures))

    def terminate(self) -> list:
        """Ask every actor to exit once the calls queued before this one are done (Ray's graceful
        end: its exit handlers run); the calls' futures, which end when the actors are gone."""
        return [actor.__ray_terminate__.remote() for actor in self.actors]

    def kill(self) -> None:
        import ray

        for actor in self.actors:
            ray.kill(actor, no_restart=True)

    def replace(self, rank: int) -> Any:
        """Kill actor `rank` (dead already, or hung) and start a new one from the same arguments on
        the same placement bundle, in its place in `actors`; the new actor (its start under way)."""
        import ray

        with contextlib.suppress(Exception):  # it died already
            ray.kill(self.actors[rank], no_restart=True)
        self.actors[rank] = self._start(rank)
        return self.actors[rank]


def _exported_processor(model_path: str) -> Any:
    """What an exported HF folder carries beside the weights: the tokenizer, and for a VL model
    its image processor too (`VisionProcessor.save_pretrained`), so the folder loads as it was given."""
    from transformers import AutoTokenizer

    from rl_data.vision import VisionProcessor, is_vision_model

    if is_vision_model(model_path):
        return VisionProcessor.from_pretrained(model_path)
    return AutoTokenizer.from_pretrained(model_path)
