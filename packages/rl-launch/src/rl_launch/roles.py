"""The actors of a run and every call the step loop makes on them.

`Roles.start(config, inputs)` places the roles (`rl_launch.cluster`), builds each learner's
and engine's spec from the config and waits until every actor is up. Its methods are the
loop's vocabulary: `forwards` (old / reference / teacher log-probs, values, reward-model scores, all roles
at once), `train` (critic and policy on the same mini-batch, at once), `sync_weights`, `save`,
`load`, `export`, and for the hybrid engine (`ray.colocate all`) `to_generation` / `to_training`.
A batch is split over the ranks of a role by token budget
(`rl_data.plan_micro_batches`), and the per-rank results are put back in batch order.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import torch

from rl_data import ExperienceBatch, compare_checksums, micro_batches, plan_micro_batches

from .actors import (
    ACTIVITY_GROUP,
    GENERATE_GROUP,
    RECEIVE_GROUP,
    ActorGroup,
    EngineSpec,
    LearnerSpec,
    LearnerWorker,
    RolloutWorker,
)
from .algorithm import learners_share_prefix
from .cluster import ClusterError, cluster_has_gpus, place_roles, plan_roles
from .components import executor_name
from .config import PPOConfig
from .diagnosis import describe_build_locks, extension_build_locks
from .learner_settings import frozen_offload, learner_dtype, learner_settings, role_optimizer
from .rendezvous import local_ranks

__all__ = ["TRAINED_ROLES", "Roles"]

TRAINED_ROLES = ("policy", "critic")


def _get_all(futures: dict[str, list]) -> dict[str, list]:
    """Wait once for every future of several calls: name -> [result per rank]."""
    import ray

    done = iter(ray.get([future for per_rank in futures.values() for future in per_rank]))
    return {name: [next(done) for _ in per_rank] for name, per_rank in futures.items()}


STARTUP_CHECK_S = 60.0
"""Seconds of start-up after which `_wait_started` looks for a stale DeepSpeed op build lock."""


def _wait_started(futures: list, timeout_s: float, *, check_after_s: float = STARTUP_CHECK_S) -> None:
    """Wait for start-up calls; re-raise the first failure, or say how many are still out.

    After `check_after_s` with calls still out, a torch extension build lock on this machine (a
    local cluster's actors build DeepSpeed's ops here) is named on stderr: a build killed midway
    leaves one, and the actors then wait on it silently until the timeout, whose error names it
    too."""
    import ray

    began = time.monotonic()
    done, waiting = ray.wait(futures, num_returns=len(futures), timeout=min(check_after_s, timeout_s))
    if waiting and check_after_s < timeout_s:
        locks = describe_build_locks(extension_build_locks())
        if locks:
            print(
                f"rl-launch: {len(waiting)} actor calls still starting after {check_after_s:g} s; {locks}",
                file=sys.stderr,
                flush=True,
            )
        left = max(0.0, timeout_s - (time.monotonic() - began))
        more, waiting = ray.wait(waiting, num_returns=len(waiting), timeout=left)
        done += more
    ray.get(done)  # re-raises the first start-up error (model loading, engine start, rendezvous)
    if waiting:
        locks = describe_build_locks(extension_build_locks())
        raise ClusterError(
            f"{len(waiting)} actor calls did not finish within ray.startup_timeout_s = {timeout_s:g} s"
            + (f"; {locks}" if locks else "")
        )


def _assemble(
    batch: ExperienceBatch, parts: Sequence[Sequence[ExperienceBatch]], results: Sequence[Sequence]
) -> torch.Tensor:
    """Per-token results of every rank's micro-batches → one [N] tensor aligned with `batch`."""
    full = torch.zeros(batch.response_action_mask().shape, dtype=torch.float32)
    for rank_parts, rank_results in zip(parts, results, strict=True):
        for part, values in zip(rank_parts, rank_results, strict=True):
            if part.indices.numel():
                view = part.response_view(values.float().cpu())
                full[part.indices, : view.shape[1]] = view
    return batch.from_response_view(full)


def _assemble_scores(
    batch: ExperienceBatch, parts: Sequence[Sequence[ExperienceBatch]], results: Sequence[Sequence]
) -> torch.Tensor:
    scores = torch.zeros(batch.rewards.shape, dtype=torch.float32)
    for rank_parts, rank_results in zip(parts, results, strict=True):
        for part, values in zip(rank_parts, rank_results, strict=True):
            if part.indices.numel():
                scores[part.indices] = values.float().cpu()
    return scores


