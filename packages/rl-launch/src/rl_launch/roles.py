"""The actors of a run and every call the step loop makes on them.

`Roles.start(inputs, ...)` places the roles (`rl_launch.cluster`), starts each learner and engine
from its spec (`rl_launch.specs`) and waits until every actor is up; then it holds three parts
the step loop calls besides its own methods:

    placement   where the actors run, a frozen record of the engines' ready answers
                (`rl_launch.placement.Placement`)
    weights     the policy's weights to the engines: start / send / settle
                (`rl_launch.weights.WeightSync`, made by `init_weight_sync`)
    supervisor  the engines as the rollouts and the hand-off call them, a dead one restarted in
                place (`rl_launch.supervisor.EngineSupervisor`; `restart_engine` starts one again)
    hand_off    the hybrid engine's GPU memory hand-over, a no-op without `ray.colocate all`
                (`rl_launch.handoff`)

Its own methods are the loop's vocabulary: `forwards` (old / reference / teacher log-probs,
values, reward-model scores, all roles at once), `train` (critic and policy on the same
mini-batch, at once), `save`, `load`, `export`. A batch is split over the ranks of a role by
token budget (`rl_data.plan_micro_batches`), and the per-rank results are put back in batch order.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import torch

from rl_data import ExperienceBatch, micro_batches, plan_micro_batches

from .actors import ActorGroup, LearnerWorker, RolloutWorker
from .algorithm import learners_share_prefix
from .cluster import ClusterError, cluster_has_gpus, place_roles, plan_roles
from .config import PPOConfig
from .diagnosis import describe_build_locks, extension_build_locks
from .handoff import HandOff, hand_off_for
from .learner_settings import learner_dtype, offload_words
from .placement import Placement
from .rendezvous import local_ranks
from .reward_model import collect_scores
from .specs import engine_concurrency_groups, engine_spec, header_variables, learner_specs
from .supervisor import EngineSupervisor
from .weights import WeightSync

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


class Roles:
    """The learner groups (`groups[role]`) and the rollout engines of one run."""

    def __init__(self, config: PPOConfig, *, plugins: tuple = ()) -> None:
        self.config = config
        self.plugins = plugins
        self.groups: dict[str, ActorGroup] = {}
        self.engines: ActorGroup | None = None
        self.device = "cpu"  # "cuda" or "cpu", resolved from the cluster by `start`
        self.placement_groups: dict[str, Any] = {}  # group name -> Ray placement group
        self.placement: Placement | None = None  # where the actors run, once started
        self.hand_off: HandOff = HandOff()  # the hybrid engine once started (`ray.colocate all`)
        self.weights: WeightSync | None = None  # the policy's weights to the engines (`init_weight_sync`)
        self.supervisor: EngineSupervisor | None = None  # restarts a dead engine (`start`)
        self.engine_helpers: list[Any] = []  # rl_launch.leftovers.HelperProcesses per engine
        self.judges: ActorGroup | None = None  # the judge actors (reward.judge_pretrain), not engines
        self.judge_helpers: list[Any] = []  # rl_launch.leftovers.HelperProcesses per judge
        self._engines_closing: list | None = None  # the engines' `close` calls (`close_engines`)
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
        spec_args = {"dtype": self.dtype, "use_gpus": use_gpus}
        layouts = {layout.role: layout for layout in plan_roles(cfg, use_gpus=use_gpus)}
        self.placement_groups = place_roles(list(layouts.values()), timeout_s=cfg.ray.startup_timeout_s)
        timeout_s = cfg.ray.startup_timeout_s
        # The engines first: theirs is the longest start (vLLM's imports, the model, the KV cache).
        # No runtime environment of their own on a local cluster (`specs.header_variables`), so Ray can
        # hand them a worker process it started ahead of time.
        engine = layouts["engine"]
        engines_spec = engine_spec(cfg, inputs, **spec_args, log_dir=log_dir, plugins=self.plugins)
        judges = self._start_judges(layouts, engines_spec)
        self.engines = ActorGroup(
            "engine",
            RolloutWorker,
            [
                (engines_spec, index, judges[index % len(judges)] if judges else None)
                for index in range(engine.num_actors)
            ],
            placement_group=self.placement_groups[engine.group],
            num_gpus=engine.num_gpus,
            num_cpus=engine.num_cpus,
            concurrency_groups=engine_concurrency_groups(cfg),
            env=header_variables(cfg) or None,
        )
        engine_ready = self.engines.submit("ready")
        for role, spec in learner_specs(cfg, inputs, **spec_args, total_steps=total_steps).items():
            if role not in layouts:
                continue
            layout = layouts[role]
            spec = msgspec.structs.replace(spec, log_dir=log_dir, plugins=self.plugins)
            self.groups[role] = ActorGroup(
                role,
                LearnerWorker,
                [(spec, rank, layout.num_actors) for rank in range(layout.num_actors)],
                placement_group=self.placement_groups[layout.group],
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
        judge_ready = self.judges.submit("ready") if self.judges is not None else []
        _wait_started(futures + engine_ready + judge_ready, timeout_s)
        if self.judges is not None:
            self.judge_helpers = ray.get(self.judges.submit("helpers"))  # swept at shutdown
        engines = ray.get(engine_ready)
        self.engine_helpers = ray.get(self.engines.submit("helpers"))  # swept at shutdown
        self.started = True
        self.placement = Placement.of(self.device, engines, self.groups["policy"].call("location"))
        self.supervisor = EngineSupervisor(cfg, self)
        self.hand_off = hand_off_for(cfg, self.groups, self.supervisor, self.device)

    def _start_judges(self, layouts: dict[str, Any], engines_spec: Any) -> list:
        """The judge actors (reward.judge_pretrain, `rl_launch.judge`) on their own placement group,
        started before the engines that are handed them; [] without a judge."""
        from .judge_worker import JudgeWorker

        layout = layouts.get("judge")
        if layout is None:
            return []
        self.judges = ActorGroup(
            "judge",
            JudgeWorker,
            [(engines_spec, index) for index in range(layout.num_actors)],
            placement_group=self.placement_groups[layout.group],
            num_gpus=layout.num_gpus,
            num_cpus=layout.num_cpus,
        )
        return list(self.judges.actors)

    def init_weight_sync(self) -> str:
        """Policy DP rank 0 sends, every engine worker receives (`rl_launch.weights.WeightSync`); a
        description of the strategy for the start-up line."""
        self.weights, description = WeightSync.start(
            self.config, self.groups["policy"], self.engines, self.placement, self.hand_off, self.dtype
        )
        return description

    def restart_engine(self, index: int) -> None:
        """Engine `index` again, in place (`rl_launch.supervisor`): what the old actor left is swept
        (its process if it hangs, vLLM's engine core, shared memory), a new actor starts from the
        same spec on the same placement bundle, and this returns once it is ready (at most
        `ray.startup_timeout_s`). The placement stays: same bundle, same node and devices."""
        import ray

        from .leftovers import sweep

        if index < len(self.engine_helpers):
            with contextlib.suppress(Exception):  # a hung actor's process is killed here too
                sweep([self.engine_helpers[index]])
        self.engines.replace(index)
        ready = self.engines.submit_to(index, "ready")
        _wait_started([ready], self.config.ray.startup_timeout_s)
        if index < len(self.engine_helpers):
            self.engine_helpers[index] = ray.get(self.engines.submit_to(index, "helpers"))

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
        (`on_too_long="alone"`), never dropped: it needs the memory of its own length. With
        train.tensor_parallel_size tp > 1 the ranks form groups of tp the same way (ranks g·tp ..
        g·tp + tp − 1 share group g's micro-batches), each micro-batch up to micro_batch_tokens."""
        ranks = len(self.groups[role])
        sp = self.config.model.sequence_parallel_size
        shared = sp * self.config.train.tensor_parallel_size  # ranks that get the same micro-batches
        plan = plan_micro_batches(
            batch.sequence_lengths.tolist(),
            max_tokens=self.config.train.micro_batch_tokens * sp,
            num_ranks=ranks // shared,
            on_too_long="alone",
            groups=batch.group_ids.tolist() if learners_share_prefix(self.config) else None,
        )
        return [micro_batches(batch, plan, rank // shared) for rank in range(ranks)]

    def forwards(
        self, batch: ExperienceBatch, *, old_logprobs: bool, temperature: float
    ) -> torch.Tensor | None:
        """Fill the batch's old / reference / teacher log-probs and values; the reward-model scores
        [B] or None (`RewardModelError` past reward.model_timeout_s or when its forward raised, the
        batch filled). The teacher scores the sampled tokens at the sampling temperature, as the
        policy and the reference do, so that d_t = log π − log π_T compares like with like.

        Every role that has something to compute starts at once, and one wait collects them all.
        """
        calls = {}
        if old_logprobs:
            calls["old_logprobs"] = (
                "policy",
                "logprobs",
                (temperature, self.config.algo.policy.router_replay),
            )
        if "ref" in self.groups:
            calls["ref_logprobs"] = ("ref", "logprobs", (temperature,))
        if "teacher" in self.groups:
            calls["teacher_logprobs"] = ("teacher", "logprobs", (temperature,))
        if "critic" in self.groups:
            calls["values"] = ("critic", "values", ())
        if "reward_model" in self.groups:
            calls["scores"] = ("reward_model", "scores", ())
        parts = {name: self.split(batch, role) for name, (role, _, _) in calls.items()}
        asked_at = time.monotonic()
        futures = {
            name: self.groups[role].submit(method, per_rank=[(p, *args) for p in parts[name]])
            for name, (role, method, args) in calls.items()
        }
        scores = futures.pop("scores", None)
        for name, results in _get_all(futures).items():
            setattr(batch, name, _assemble(batch, parts[name], results))
        if scores is None:
            return None
        # within reward.model_timeout_s of the ask, else RewardModelError (`rl_launch.reward_model`)
        return _assemble_scores(batch, parts["scores"], collect_scores(scores, self.config, asked_at))

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

    # ------------------------------------------------------------------------------------------
    # Checkpoints, export, shutdown

    def trained(self) -> list[str]:
        return [role for role in TRAINED_ROLES if role in self.groups]

    def save(self, root: str, step: int, state: Any, *, keep_tags: tuple[str, ...] = ()) -> None:
        """A checkpoint of every trained role at `step`; rotation keeps the newest ckpt.max_ckpt_num
        and the checkpoints tagged `keep_tags` (the best one)."""
        with self.hand_off.learner_states():
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
        with self.hand_off.learner_states():
            self.groups["policy"].call("export", path, tokenizer_path)

    def export_ema(self, path: str, tokenizer_path: str) -> None:
        """The EMA of the policy's weights (train.ema_beta) as an HF folder."""
        with self.hand_off.learner_states():
            self.groups["policy"].call("export_ema", path, tokenizer_path)

    def describe_offload(self) -> str | None:
        """The start-up words of the offload options (`learner_settings.offload_words`)."""
        return offload_words(self.config, set(self.groups), use_gpus=self.device == "cuda")

    def _data_parallel_groups(self, shared: int) -> str:
        """ "policy 2, critic 1": each role's data-parallel groups of `shared` ranks sharing micro-batches."""
        return ", ".join(f"{role} {len(group) // shared}" for role, group in self.groups.items())

    def describe_tensor_parallel(self) -> str | None:
        """The start-up words of train.tensor_parallel_size (None when it is 1)."""
        tp = self.config.train.tensor_parallel_size
        if tp == 1:
            return None
        return (
            f"tensor parallel: {tp} ranks split each decoder layer and share each micro-batch "
            f"(FSDP2 dp x tp mesh; data-parallel groups: {self._data_parallel_groups(tp)})"
        )

    def describe_sequence_parallel(self) -> str | None:
        """The start-up words of model.sequence_parallel_size (None when it is 1)."""
        cfg = self.config
        sp = cfg.model.sequence_parallel_size
        if sp == 1:
            return None
        return (
            f"sequence parallel: {sp} ranks share each micro-batch (Ulysses; data-parallel groups: "
            f"{self._data_parallel_groups(sp)}); "
            f"a micro-batch holds up to {sp} x {cfg.train.micro_batch_tokens} tokens"
        )

    def describe(self) -> str:
        """One start-up line: the actors of every role and the engines' context and KV cache."""
        roles = ", ".join(f"{role} x{len(group)}" for role, group in self.groups.items())
        line = f"actors ready: {roles}, {self.config.rollout.engine} engine x{len(self.engines)}"
        context = self.placement.describe_engine_context() if self.placement is not None else None
        if context is not None:
            line += f" ({context})"
        for parallel in (self.describe_sequence_parallel(), self.describe_tensor_parallel()):
            line = line if parallel is None else f"{line}; {parallel}"
        hybrid = self.hand_off.describe()
        line = line if hybrid is None else f"{line}; {hybrid}"
        offload = self.describe_offload()
        return line if offload is None else f"{line}; {offload}"

    def actor_names(self) -> dict[str, str]:
        """Actor id (hex) -> the name its log file has ("policy-0", "engine-1"), for diagnoses."""
        names = {}
        extra = [(role, group) for role, group in (("engine", self.engines), ("judge", self.judges)) if group]
        for role, group in [*self.groups.items(), *extra]:
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

        from .leftovers import sweep

        if self.started:
            closing = []
            if "policy" in self.groups:  # the sender removes its shared-memory folder (shm sync)
                closing += self.groups["policy"].submit("close")
            self.close_engines()  # vLLM's own shutdown: its engine core, workers and ring buffers
            closing += self._engines_closing or []
            if self.judges is not None:
                closing += self.judges.submit("close")
            with contextlib.suppress(Exception):  # an actor that died or hangs: swept below
                ray.wait(closing, num_returns=len(closing), timeout=30)
        groups = [
            *self.groups.values(),
            *(group for group in (self.engines, self.judges) if group is not None),
        ]
        if self.started:
            with contextlib.suppress(Exception):  # one that died or does not exit: killed below
                ending = [future for group in groups for future in group.terminate()]
                ray.wait(ending, num_returns=len(ending), timeout=10)
        for group in groups:
            with contextlib.suppress(Exception):  # an actor that already died
                group.kill()
        with contextlib.suppress(Exception):  # what a killed engine left: only its own processes and segments
            sweep(self.engine_helpers + self.judge_helpers)
        if self.weights is not None:
            with contextlib.suppress(Exception):  # what a killed policy rank left (shm: its folder)
                self.weights.sweep()
        for placement in self.placement_groups.values():
            with contextlib.suppress(Exception):
                remove_placement_group(placement)
