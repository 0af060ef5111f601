"""Where `rl-launch sft`, `rm`, `dpo` train: in the driver process, or on a Ray actor group.

Both kinds offer the loop (`loop.run_task`) the same five calls:

    train(items)          one optimizer step on the step's dataset items -> metrics (equal on every rank)
    save(root, step, state, keep_last) / load(root, tag) -> TrainingState
    export(path, tokenizer_path)       the HF folder (rank 0 writes it)
    close()

`DriverLearner`: one rank, built in this process (`ray.learner.num_actors` 1 without
`ray.address`, the default): no Ray, nothing to start.

`RayLearners`: `ray.learner.num_actors` = R ranks, one `SupervisedWorker` actor each, placed in
one placement group and joined into one torch.distributed world exactly as `rl-launch ppo` starts
its policy (`rl_launch.rendezvous`: rank 0 opens the store, every rank joins at its address).
Each step's items are planned over the ranks by tokens (`rl_data.plan_micro_batches`: every rank
the same number M of micro-batches, some possibly empty); with model.sequence_parallel_size
sp > 1, over R / sp groups, ranks g·sp … g·sp + sp − 1 sharing group g's micro-batches. The
learners normalise the loss over the whole step on all ranks (token-mean over every rank's
tokens, pair means over every rank's pairs), so R ranks take the step one rank would take from
the same items, up to the order of floating-point sums.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from ..actors import LearnerWorker
from ..backends import zero_stage_note
from ..learner_settings import optimizer_offload

__all__ = ["DriverLearner", "RayLearners", "SupervisedWorker", "learner_layout", "plan_items"]


def plan_items(
    items: Sequence[Any],
    lengths: Sequence[int],
    *,
    ranks: int,
    sequence_parallel: int,
    max_tokens: int,
    tensor_parallel: int = 1,
) -> list[list[list[Any]]]:
    """Each rank's micro-batches of `items` (plan[rank][j] = the items of micro-batch j).

    R ranks in R / (sp·tp) groups of sp·tp consecutive ranks that get the same micro-batches; each
    micro-batch holds at most sp × `max_tokens` tokens (an item longer than that is a micro-batch
    of its own: trained, never dropped).
    """
    from rl_data import plan_micro_batches

    shared = sequence_parallel * tensor_parallel
    plan = plan_micro_batches(
        list(lengths),
        max_tokens=max_tokens * sequence_parallel,
        num_ranks=ranks // shared,
        on_too_long="alone",
    )
    return [[[items[i] for i in micro] for micro in plan.ranks[rank // shared]] for rank in range(ranks)]


class _SupervisedSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What `LearnerWorker`'s own methods read of their spec, for a supervised rank."""

    role: str
    log_dir: str | None = None
    plugins: tuple = ()


def _lora(config: Any) -> str:
    model = config.model
    return f", LoRA rank {model.lora_rank} alpha {model.lora_alpha}" if model.lora_rank else ""


def _backend(config: Any, *, use_gpus: bool) -> str:
    """The start-up line's name of the learner backend (`train.backend`), with train.adam_offload's effect."""
    if config.train.backend == "fsdp2":
        offload = (
            ", CPU offload of parameters, gradients and AdamW state" if config.train.adam_offload else ""
        )
        note = zero_stage_note(config)
        return f"FSDP2 (fully_shard{offload})" + (f"; {note}" if note else "")
    line = f"DeepSpeed ZeRO-{config.train.zero_stage}"
    if config.train.adam_offload:
        line += f" (train.adam_offload: {optimizer_offload(True, use_gpus=use_gpus)[1]})"
    return line


def learner_layout(role: str, config: Any, *, use_gpus: bool) -> Any:
    """The `RoleLayout` of the trained model's ranks (`ray.learner`): one placement group."""
    from ..cluster import RoleLayout

    resources = config.ray.learner
    return RoleLayout(
        role=role,
        num_actors=resources.num_actors,
        num_gpus=resources.num_gpus_per_actor if use_gpus else 0.0,
        num_cpus=resources.num_cpus_per_actor,
        group=role,
    )


class DriverLearner:
    """The trained model in this process: one rank, no Ray."""

    ranks = 1

    def __init__(self, task: Any, config: Any, model_path: str, total_steps: int) -> None:
        self.task, self.config = task, config
        self.learner, self._step = task.build(config, model_path, total_steps)

    def describe(self, dtype: str) -> str:
        return (
            f"learner: {_backend(self.config, use_gpus=self.learner.device.type == 'cuda')} {dtype}"
            f"{_lora(self.config)} in this "
            f"process on {self.learner.device}, world size 1"
        )

    def train(self, items: Sequence[Any]) -> dict[str, float]:
        from rl_learner import group_by_tokens

        budget = self.config.train.micro_batch_tokens
        groups = group_by_tokens([self.task.lengths(item) for item in items], budget)
        return self._step([[items[i] for i in group] for group in groups])

    def save(self, root: str, step: int, state: Any, keep_last: int) -> None:
        from rl_learner import save_checkpoint

        save_checkpoint(root, step, {self.task.role: self.learner.engine}, state, keep_last=keep_last)

    def load(self, root: str, tag: str) -> Any:
        from rl_learner import load_checkpoint

        return load_checkpoint(root, {self.task.role: self.learner.engine}, tag=tag)

    def export(self, path: str, tokenizer: Any) -> None:
        from rl_learner import export_hf

        export_hf(self.learner.engine, path, tokenizer=tokenizer)

    def close(self) -> None:
        pass