def engine_concurrency_groups(config: PPOConfig) -> dict[str, int]:
    """The Ray concurrency groups of the engines (`rl_launch.actors`): `activity` always (it answers
    while the engine generates), `weight_sync` with partial rollout (a sync lands between two
    decoding steps), `generate` with streaming, as many threads as one engine's share of the pool
    (`RolloutConfig.stream_pool_groups`) plus one round, so a draw beyond the pool
    (dynamic filtering) does not queue; at most `MAX_GENERATE_THREADS` (calls beyond them wait in
    Ray's queue for a thread, so the engine then batches that many groups at once)."""
    r = config.rollout
    groups = {ACTIVITY_GROUP: 1}
    if r.partial_rollout:
        groups[RECEIVE_GROUP] = 1
    if r.streaming:
        share = math.ceil((r.stream_pool_groups + r.prompts_per_round) / r.num_engines)
        groups[GENERATE_GROUP] = min(share, MAX_GENERATE_THREADS)
    return groups


MAX_GENERATE_THREADS = 512
"""The most generate calls (groups) one streaming engine actor runs at once: each waits on a
thread of its own, and thousands of threads in one process cost more than the batch gains."""


def default_max_num_seqs(config: PPOConfig) -> int:
    """Sequences one engine runs at once when rollout.max_num_seqs is not given: its share of what
    is generated together, prompts x n_samples_per_prompt, the prompts being one sampling round
    (prompts_per_round) or, with streaming, the pool (`RolloutConfig.stream_pool_groups`)."""
    r = config.rollout
    prompts = r.stream_pool_groups if r.streaming else r.prompts_per_round
    return math.ceil(prompts / r.num_engines) * r.n_samples_per_prompt


def _header_variables(config: PPOConfig) -> dict[str, str]:
    """The variables `reward.headers_env` names, for the engines' runtime environment on a joined
    cluster (`ray.address`), whose actors do not inherit the driver's environment. A local cluster's
    actors inherit it, and nothing is passed: Ray's runtime-env agent writes the variables it sets
    into its session log."""
    if config.ray.address is None:
        return {}
    return {name: os.environ[name] for name in config.reward.headers_env.values() if name in os.environ}


