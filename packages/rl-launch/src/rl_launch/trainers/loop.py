"""The step loop shared by `rl-launch sft`, `rm`, `dpo` and `kto`, run by the driver process.

    set up    preset (opt-in), run folder (`runs.prepare_run_folder`), tokenizer, dataset, the
              learner(s): one rank in this process, or `ray.learner.num_actors` Ray ranks
              (`learners.py`; Ray started or joined first)
    resume    the run's own checkpoint, when `--ckpt.load_checkpoint true` finds one
    loop      batch of step s -> each rank's micro-batches by token budget -> one optimizer step -> log
    finish    checkpoint, HF export to ckpt.hf_output_dir (<log.output_dir>/final), summary and curves

Batches. Step s (1-based) takes the items at global positions (s − 1)·B ... s·B − 1 of an endless
stream made of passes over the data, pass k in the order `randperm(count)` seeded by
(train.seed, k). The order depends only on the step, so a resumed run continues exactly where
the checkpoint's step left off without saving a sampler state.

A command (sft.py, rm.py, dpo.py, kto.py) gives a `Task`: how to read its dataset, build its learners,
and run one step on a list of dataset items. `SupervisedRecipe` runs it as setup (set up, resume) /
train (loop, finish) / cleanup, with the exit codes of every command (`rl_launch.command`).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..command import Recipe, ray_line, run_recipe
from ..config import data_sources, hf_output_dir
from ..learner_settings import (
    LearnerSettings,
    learner_dtype,
    learner_settings,
    model_load_options,
    role_optimizer,
)
from ..preemption import PreemptionGuard
from ..tracking import (
    PhaseTimer,
    StartupLines,
    Tracker,
    print_outputs,
    quiet_third_party_output,
    step_metrics,
)

__all__ = ["SupervisedRecipe", "Task", "batch_positions", "run_task", "steps_of_epochs"]


@dataclass(frozen=True)
class Task:
    """What one command adds to the loop.

    command: "sft", "rm", "dpo" or "kto"; role: the checkpointed engine's name ("policy", "reward_model").
    headline: metric keys shown in the progress bar, the console summary and curves.png.
    preset_data: key of `demo.build_demo`'s paths the preset's data comes from ("sft", "pairs").
    load: (config, tokenizer, data.dataset or the preset's file) -> dataset with `len` and item access.
    lengths: step item -> its token count (for micro-batching).
    build: (config, model path, total steps) -> (trained learner, step function); the step
        function takes the step's items (grouped into micro-batches) and returns metrics.
    """

    command: str
    role: str
    headline: tuple[str, ...]
    preset_data: str
    load: Callable[[Any, Any, Any], Any]
    lengths: Callable[[Any], int]
    build: Callable[[Any, str, int], tuple[Any, Callable[[list[list[Any]]], dict[str, float]]]]
    prepare: Callable[[list[Any]], list[Any]] | None = None
    """The step's dataset items -> what the ranks train on (kto: each with its KL pair), in the
    driver before the items are split over the ranks; None: the items themselves."""


def batch_positions(step: int, batch_size: int, count: int, seed: int) -> list[int]:
    """Dataset positions of step `step` (1-based): passes over the data, each in its own seeded order."""
    import torch

    if count < 1:
        raise ValueError("the dataset is empty")
    positions, orders = [], {}
    for index in range((step - 1) * batch_size, step * batch_size):
        epoch = index // count
        if epoch not in orders:
            generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
            orders[epoch] = torch.randperm(count, generator=generator).tolist()
        positions.append(orders[epoch][index % count])
    return positions


def resolve_dtype(config: Any) -> str:
    """`model.dtype`, "auto" resolved for this process (bf16 when CUDA is available, else fp32)."""
    import torch

    return learner_dtype(config.model.dtype, use_gpus=torch.cuda.is_available())


def learner_options(config: Any) -> LearnerSettings:
    """The trained learner's settings (`learner_settings`) with the actor's optimizer settings
    (`train.actor_learning_rate`, `train.actor_optimizer`, `train.actor_muon_learning_rate`)."""
    import torch

    return learner_settings(
        config.model,
        config.train,
        dtype=resolve_dtype(config),
        use_gpus=torch.cuda.is_available(),
        **role_optimizer(config.train, "actor"),
    )


def model_options(config: Any, deepspeed: Any, *, trained: bool = True) -> dict[str, Any]:
    """Keyword arguments of `load_causal_lm` / `load_value_model` for this rank (the world is this
    process alone until a Ray rank has joined its group). `trained` False: a frozen model (dpo's
    reference), which under FSDP2 loads in the run's dtype instead of fp32 master weights."""
    import torch.distributed as dist

    world_size = dist.get_world_size() if dist.is_initialized() else 1
    optimizer = learner_options(config).optimizer
    if not trained and deepspeed.backend == "fsdp2":
        optimizer = None
    return model_load_options(deepspeed, optimizer, world_size=world_size)


def _micro_batches(items: Sequence[Any], lengths: Callable[[Any], int], budget: int) -> list[list[Any]]:
    from rl_learner import group_by_tokens

    return [[items[i] for i in group] for group in group_by_tokens([lengths(item) for item in items], budget)]


def steps_of_epochs(config: Any, rows: int) -> Any:
    """`config` with train.max_steps = ⌈epochs × rows / train_batch_size⌉: passes over the data
    (OpenRLHF's max_epochs of sft / rm / dpo), once the dataset's size is known."""
    import math

    import msgspec

    steps = max(1, math.ceil(config.train.epochs * rows / config.train.train_batch_size))
    return msgspec.structs.replace(config, train=msgspec.structs.replace(config.train, max_steps=steps))


class SupervisedRecipe(Recipe):
    """One supervised command (`Task`) as setup / train / cleanup (`rl_launch.command.run_recipe`)."""

    def __init__(self, task: Task, config: Any) -> None:
        self.task, self.config = task, config
        self.name = f"rl-launch {task.command}"
        self.console = StartupLines(self.name)
        self.output_dir = Path(config.log.output_dir)
        self.learners: Any = None
        self.started_ray, self.log_dir, self.began_steps = False, None, False

    @property
    def stepping(self) -> bool:
        return self.began_steps

    def setup(self) -> None:
        """The model and data (the preset's, opt-in), the run folder, the learners, the resumed state."""
        import torch

        from ..preflight import (
            check_model_path,
            check_packages,
            check_ray_address,
            settle_accelerator,
            settle_attention,
        )

        settle_accelerator(self.config)  # before anything imports DeepSpeed
        from rl_learner import TrainingState

        from ..runs import open_run_folder

        quiet_third_party_output()
        task, config, say = self.task, self.config, self.console.say
        config, attention_note = settle_attention(config)
        self.config = config
        if attention_note is not None:
            say(attention_note)
        check_packages(config)
        check_ray_address(config.ray.address)
        model_path, data_path = config.model.pretrain, config.data.dataset
        if config.preset != "none":
            from .demo import build_demo

            demo = build_demo(config.preset_root)
            model_path = model_path or demo["model"]
            data_path = data_path or demo[task.preset_data]
            say(f"preset {config.preset}: model and data in {Path(demo['model']).parent}")
        model_path = check_model_path("model.pretrain", model_path)
        self.plan = open_run_folder(config, roles=[task.role], say=say)
        self._load_data(model_path, data_path)
        torch.manual_seed(self.config.train.seed)
        self._start_learners(model_path)
        say(self.learners.describe(resolve_dtype(self.config)))
        self.resumed = TrainingState(step=0)
        if self.plan.resume:
            folder = self.plan.checkpoints[task.role]
            self.resumed = self.learners.load(str(folder.parent), folder.name)

    def _load_data(self, model_path: str, data_path: Any) -> None:
        """The tokenizer and the dataset; train.epochs become train.max_steps once its size is known."""
        from transformers import AutoTokenizer

        from ..preflight import PreflightError

        config, say = self.config, self.console.say
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        dataset = self.dataset = self.task.load(config, self.tokenizer, data_path)
        named = ", ".join(data_sources(data_path))
        if config.data.dataset_probs is not None:
            named += " mixed " + "/".join(f"{p:g}" for p in config.data.dataset_probs)
        if len(dataset) == 0:
            raise PreflightError(f"data.dataset: {named}: no usable row ({dataset.stats.summary()})")
        say(f"data: {len(dataset)} rows from {named} ({dataset.stats.summary()})")
        if config.train.epochs is not None:
            config = self.config = steps_of_epochs(config, len(dataset))
            say(
                f"train.epochs {config.train.epochs}: train.max_steps {config.train.max_steps} "
                f"({len(dataset)} rows, {config.train.train_batch_size} per step)"
            )

    def _start_learners(self, model_path: str) -> None:
        """One rank in this process, or `ray.learner.num_actors` Ray ranks (Ray started or joined)."""
        from ..cluster import start_ray
        from ..preemption import STARTUP_STOP
        from .learners import DriverLearner, RayLearners, learner_layout

        task, config = self.task, self.config
        self.guard = PreemptionGuard(self.name, config.ckpt.preemption_timeout_s)
        if config.ray.in_driver:
            self.learners = DriverLearner(task, config, model_path, config.train.max_steps)
            self.guard.install()
            return
        import ray

        self.ray_errors = (ray.exceptions.RayError,)
        layout = learner_layout(task.role, config, use_gpus=False)
        self.started_ray = start_ray(config, temp_dir=config.ray.temp_dir, layouts=[layout])
        self.guard.install()  # after ray.init, which sets a SIGTERM handler of its own
        with self.guard.abandonable(STARTUP_STOP):
            self.console.say(ray_line(self.started_ray, config.ray.address))
            self.log_dir = str(self.output_dir / "logs") if config.log.actor_output == "file" else None
            self.learners = RayLearners(
                task, config, model_path, config.train.max_steps, log_dir=self.log_dir
            )
            self.learners.start()

    def save(self, step: int, metrics: dict[str, float] | None = None) -> None:
        """Checkpoint the learners at `step` (`metrics`: the step's line, when it is not written yet)."""
        from rl_learner import TrainingState

        from ..runs import checkpoint_extra

        extra = checkpoint_extra(self.plan) | ({"step_metrics": step_metrics(metrics)} if metrics else {})
        state = TrainingState(
            step=step, consumed_samples=step * self.config.train.train_batch_size, extra=extra
        )
        root = str(self.plan.ckpt_root / self.task.role)
        self.learners.save(root, step, state, self.config.ckpt.max_ckpt_num)

    def train(self) -> int:
        """The steps after the resumed one, then the HF export and the run's outputs; the exit code."""
        task, config, plan, guard = self.task, self.config, self.plan, self.guard
        start = self.resumed.step
        timer = PhaseTimer()
        final = None
        saved_step, saved_at = start, time.monotonic()
        self.began_steps = True
        with Tracker.for_run(config, start_step=start, headline=task.headline) as tracker:
            tracker.restore_step(start, self.resumed.extra.get("step_metrics"))
            batch = config.train.train_batch_size
            for step in range(start + 1, config.train.max_steps + 1):
                if guard.requested:  # before the first step: nothing new to save
                    stop = guard.preempted(step - 1, saved=saved_step == step - 1 > 0)
                    return _preempted(self.name, stop, tracker, plan)
                timer.reset()
                began = time.perf_counter()
                positions = batch_positions(step, batch, len(self.dataset), config.train.seed)
                items = [self.dataset[i] for i in positions]
                if task.prepare is not None:
                    items = task.prepare(items)
                with timer.phase("training"):
                    metrics = self.learners.train(items)
                tokens = metrics.pop("tokens", 0.0)
                metrics = {f"{task.command}/{key}": value for key, value in metrics.items()}
                last = step == config.train.max_steps
                if last or config.ckpt.save_due(step, time.monotonic() - saved_at):
                    with timer.phase("checkpoint"):
                        self.save(step, metrics)
                    saved_step, saved_at = step, time.monotonic()
                elapsed = time.perf_counter() - began
                timing = {"time/step": elapsed, "throughput/tokens_per_s": tokens / elapsed}
                tracker.log(step, metrics | timer.metrics() | timing)
                if guard.requested and not last:  # SIGTERM / Ctrl-C: the step is done, save it
                    if saved_step < step:
                        self.save(step)
                    return _preempted(self.name, guard.preempted(step, saved=True), tracker, plan)
            if config.ckpt.save_hf_model:
                final = hf_output_dir(config)
                self.learners.export(str(final), self.tokenizer)
            summary = tracker.close()
        print_outputs(self.output_dir, summary, plan.ckpt_root, final=final, log_dir=self.log_dir)
        return 0

    def cleanup(self) -> None:
        if self.learners is not None:
            self.learners.close()
        if self.started_ray:
            import ray

            ray.shutdown()
        if self.guard is not None:
            self.guard.finish()

    def diagnose(self, error: BaseException) -> str:
        """Which actor failed, where its log is, why, and the checkpoint a resume continues from."""
        from ..diagnosis import death_cause, describe_actor_failure
        from .learners import DriverLearner

        learners = self.learners
        names = {} if learners is None or isinstance(learners, DriverLearner) else learners.actor_names()
        _, text = describe_actor_failure(error, names, self.log_dir)
        cause = death_cause(error, names, self.log_dir)
        lines = [text, *([f"  why: {cause}"] if cause is not None else [])]
        if self.began_steps:  # the start finished: steps may have been saved
            lines.append(f"  {_last_checkpoint(self.plan, self.task.role)}")
        return "\n".join(lines)


def run_task(task: Task, config: Any) -> int:
    """Run one supervised command with a resolved config; the process exit code (0 on success)."""
    return run_recipe(SupervisedRecipe(task, config))


def _last_checkpoint(plan: Any, role: str) -> str:
    """What a resume after a failure continues from (checkpoints are written atomically, so the
    last complete one stays valid whatever died while the next was written)."""
    from ..runs import select_checkpoint

    try:
        chosen = select_checkpoint(plan.ckpt_root, [role], run_id=plan.run_id, fingerprint=plan.fingerprint)
    except Exception as failure:  # a folder the resume would refuse: it says why then
        return f"the checkpoints in {plan.ckpt_root} cannot be resumed: {failure}"
    if chosen is None:
        return f"no checkpoint in {plan.ckpt_root}: a new run starts from step 0 (ckpt.save_steps)"
    return (
        f"the last checkpoint on disk stays valid: step {chosen.step} ({chosen.folders[role]}); "
        "--ckpt.load_checkpoint true continues from it"
    )


def _preempted(name: str, stop: Any, tracker: Tracker, plan: Any) -> int:
    """Close the tracker of a run stopped by a signal (summary, curves); its exit code."""
    summary = tracker.close(exit_code=stop.exit_code)
    print_outputs(plan.output_dir, summary, plan.ckpt_root)
    print(f"{name}: {stop}", file=sys.stderr)
    return stop.exit_code