class SupervisedWorker(LearnerWorker):
    """One data-parallel rank of a supervised command (Ray actor class; see `RayLearners`).

    Joins its world as a ppo learner does (`LearnerWorker.node`, `setup`), then builds the
    command's learner(s) with the command's own `Task.build`; checkpoints and the HF export are
    `LearnerWorker`'s.
    """

    def __init__(
        self,
        task: Any,
        config: Any,
        model_path: str,
        total_steps: int,
        rank: int,
        world_size: int,
        log_dir: str | None,
    ) -> None:
        super().__init__(_SupervisedSpec(role=task.role, log_dir=log_dir), rank, world_size)
        self.task, self.config, self.model_path, self.total_steps = task, config, model_path, total_steps
        self._step: Any = None

    def _build(self) -> None:
        import torch

        torch.manual_seed(self.config.train.seed)
        self.learner, self._step = self.task.build(self.config, self.model_path, self.total_steps)

    def device(self) -> str:
        return str(self.learner.device)

    def train(self, micro: list[list[Any]]) -> dict[str, float]:
        """One optimizer step on this rank's micro-batches of dataset items; the metrics."""
        return self._step(micro)


class RayLearners:
    """The trained model on `ray.learner.num_actors` Ray actors (module docstring)."""

    def __init__(
        self, task: Any, config: Any, model_path: str, total_steps: int, *, log_dir: str | None
    ) -> None:
        """Place the ranks and create their actors (`start` waits for them to join and build)."""
        from ..actors import ActorGroup
        from ..cluster import cluster_has_gpus, place_roles

        self.task, self.config = task, config
        use_gpus = config.ray.device == "cuda" or (config.ray.device == "auto" and cluster_has_gpus())
        self.ranks = config.ray.learner.num_actors
        self.layout = learner_layout(task.role, config, use_gpus=use_gpus)
        self.placement = place_roles([self.layout], timeout_s=config.ray.startup_timeout_s)
        self.group = None
        try:
            self.group = ActorGroup(
                task.role,
                SupervisedWorker,
                [
                    (task, config, model_path, total_steps, rank, self.ranks, log_dir)
                    for rank in range(self.ranks)
                ],
                placement_group=self.placement[task.role],
                num_gpus=self.layout.num_gpus,
                num_cpus=self.layout.num_cpus,
            )
        except BaseException:
            self.close()
            raise
        self.devices: list[str] = []
        self.nodes = 0

    def start(self) -> None:
        """The two-phase start (`rl_launch.rendezvous`): every rank says where it runs and rank 0
        opens the store there; then every rank joins at rank 0's address and builds its learner."""
        import ray

        from ..rendezvous import local_ranks
        from ..roles import _wait_started

        timeout_s = self.config.ray.startup_timeout_s
        located = self.group.submit("node", timeout_s)
        _wait_started(located, timeout_s)
        nodes = ray.get(located)
        _, master_addr, master_port = nodes[0]
        locals_ = local_ranks([node_id for node_id, _, _ in nodes])
        setups = self.group.submit(
            "setup", per_rank=[(master_addr, master_port, local, timeout_s) for local in locals_]
        )
        try:
            _wait_started(setups, timeout_s)
        except ray.exceptions.RayError as error:
            from ..diagnosis import death_first

            raise death_first(error, setups) from None
        self.devices = ray.get(self.group.submit("device"))
        self.nodes = len({node_id for node_id, _, _ in nodes})

    def describe(self, dtype: str) -> str:
        sp, tp = self.config.model.sequence_parallel_size, self.config.train.tensor_parallel_size
        where = f"on {self.devices[0]}" if len(set(self.devices)) == 1 else f"on {', '.join(self.devices)}"
        return (
            f"learner: {_backend(self.config, use_gpus='cuda' in self.devices[0])} {dtype}"
            f"{_lora(self.config)}, {self.ranks} Ray actors "
            f"(world size {self.ranks}{f', sequence parallel {sp}' if sp > 1 else ''}"
            f"{f', tensor parallel {tp}' if tp > 1 else ''}) on "
            f"{self.nodes} node{'s' if self.nodes > 1 else ''} {where}"
        )

    def _call(self, method: str, *args: Any, per_rank: Sequence[tuple] | None = None) -> list:
        """`method` on every rank; when one failed, a dead rank's error before a survivor's."""
        import ray

        from ..diagnosis import death_first

        futures = self.group.submit(method, *args, per_rank=per_rank)
        try:
            return ray.get(futures)
        except ray.exceptions.RayError as error:
            raise death_first(error, futures) from None

    def train(self, items: Sequence[Any]) -> dict[str, float]:
        plan = plan_items(
            items,
            [self.task.lengths(item) for item in items],
            ranks=self.ranks,
            sequence_parallel=self.config.model.sequence_parallel_size,
            max_tokens=self.config.train.micro_batch_tokens,
            tensor_parallel=self.config.train.tensor_parallel_size,
        )
        return self._call("train", per_rank=[(micro,) for micro in plan])[0]

    def save(self, root: str, step: int, state: Any, keep_last: int) -> None:
        self._call("save", str(root), step, state, keep_last)

    def load(self, root: str, tag: str) -> Any:
        return self._call("load", str(root), tag)[0]

    def export(self, path: str, tokenizer: Any) -> None:
        self._call("export", str(path), tokenizer.name_or_path)

    def actor_names(self) -> dict[str, str]:
        """Actor id (hex) -> the name its log file has ("policy-0"), for a diagnosis."""
        return {
            actor._actor_id.hex(): f"{self.task.role}-{rank}" for rank, actor in enumerate(self.group.actors)
        }

    def close(self) -> None:
        """Kill the ranks and free their placement group (the cluster may outlive the run)."""
        import contextlib

        from ray.util.placement_group import remove_placement_group

        if self.group is not None:
            self.group.kill()
        for placement in self.placement.values():
            with contextlib.suppress(Exception):
                remove_placement_group(placement)