class Roles:
    """The learner groups (`groups[role]`) and the rollout engines of one run."""

    def __init__(self, config: PPOConfig, *, plugins: tuple = ()) -> None:
        self.config = config
        self.plugins = plugins
        self.groups: dict[str, ActorGroup] = {}
        self.engines: ActorGroup | None = None
        self.device = "cpu"  # "cuda" or "cpu", resolved from the cluster by `start`
        self.placement: dict[str, Any] = {}
        self.kv_cache_bytes: list[int | None] = []
        self.engine_contexts: list[dict[str, int | None]] = []  # max_model_len, kv_cache_tokens
        self.engine_gpus: list[list[str]] = []
        self.policy_locations: list[tuple[str, list[str]]] = []
        self.engines_asleep = False
        self.learners_offloaded = False
        self.engine_helpers: list[Any] = []  # rl_launch.leftovers.HelperProcesses per engine
        self._receipts: list[tuple[Any, list]] = []  # async mode: syncs whose receipts are not compared yet
        self._engines_closing: list | None = None  # the engines' `close` calls (`close_engines`)
        self.sync_spec: Any = None  # the WeightSyncSpec both sides joined (`init_weight_sync`)
        self.started = False  # every actor finished its start (`start` returned)

    # ------------------------------------------------------------------------------------------
    # Start-up

    def start(self, inputs: Any, *, log_dir: str | None, total_steps: int) -> None:
        """Place every role, start its actors and wait (at most `ray.startup_timeout_s`)."""
        import ray

        cfg = self.config
        use_gpus = cfg.ray.device == "cuda" or (cfg.ray.device == "auto" and cluster_has_gpus())
        self.device = "cuda" if use_gpus else "cpu"
        self.dtype = learner_dtype(cfg.model.dtype, use_gpus=use_gpus)
        layouts = {layout.role: layout for layout in plan_roles(cfg, use_gpus=use_gpus)}
        self.placement = place_roles(list(layouts.values()), timeout_s=cfg.ray.startup_timeout_s)
        timeout_s = cfg.ray.startup_timeout_s
        # The engines first: theirs is the longest start (vLLM's imports, the model, the KV cache).
        # No runtime environment of their own on a local cluster (`_header_variables`), so Ray can
        # hand them a worker process it started ahead of time.
        engine = layouts["engine"]
        self.engines = ActorGroup(
            "engine",
            RolloutWorker,
            [(self._engine_spec(inputs, use_gpus, log_dir), index) for index in range(engine.num_actors)],
            placement_group=self.placement[engine.group],
            num_gpus=engine.num_gpus,
            num_cpus=engine.num_cpus,
            concurrency_groups=engine_concurrency_groups(cfg),
            env=_header_variables(cfg) or None,
        )
        engine_ready = self.engines.submit("ready")
        for role, spec in self._learner_specs(inputs, total_steps).items():
            if role not in layouts:
                continue
            layout = layouts[role]
            spec = msgspec.structs.replace(spec, log_dir=log_dir, plugins=self.plugins)
            self.groups[role] = ActorGroup(
                role,
                LearnerWorker,
                [(spec, rank, layout.num_actors) for rank in range(layout.num_actors)],
                placement_group=self.placement[layout.group],
                num_gpus=layout.num_gpus,
                num_cpus=layout.num_cpus,
            )
        # Two phases (rl_launch.rendezvous): every learner says where it runs, rank 0 of each role
        # opens its rendezvous store there; then every rank joins at rank 0's address and loads
        # its model, while the engines start.
        located = {role: group.submit("node", timeout_s) for role, group in self.groups.items()}
        _wait_started([future for futures in located.values() for future in futures], timeout_s)
        futures = []
        located = _get_all(located)
        for role, nodes in located.items():
            _, master_addr, master_port = nodes[0]
            ranks = local_ranks([node_id for node_id, _, _ in nodes])
            futures += self.groups[role].submit(
                "setup", per_rank=[(master_addr, master_port, local, timeout_s) for local in ranks]
            )
        _wait_started(futures + engine_ready, timeout_s)
        engines = ray.get(engine_ready)
        self.engine_sync_sizes = [size for size, _, _, _, _ in engines]
        self.kv_cache_bytes = [kv for _, kv, _, _, _ in engines]
        self.engine_nodes = [node for _, _, node, _, _ in engines]
        self.engine_gpus = [gpus for _, _, _, gpus, _ in engines]
        self.engine_contexts = [context for _, _, _, _, context in engines]
        self.engine_helpers = ray.get(self.engines.submit("helpers"))  # swept at shutdown
        self.started = True
        self.policy_node = located["policy"][0][0]
        self.policy_locations = [tuple(location) for location in self.groups["policy"].call("location")]

    def _learner_specs(self, inputs: Any, total_steps: int) -> dict[str, LearnerSpec]:
        cfg, dtype = self.config, self.dtype
        actor = learner_settings(cfg.model, cfg.train, dtype=dtype, **role_optimizer(cfg.train, "actor"))
        critic = learner_settings(cfg.model, cfg.train, dtype=dtype, **role_optimizer(cfg.train, "critic"))
        ds = actor.deepspeed
        use_gpus = self.device == "cuda"
        common = {"dtype": dtype, "seed": cfg.train.seed}
        return {
            "policy": LearnerSpec(
                role="policy",
                model_path=inputs.model_path,
                # only the policy trains a vision tower (a critic or teacher may be a text model)
                deepspeed=msgspec.structs.replace(ds, freeze_visual_encoder=cfg.model.freeze_visual_encoder),
                lora=actor.lora,
                optimizer=actor.optimizer,
                total_steps=total_steps,
                ema_beta=cfg.train.ema_beta,
                **common,
            ),
            "ref": LearnerSpec(
                role="ref",
                model_path=inputs.model_path,
                deepspeed=actor.frozen(offload=cfg.ray.ref.offload, use_gpus=use_gpus),
                **common,
            ),
            "teacher": LearnerSpec(
                role="teacher",
                model_path=inputs.teacher_path or "",
                deepspeed=actor.frozen(offload=cfg.ray.teacher.offload, use_gpus=use_gpus),
                **common,
            ),
            "critic": LearnerSpec(
                role="critic",
                model_path=inputs.critic_path,
                deepspeed=ds,
                optimizer=critic.optimizer,
                total_steps=total_steps,
                **common,
            ),
            "reward_model": LearnerSpec(
                role="reward_model",
                model_path=inputs.reward_model_path or "",
                deepspeed=actor.frozen(offload=cfg.ray.reward_model.offload, use_gpus=use_gpus),
                **common,
            ),
        }

    def _engine_spec(self, inputs: Any, use_gpus: bool, log_dir: str | None) -> EngineSpec:
        cfg = self.config
        r = cfg.rollout
        options = dict(r.engine_options)
        if self.hybrid and cfg.ray.engine_sleep and use_gpus and r.engine == "vllm":
            # vLLM can sleep only when started with its sleep-mode allocator; a user's own setting wins.
            options.setdefault("enable_sleep_mode", True)
        return EngineSpec(
            kind=r.engine,
            options=options,
            executor=executor_name(cfg),
            executor_options=dict(r.executor_options),
            agent_func_path=(
                None if r.agent_func_path is None else str(Path(r.agent_func_path).expanduser().resolve())
            ),
            model_path=inputs.model_path,
            dtype=self.dtype,
            max_model_len=cfg.data.prompt_max_len + r.generate_max_len,
            seed=r.seed,
            tensor_parallel_size=r.tensor_parallel_size,
            gpu_memory_utilization=r.gpu_memory_utilization,
            max_num_seqs=r.max_num_seqs or default_max_num_seqs(cfg),
            enforce_eager=r.enforce_eager or not use_gpus,
            reward_function=inputs.reward_function,
            reward=cfg.reward,
            log_dir=log_dir,
            plugins=self.plugins,
            partial_rollout=r.partial_rollout,
            streaming=r.streaming,
            # vLLM logs every weight reload at INFO and WARNING; that would bury the progress bar.
            vllm_logging_level=os.environ.get("VLLM_LOGGING_LEVEL", "ERROR"),
        )

    def engine_policy_ranks(self) -> list[int | None]:
        """For each engine, the policy rank whose GPU it runs on (it holds exactly that one GPU, on
        that rank's node), or None: the engines a CUDA IPC sync can reach from each rank."""
        ranks: list[int | None] = []
        for node, gpus in zip(self.engine_nodes, self.engine_gpus, strict=True):
            match = None
            if len(gpus) == 1:
                for rank, (policy_node, policy_gpus) in enumerate(self.policy_locations):
                    if policy_node == node and list(policy_gpus) == list(gpus):
                        match = rank
                        break
            ranks.append(match)
        return ranks

    def sync_placement(self) -> Any:
        """The facts `weight_sync.choose_weight_sync` decides auto from."""
        from .components import ENGINES
        from .components.weight_sync import SyncPlacement

        return SyncPlacement(
            device=self.device,
            engine_receives=ENGINES[self.config.rollout.engine].receives_weights,
            engines_on_policy_gpus=bool(self.engine_nodes)
            and all(rank is not None for rank in self.engine_policy_ranks()),
            engines_on_policy_node=all(node == self.policy_node for node in self.engine_nodes),
        )

    def weight_sync_strategy(self) -> str:
        """`rollout.weight_sync`, with auto resolved from the placement (`weight_sync.choose_weight_sync`):
        none for an engine that cannot receive, ipc for engines on the policy's GPUs, broadcast
        across GPUs (NCCL) or nodes (gloo), shm for CPU engines on the node of policy rank 0."""
        from .components.weight_sync import choose_weight_sync

        chosen = self.config.rollout.weight_sync
        return choose_weight_sync(self.sync_placement()) if chosen == "auto" else chosen

    def on_policy_rank_0(self, fn: Any) -> Any:
        """`fn(worker)` run inside the actor of policy rank 0 (the sender), its result: what a weight
        sync's start function makes on the sender's machine (a port it holds, a folder). `fn` must
        be a module-level function (Ray sends it by reference)."""
        import ray

        return ray.get(self.groups["policy"].actors[0].prepare_sync.remote(fn))

    def init_weight_sync(self) -> str:
        """Policy DP rank 0 sends, every engine worker receives (`weight_sync.SYNC_STRATEGIES`); a
        description of the strategy for the start-up line."""
        import ray

        from .components.weight_sync import SYNC_STRATEGIES

        strategy = self.weight_sync_strategy()
        if strategy == "none":
            return "none (the engines keep the weights they started with; the run is off-policy after step 1)"
        layout = self.groups["policy"].call("sync_layout", self.dtype)[0]
        spec, description = SYNC_STRATEGIES[strategy].start(self, layout)
        self.sync_spec = spec
        offsets = [1 + sum(self.engine_sync_sizes[:i]) for i in range(len(self.engine_sync_sizes))]
        futures = self.groups["policy"].submit("init_sync", spec)
        futures += self.engines.submit("init_sync", per_rank=[(spec, offset) for offset in offsets])
        ray.get(futures)
        return description

    # ------------------------------------------------------------------------------------------
    # The step's calls

    def split(self, batch: ExperienceBatch, role: str) -> list[list[ExperienceBatch]]:
        """`batch` planned over the ranks of `role`: each rank's micro-batches (dynamic batching).

        When the learners run shared prompts once, a group's samples stay in one micro-batch. With
        model.sequence_parallel_size sp > 1 the plan is made for the role's ranks / sp groups, each
        micro-batch holds up to sp × train.micro_batch_tokens tokens (sp ranks share it, each
        holding ≤ micro_batch_tokens of them, rounded up to a multiple of sp), and every rank of a
        group gets its group's micro-batches (ranks g·sp .. g·sp + sp − 1 form group g). A sequence
        longer than that budget (a long rollout) is trained in a micro-batch of its own
        (`on_too_long="alone"`), never dropped: it needs the memory of its own length."""
        ranks = len(self.groups[role])
        sp = self.config.model.sequence_parallel_size
        plan = plan_micro_batches(
            batch.sequence_lengths.tolist(),
            max_tokens=self.config.train.micro_batch_tokens * sp,
            num_ranks=ranks // sp,
            on_too_long="alone",
            groups=batch.group_ids.tolist() if learners_share_prefix(self.config) else None,
        )
        return [micro_batches(batch, plan, rank // sp) for rank in range(ranks)]

    def forwards(
        self, batch: ExperienceBatch, *, old_logprobs: bool, temperature: float
    ) -> torch.Tensor | None:
        """Fill the batch's old / reference / teacher log-probs and values; the reward-model scores
        [B] or None. The teacher scores the sampled tokens at the sampling temperature, as the
        policy and the reference do, so that d_t = log π − log π_T compares like with like.

        Every role that has something to compute starts at once, and one wait collects them all.
        """
        calls = {}
        if old_logprobs:
            calls["old_logprobs"] = ("policy", "logprobs", (temperature,))
        if "ref" in self.groups:
            calls["ref_logprobs"] = ("ref", "logprobs", (temperature,))
        if "teacher" in self.groups:
            calls["teacher_logprobs"] = ("teacher", "logprobs", (temperature,))
        if "critic" in self.groups:
            calls["values"] = ("critic", "values", ())
        if "reward_model" in self.groups:
            calls["scores"] = ("reward_model", "scores", ())
        parts = {name: self.split(batch, role) for name, (role, _, _) in calls.items()}
        futures = {
            name: self.groups[role].submit(method, per_rank=[(p, *args) for p in parts[name]])
            for name, (role, method, args) in calls.items()
        }
        results = _get_all(futures)
        for name in calls:
            if name != "scores":
                setattr(batch, name, _assemble(batch, parts[name], results[name]))
        return _assemble_scores(batch, parts["scores"], results["scores"]) if "scores" in calls else None

    def train(self, mini: ExperienceBatch, losses: dict[str, Any]) -> dict[str, dict[str, float]]:
        """One optimizer step of each trained role on `mini` (at once); role -> its metrics."""
        roles = [role for role in losses if role in self.groups]
        futures = {
            role: self.groups[role].submit(
                "train_step", per_rank=[(p, losses[role]) for p in self.split(mini, role)]
            )
            for role in roles
        }
        return {role: per_rank[0] for role, per_rank in _get_all(futures).items()}  # equal on every rank

    def sync_weights(self, version: int) -> dict[str, float]:
        """Send the policy's weights to every engine as `version`; time, size and checksum match.

        How is the strategy's data (`weight_sync.SyncStrategy`): with `sender_first` the engines
        start receiving once the sender returned; with `per_rank_payload` (CUDA IPC) every policy
        rank returns a payload with its report, each engine receives the payload of the rank on
        its GPU, then the ranks release them. Every policy rank returns (report, payload): the
        report is None off the sending ranks, the payload None where the transport carries it all.
        """
        import ray

        from .components.weight_sync import SYNC_STRATEGIES

        name = self.weight_sync_strategy()
        if name == "none":
            return {}
        if self.engines_asleep:
            raise RuntimeError("Roles.sync_weights: the engines are asleep; call to_generation() first")
        strategy = SYNC_STRATEGIES[name]
        # partial rollout: the engines take the weights now, between two decoding steps of the
        # generations in flight, instead of after them
        group = RECEIVE_GROUP if self.config.rollout.partial_rollout else None

        sent = self.groups["policy"].submit("sync", version)
        if strategy.per_rank_payload:
            shared = ray.get(sent)
            reports = [report for report, _ in shared]
            ranks = self.engine_policy_ranks()
            received = self.engines.submit(
                "receive", per_rank=[(version, shared[rank][1]) for rank in ranks], concurrency_group=group
            )
            received = ray.get(received)
            ray.get(self.groups["policy"].submit("release_sync"))
            report = reports[0]
            mismatched = sum(
                len(compare_checksums(reports[rank], other))
                for rank, other in zip(ranks, received, strict=True)
            )
        else:
            if strategy.sender_first:  # a reader does not wait for the data: it must be sent first
                ray.get(sent)
            received = self.engines.submit("receive", version, concurrency_group=group)
            report = ray.get(sent)[0][0]
            if self.config.rollout.async_train:
                self._receipts.append((report, received))
                return {
                    "sync/seconds": float(report.seconds),
                    "sync/gigabytes": report.num_bytes / 1e9,
                } | self._settle_receipts(wait=False)
            mismatched = sum(len(compare_checksums(report, other)) for other in ray.get(received))
        return {
            "sync/seconds": float(report.seconds),
            "sync/gigabytes": report.num_bytes / 1e9,
            "health/sync_checksum_match": float(mismatched == 0),
        }

    def _settle_receipts(self, *, wait: bool) -> dict[str, float]:
        """Async mode: an engine receives a version after the generations queued before it, so the
        driver does not wait for that: each sync's receipts are compared once they are all in (at
        a later step's sync, oldest first). `health/sync_checksum_match` covers the versions
        settled in this call (absent when none was); `sync/unsettled_versions` counts the rest.
        `wait`: settle every version (the end of the run)."""
        import ray

        settled = []
        while self._receipts:
            futures = self._receipts[0][1]
            if not wait and len(ray.wait(futures, num_returns=len(futures), timeout=0)[0]) < len(futures):
                break
            settled.append(self._receipts.pop(0))
        metrics = {"sync/unsettled_versions": float(len(self._receipts))}
        if settled:
            mismatched = sum(
                len(compare_checksums(sent, other)) for sent, futures in settled for other in ray.get(futures)
            )
            metrics["health/sync_checksum_match"] = float(mismatched == 0)
        return metrics

    def settle_sync(self) -> dict[str, float]:
        """Wait for the receipts async mode has not compared yet; their metrics ({} when none)."""
        return self._settle_receipts(wait=True) if self._receipts else {}

    # ------------------------------------------------------------------------------------------
    # The hybrid engine (ray.colocate all): who holds the GPU memory

    @property
    def hybrid(self) -> bool:
        return self.config.ray.colocate == "all"

    @property
    def swapping(self) -> bool:
        """Whether the hybrid engine hands GPU memory from one side to the other every step (the
        engines sleep, or the learners offload); the step loop times those phases only then."""
        return self.hybrid and (self.config.ray.engine_sleep or bool(self._offloading()))

    def _offloading(self) -> list[str]:
        """The learner roles that free GPU memory while the engines generate (GPU runs only)."""
        offloading = self.hybrid and self.config.ray.learner_offload and self.device == "cuda"
        return list(self.groups) if offloading else []

    def _move_learner_states(self, method: str) -> None:
        """`offload_states` or `reload_states` on every rank of every offloading role, at once."""
        import ray

        ray.get([future for role in self._offloading() for future in self.groups[role].submit(method)])

    def to_training(self) -> None:
        """Hybrid engine, once generation (and eval) are done: the engines sleep (level 1: vLLM keeps
        the weights in host memory and drops its KV cache), then the learners reload their DeepSpeed
        states for the forwards and training. Nothing happens without `ray.colocate all`."""
        import ray

        if not self.hybrid:
            return
        if self.config.ray.engine_sleep and not self.engines_asleep:
            ray.get(self.engines.submit("sleep", 1))
            self.engines_asleep = True
        if self.learners_offloaded:
            self._move_learner_states("reload_states")
            self.learners_offloaded = False

    def wake_engines(self) -> None:
        """Hybrid engine, after training: the engines wake (before the weight sync, which needs them
        awake; the learners still hold their states, so the sync reads the weights on the GPU)."""
        import ray

        if self.hybrid and self.engines_asleep:
            ray.get(self.engines.submit("wake_up"))
            self.engines_asleep = False

    def offload_learners(self) -> None:
        """Hybrid engine, after the weight sync: the learners offload their DeepSpeed states (GPU
        runs) so that the engines have the memory to generate."""
        if self.hybrid and not self.learners_offloaded and self._offloading():
            self._move_learner_states("offload_states")
            self.learners_offloaded = True

    def to_generation(self) -> None:
        """Hybrid engine, before generating: engines awake, learners' states off the GPU. The
        inverse of `to_training`; the step loop runs its halves around the weight sync."""
        self.wake_engines()
        self.offload_learners()

    @contextlib.contextmanager
    def _learner_states(self):
        """The learners' states on their device for the duration (a checkpoint, an export)."""

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

    def describe_hybrid(self) -> str | None:
        """The start-up line of the hybrid engine (None without `ray.colocate all`)."""
        if not self.hybrid:
            return None
        if self.config.ray.engine_sleep:
            line = "hybrid engine (ray.colocate all): the engines sleep after generation and wake before the weight sync"
            if not all(self.engines.call("can_sleep")):
                line += f" (the {self.config.rollout.engine} engine cannot sleep here: the calls are no-ops)"
        else:
            line = "hybrid engine (ray.colocate all): the engines stay awake, weights and KV cache resident (ray.engine_sleep false)"
        if not self.config.ray.learner_offload:
            return (
                line
                + "; the learners keep their DeepSpeed states on their devices (ray.learner_offload false)"
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

    # ------------------------------------------------------------------------------------------
    # Checkpoints, export, shutdown

    def trained(self) -> list[str]:
        return [role for role in TRAINED_ROLES if role in self.groups]

    def save(self, root: str, step: int, state: Any, *, keep_tags: tuple[str, ...] = ()) -> None:
        """A checkpoint of every trained role at `step`; rotation keeps the newest ckpt.max_ckpt_num
        and the checkpoints tagged `keep_tags` (the best one)."""
        with self._learner_states():
            for role in self.trained():
                self.groups[role].call(
                    "save", os.path.join(root, role), step, state, self.config.ckpt.max_ckpt_num, keep_tags
                )

    def load(self, checkpoints: dict[str, Any]) -> Any:
        """Load `checkpoints[role]` (a checkpoint folder) into every trained role; the policy's
        TrainingState. The folders were chosen by `rl_launch.runs` (written by this run)."""
        states = {
            role: self.groups[role].call("load", str(Path(folder).parent), Path(folder).name)[0]
            for role, folder in checkpoints.items()
        }
        return states["policy"]

    def export(self, path: str, tokenizer_path: str) -> None:
        with self._learner_states():
            self.groups["policy"].call("export", path, tokenizer_path)

    def export_ema(self, path: str, tokenizer_path: str) -> None:
        """The EMA of the policy's weights (train.ema_beta) as an HF folder."""
        with self._learner_states():
            self.groups["policy"].call("export_ema", path, tokenizer_path)

    def describe_offload(self) -> str | None:
        """The start-up line of ray.ref.offload / ray.teacher.offload / ray.reward_model.offload
        (None when none is set): applied, or why it is a no-op here."""
        cfg = self.config
        lines = []
        frozen = (("ref", cfg.ray.ref), ("teacher", cfg.ray.teacher), ("reward_model", cfg.ray.reward_model))
        for role, section in frozen:
            if section.offload and role in self.groups:
                _, why = frozen_offload(True, zero_stage=cfg.train.zero_stage, use_gpus=self.device == "cuda")
                lines.append(f"ray.{role}.offload: {why}")
        return "; ".join(lines) or None

    def describe_sequence_parallel(self) -> str | None:
        """The start-up words of model.sequence_parallel_size (None when it is 1)."""
        cfg = self.config
        sp = cfg.model.sequence_parallel_size
        if sp == 1:
            return None
        groups = ", ".join(f"{role} {len(group) // sp}" for role, group in self.groups.items())
        return (
            f"sequence parallel: {sp} ranks share each micro-batch (Ulysses; data-parallel groups: {groups}); "
            f"a micro-batch holds up to {sp} x {cfg.train.micro_batch_tokens} tokens"
        )

    def describe_engine_context(self) -> str | None:
        """The engines' context and KV cache in words (None when they say nothing): the longest
        sequence they take (`max_model_len`), the cache's size and how many sequences of that
        length it holds at once (fewer than max_num_seqs: the others wait for room)."""
        lengths = {c.get("max_model_len") for c in self.engine_contexts} - {None}
        tokens = [c.get("kv_cache_tokens") for c in self.engine_contexts if c.get("kv_cache_tokens")]
        sizes = {size for size in self.kv_cache_bytes if size is not None}
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

    def describe(self) -> str:
        """One start-up line: the actors of every role and the engines' context and KV cache."""
        roles = ", ".join(f"{role} x{len(group)}" for role, group in self.groups.items())
        line = f"actors ready: {roles}, {self.config.rollout.engine} engine x{len(self.engines)}"
        context = self.describe_engine_context()
        if context is not None:
            line += f" ({context})"
        parallel = self.describe_sequence_parallel()
        line = line if parallel is None else f"{line}; {parallel}"
        hybrid = self.describe_hybrid()
        line = line if hybrid is None else f"{line}; {hybrid}"
        offload = self.describe_offload()
        return line if offload is None else f"{line}; {offload}"

    def actor_names(self) -> dict[str, str]:
        """Actor id (hex) -> the name its log file has ("policy-0", "engine-1"), for diagnoses."""
        names = {}
        for role, group in [*self.groups.items(), *([("engine", self.engines)] if self.engines else [])]:
            for rank, actor in enumerate(group.actors):
                with contextlib.suppress(AttributeError):  # the in-process fakes have no actor ids
                    names[actor._actor_id.hex()] = f"{role}-{rank}"
        return names

    def close_engines(self) -> None:
        """Start the engines' own shutdown without waiting (vLLM's takes seconds: its worker and
        engine core exit, its ring buffers go), so that it runs while the driver writes the run's
        last outputs; `shutdown` waits for it. No engine call may follow."""
        if self.engines is not None and self._engines_closing is None:
            self._engines_closing = self.engines.submit("close")

    def shutdown(self) -> None:
        """Close every actor (the engines through vLLM's own shutdown, the policy's sync folder),
        end them, sweep what a killed one left, remove the placement groups.

        After the closes the actors exit gracefully (`ActorGroup.terminate`, at most 10 s) and are
        killed only if they have not: killed at once, an engine actor exited before Ray had taken
        the kill in about half of the tiny preset's runs, and Ray then printed "A worker died or
        was killed while executing a task by an unexpected system error" (pointing at the OOM
        killer) at the end of a run that had succeeded. A start that did not finish (a failure, a
        signal) skips the closes and kills at once: a call would queue behind the actor's start and
        wait for it (an engine in vLLM's multiprocess mode killed mid-start may then leave its
        engine core, which it had not yet reported for the sweep)."""
        import ray
        from ray.util.placement_group import remove_placement_group

        from .components.weight_sync import SYNC_STRATEGIES
        from .leftovers import sweep

        if self.started:
            closing = []
            if "policy" in self.groups:  # the sender removes its shared-memory folder (shm sync)
                closing += self.groups["policy"].submit("close")
            self.close_engines()  # vLLM's own shutdown: its engine core, workers and ring buffers
            closing += self._engines_closing or []
            with contextlib.suppress(Exception):  # an actor that died or hangs: swept below
                ray.wait(closing, num_returns=len(closing), timeout=30)
        groups = [*self.groups.values(), *([self.engines] if self.engines is not None else [])]
        if self.started:
            with contextlib.suppress(Exception):  # one that died or does not exit: killed below
                ending = [future for group in groups for future in group.terminate()]
                ray.wait(ending, num_returns=len(ending), timeout=10)
        for group in groups:
            with contextlib.suppress(Exception):  # an actor that already died
                group.kill()
        with contextlib.suppress(Exception):  # what a killed engine left: only its own processes and segments
            sweep(self.engine_helpers)
        strategy = SYNC_STRATEGIES.get(self.sync_spec.transport) if self.sync_spec is not None else None
        if strategy is not None and strategy.sweep is not None:
            with contextlib.suppress(Exception):  # what a killed policy rank left (shm: its folder)
                strategy.sweep(self.sync_spec)
        for placement in self.placement.values():
            with contextlib.suppress(Exception):
                remove_placement_group(placement)
