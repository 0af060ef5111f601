"""`rl-launch ppo`: the PPO family (PPO, REINFORCE++, GRPO, Dr.GRPO, RLOO, ReMax, ...) on Ray.

One step, top to bottom (`PPOTrainer.fit`):

    generate   the engines sample n responses per prompt, scored next to them  (rollouts.py)
    experience old / reference log-probs, values, reward-model scores (roles.py); KL, token
               rewards, advantages and returns from the chosen components    (algorithm.py)
    training   critic and policy, `train.max_epochs` epochs of `train.train_batch_size` samples
               (the critic alone in the first `train.critic_warmup_steps` steps)
    sync       the policy's new weights go to every engine (bucketed broadcast, checksums)
    eval / checkpoint / log   (a new best `ckpt.best_metric_key` value saves a checkpoint kept
               beside the newest `ckpt.max_ckpt_num`)

Every algorithmic choice is a component found by name with its options verbatim
(components.py); this file only orders the calls.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import math
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec
import torch

from rl_data import ExperienceBatch, Trajectory, build_experience
from rl_learner import TrainingState
from rl_rollout.episodes import episode_ids

from .algorithm import learners_share_prefix, reward_metrics, score_batch, score_normalization, shape_rewards
from .command import Recipe, ray_line, run_recipe
from .components import describe_components
from .components.estimators import estimator_needs
from .components.objective import old_logprobs_from_training, policy_loss_config, value_loss_config
from .config import PPOConfig, hf_output_dir
from .diagnosis import death_cause, describe_actor_failure, failed_actor_name, is_actor_failure
from .health import EngineHung, HealthMonitor
from .preemption import STARTUP_STOP, Preempted, PreemptionGuard
from .reward_model import RewardModelError, fallback_scores
from .roles import Roles
from .rollouts import Rollouts, completion_rows, fallback_metrics, make_rollouts
from .tracking import PhaseTimer, StartupLines, Tracker, print_outputs, quiet_third_party_output, step_metrics

__all__ = ["PPORecipe", "PPOTrainer", "run", "steps_of_episodes"]

"""The console's words for a signal that arrives before the first step (`run`'s start-up and the
starting evaluation are abandonable: a signal stops them at once)."""


class PPOTrainer:
    """The step loop over started roles and engines."""

    def __init__(
        self,
        config: PPOConfig,
        roles: Roles,
        rollouts: Rollouts,
        eval_data,
        run_plan,
        tokenizer=None,
        score_normalization: tuple[float, float] | None = None,
    ) -> None:
        from rl_algos import AdaptiveKLController, FixedKLController, RunningMoments

        kl = config.algo.kl
        self.config, self.roles, self.rollouts, self.eval_data, self.run_plan = (
            config,
            roles,
            rollouts,
            eval_data,
            run_plan,
        )
        self.kl = (
            AdaptiveKLController(kl.init_kl_coef, kl.kl_target, kl.kl_horizon)
            if kl.kl_target is not None
            else FixedKLController(kl.init_kl_coef)
        )
        self.version = 0
        self.stepping = False  # the first step has begun (before it, a signal finds nothing to save)
        # reward.normalize: running statistics of the rewards (kept in checkpoints); None when off
        self.reward_moments = RunningMoments() if config.reward.normalize == "running" else None
        # reward.normalize model: the reward model's (mean, std) from its config.json
        self.score_normalization = score_normalization
        self.health = HealthMonitor(config)
        self.tokenizer = tokenizer  # decodes the `log.completions` rows
        self.best: dict[str, Any] | None = None  # ckpt.best_metric_key: {"metric", "value", "step"}
        self.saved_after_failure: int | None = None  # an actor failed: the step saved then
        self.save_failure: str | None = None
        self.lost_state: str | None = None  # a trained role's actor died: its name ("policy-0")

    def make_experience(self, records: list[Trajectory]) -> tuple[ExperienceBatch, dict[str, float]]:
        """The learners' forwards (all roles at once), then the advantages of the chosen estimator."""
        batch = build_experience(records)
        try:
            scores = self.roles.forwards(
                batch,
                old_logprobs=not old_logprobs_from_training(self.config),
                temperature=self.config.rollout.temperature,
            )
        except RewardModelError as failure:  # past reward.model_timeout_s, or its forward raised
            scores = fallback_scores(self.config, failure, records)  # reward.on_error
        rewards = batch.rewards.clone()
        metrics = reward_metrics(records) | fallback_metrics(records)  # with the reward model's fallbacks
        if scores is not None:
            metrics["reward/model_mean"] = float(scores.mean())
            if self.score_normalization is not None:
                mean, std = self.score_normalization
                scores = (scores - mean) / std
            rewards = rewards + scores
        truncated = torch.tensor([reason == "length" for reason in batch.finish_reasons], dtype=torch.bool)
        normalized = rewards
        if self.reward_moments is not None:
            normalized = self.reward_moments.normalize(rewards)
            metrics["reward/running_mean"] = self.reward_moments.mean
            metrics["reward/running_std"] = self.reward_moments.std
        shaped, shaping = shape_rewards(self.config, normalized, batch.response_lengths, truncated)
        metrics |= shaping
        baseline = None
        if self.rollouts.greedy_baseline:
            baseline = torch.tensor([record.extra["baseline_reward"] for record in records])
        beta = float(self.kl.value)
        episodes = episode_ids(records)  # segments of one rewritten episode: one row for the estimator
        episodes = None if episodes is None else torch.tensor(episodes)
        metrics |= score_batch(
            self.config, batch, shaped, kl_coef=beta, baseline_rewards=baseline, episode_ids=episodes
        )
        if "kl/mean" in metrics:
            self.kl.update(metrics["kl/mean"], len(records))
        lengths = batch.response_lengths.float()
        metrics |= {
            "reward/mean": float(rewards.mean()),
            "reward/std": float(rewards.std()) if len(records) > 1 else 0.0,
            "reward/max": float(rewards.max()),
            "response_length/mean": float(lengths.mean()),
            "response_length/max": float(lengths.max()),
            "response/truncated": sum(r == "length" for r in batch.finish_reasons) / len(records),
            "kl/coef": beta,
            "health/policy_lag": float(self.version - batch.policy_versions.float().mean()),
        }
        if batch.rollout_logprobs is not None and batch.old_logprobs is not None:
            # without the old-log-prob forward the learner reports these from its training forward
            mask = batch.response_action_mask()
            gap = (
                batch.response_view(batch.old_logprobs) - batch.response_view(batch.rollout_logprobs)
            ).abs()
            metrics["health/logprob_mismatch_mean"] = float((gap * mask).sum() / mask.sum())
            metrics["health/logprob_mismatch_max"] = float((gap * mask).max())
        return batch, metrics

    def train(self, batch: ExperienceBatch, step: int) -> dict[str, float]:
        """`train.max_epochs` passes over the batch in shuffled mini-batches; averaged metrics."""
        cfg = self.config
        count = batch.rewards.numel()
        size = cfg.train.train_batch_size or count
        generator = torch.Generator().manual_seed(cfg.train.seed * 1_000_003 + step)
        policy = policy_loss_config(cfg, kl_coef=float(self.kl.value))
        losses = {"critic": value_loss_config(cfg, policy), "policy": policy}
        if self.policy_frozen(step):  # critic warm-up: the critic alone trains
            del losses["policy"]
        history: dict[str, list[float]] = {}
        for _ in range(cfg.train.max_epochs):
            order = torch.randperm(count, generator=generator) if size < count else torch.arange(count)
            for start in range(0, count, size):
                for role, values in self.roles.train(
                    batch.select(order[start : start + size].tolist()), losses
                ).items():
                    for key, value in values.items():
                        name = f"health/{key}" if key.startswith("logprob_mismatch") else f"{role}/{key}"
                        history.setdefault(name, []).append(value)
        return {key: sum(values) / len(values) for key, values in history.items()}

    def policy_frozen(self, step: int) -> bool:
        """Whether `step` is one of the first `train.critic_warmup_steps`, in which only the critic
        trains: the policy's weights do not change, so they are not synced either."""
        return step <= self.config.train.critic_warmup_steps

    def new_best(self, step: int, metrics: dict[str, float]) -> bool:
        """Whether this step's `ckpt.best_metric_key` beats every earlier step's (higher is better,
        a tie keeps the earlier step); then it becomes `self.best`. False without the option, when
        the step did not log the metric, or when its value is not finite."""
        key = self.config.ckpt.best_metric_key
        value = metrics.get(key) if key is not None else None
        if value is None or not math.isfinite(float(value)):
            return False
        if self.best is not None and float(value) <= self.best["value"]:
            return False
        self.best = {"metric": key, "value": float(value), "step": step}
        return True

    def best_path(self) -> Path | None:
        """The policy's best checkpoint folder (`ckpt.best_metric_key`), None before there is one."""
        from rl_learner.checkpoint import checkpoint_tag

        if self.best is None:
            return None
        return Path(self.run_plan.ckpt_root) / "policy" / checkpoint_tag(self.best["step"])

    def describe_best(self) -> str | None:
        """ "<folder> (<metric> = <value> at step <n>)", None before there is a best checkpoint."""
        if self.best is None:
            return None
        best = self.best
        return f"{self.best_path()} ({best['metric']} = {best['value']:g} at step {best['step']})"

    def sync(self, *, settle: bool = False) -> dict[str, float]:
        """The weights go to the engines as the next version. `settle`: also wait for the receipts
        async mode has not compared yet (the last step), so every version is checked."""
        self.version += 1
        # the supervisor restarts an engine that died meanwhile and sends the version again
        weights = self.roles.supervisor or self.roles.weights
        metrics = weights.send(self.version)
        if settle:
            late = weights.settle()
            key = "health/sync_checksum_match"
            if key in late:
                metrics[key] = min(late[key], metrics.get(key, 1.0))
                metrics["sync/unsettled_versions"] = late["sync/unsettled_versions"]
        return metrics

    def training_state(
        self, step: int, consumed: int, metrics: Mapping[str, float] | None = None
    ) -> TrainingState:
        """What a checkpoint of `step` holds besides the learners' states (driver side, cheap);
        `metrics`: the step's metrics line when it is not written yet (`Tracker.restore_step`)."""
        from .runs import checkpoint_extra

        return TrainingState(
            step=step,
            consumed_samples=consumed,
            policy_version=self.version,
            data_state=msgspec.to_builtins(self.rollouts.loader.state_dict()),
            extra={
                "next_group_id": self.rollouts.next_group_id,
                "in_flight": self.rollouts.in_flight(),
                "kl_coef": float(self.kl.value),
                **({"best_checkpoint": self.best} if self.best is not None else {}),
                **(
                    {"reward_moments": self.reward_moments.state_dict()}
                    if self.reward_moments is not None
                    else {}
                ),
                **checkpoint_extra(self.run_plan),
                **({"step_metrics": step_metrics(metrics)} if metrics else {}),
            },
        )

    def save(
        self,
        step: int,
        consumed: int,
        state: TrainingState | None = None,
        metrics: Mapping[str, float] | None = None,
    ) -> None:
        """Checkpoint every trained role at `step` (the best checkpoint is kept from rotation);
        `state`: the driver's state as it was at the end of that step (`training_state`), when the
        loop has moved on since (a preemption)."""
        from rl_learner.checkpoint import checkpoint_tag

        state = state if state is not None else self.training_state(step, consumed, metrics)
        keep = (checkpoint_tag(self.best["step"]),) if self.best is not None else ()
        self.roles.save(str(self.run_plan.ckpt_root), step, state, keep_tags=keep)

    def save_after_failure(self, step: int, state: TrainingState, error: BaseException) -> None:
        """Try to checkpoint the last finished `step` after an actor failed (`error`);
        `saved_after_failure` says which step was saved, `save_failure` why it could not be, and
        `lost_state` names the failed actor when it held a trained role's state (a policy or
        critic rank): that state is gone with it, so nothing is tried (the diagnosis says so)."""
        name = failed_actor_name(error, self.roles.actor_names())
        if name is not None and name.rsplit("-", 1)[0] in self.roles.trained():
            self.lost_state = name
            return
        try:
            self.save(step, state.consumed_samples, state)
        except Exception as failure:  # a learner died too
            self.save_failure = f"{type(failure).__name__}: {str(failure).strip()[:300]}"
        else:
            self.saved_after_failure = step

    def after_failure(self, error: BaseException) -> list[str]:
        """The diagnosis's closing lines after an actor failed (`error`): the step saved then, or
        why nothing newer could be saved (a trained role's state died with its actor), and the
        checkpoint on disk a resume continues from (checkpoints are written atomically: the last
        complete one stays valid whatever died while the next was written)."""
        from .runs import select_checkpoint

        if self.saved_after_failure is not None:
            step = self.saved_after_failure
            return [f"checkpoint of step {step} saved: --ckpt.load_checkpoint true continues from it"]
        name = self.lost_state or failed_actor_name(error, self.roles.actor_names())
        lines = []
        if name is not None and name.rsplit("-", 1)[0] in self.roles.trained():
            role = name.rsplit("-", 1)[0]
            lines.append(f"the {role}'s trained state was in {name}'s process: nothing newer can be saved")
        elif self.save_failure is not None:
            lines.append(f"the last finished step could not be saved: {self.save_failure}")
        plan = self.run_plan
        try:
            chosen = select_checkpoint(
                plan.ckpt_root, self.roles.trained(), run_id=plan.run_id, fingerprint=plan.fingerprint
            )
        except Exception as failure:  # a folder the resume would refuse: it says why then
            return [*lines, f"the checkpoints in {plan.ckpt_root} cannot be resumed: {failure}"]
        if chosen is None:
            lines.append(f"no checkpoint in {plan.ckpt_root}: a new run starts from step 0 (ckpt.save_steps)")
        else:
            folder = chosen.folders["policy"]
            lines.append(
                f"the last checkpoint on disk stays valid: step {chosen.step} ({folder}); "
                "--ckpt.load_checkpoint true continues from it"
            )
        return lines

    def stop_for_signal(
        self, preemption: PreemptionGuard, step: int, saved_step: int, state: TrainingState
    ) -> Preempted:
        """Save the last finished `step` (`state` as it ended) unless it is saved; the exception
        that ends the run (`rl_launch.preemption`)."""
        if step > saved_step:
            self.save(step, state.consumed_samples, state)
            saved_step = step
        return preemption.preempted(step, saved=step > 0 and saved_step == step)

    def resume(self) -> TrainingState:
        """Load the checkpoint the run plan chose (one this run wrote), or a fresh state."""
        plan = self.run_plan
        if not plan.resume:
            return TrainingState(step=0)
        state = self.roles.load(plan.checkpoints)
        self.kl.value = float(state.extra.get("kl_coef", self.kl.value))
        best = state.extra.get("best_checkpoint")
        if best is not None and best.get("metric") == self.config.ckpt.best_metric_key:
            self.best = best  # under another ckpt.best_metric_key the search starts again
        if self.reward_moments is not None and "reward_moments" in state.extra:
            self.reward_moments.load_state_dict(state.extra["reward_moments"])
        self.version = state.policy_version
        self.version -= 1  # `sync` counts up: the engines get the restored weights as their version
        self.sync()
        # after the sync: the steps that were in flight are generated again on the restored weights
        extra = state.extra
        self.rollouts.restart(
            state.data_state, int(extra.get("next_group_id", 0)), extra.get("in_flight", [])
        )
        return state

    def fit(self, tracker: Tracker, start: TrainingState, preemption: PreemptionGuard | None = None) -> None:
        """The steps after `start`. With a `preemption` guard, a signal ends the loop with
        `Preempted` after the last finished step is saved (abandoning generation or the
        experience forwards of the step in flight, finishing its training and sync)."""
        cfg = self.config
        timer = PhaseTimer()
        consumed = start.consumed_samples
        saved_step = start.step  # the newest checkpoint on disk (a resumed run's own)
        saved_at = time.monotonic()  # ckpt.save_minutes counts from here
        tracker.restore_step(start.step, start.extra.get("step_metrics"))  # killed before its line
        abandonable = preemption.abandonable if preemption is not None else contextlib.nullcontext
        hand_off = self.roles.hand_off  # ray.colocate all: engines and learners take turns on the GPUs
        hand_off.to_generation()  # the learners' states leave the GPU, engines awake
        if start.step == 0 and self.eval_data is not None:
            with abandonable(STARTUP_STOP):  # a signal now stops the run: nothing to save yet
                tracker.log(0, self.rollouts.evaluate(self.eval_data))  # the starting policy
        for step in range(start.step + 1, cfg.train.max_steps + 1):
            self.stepping = True
            timer.reset()
            began = time.perf_counter()
            finished = self.training_state(step - 1, consumed)  # what a preemption now would save
            try:
                with abandonable(), timer.phase("generation"):
                    records, metrics = self.rollouts.generate(step, self.version)
                if cfg.log.completions:
                    tracker.log_completions(
                        step, completion_rows(records[: cfg.log.completions], self.tokenizer)
                    )
                hand_off.to_training(timer)  # engines sleep, learners reload their states
                with abandonable(), timer.phase("experience"):
                    batch, experience = self.make_experience(records)
            except KeyboardInterrupt:
                if preemption is None or not preemption.requested or preemption.forced:
                    raise
                raise self.stop_for_signal(preemption, step - 1, saved_step, finished) from None
            except Exception as error:  # an engine died, failed or hung: the learners may still save
                if (is_actor_failure(error) or isinstance(error, EngineHung)) and step - 1 > saved_step:
                    self.save_after_failure(step - 1, finished, error)
                    if isinstance(error, EngineHung):  # `rl-launch: stopped: ...` says what was saved
                        saved = "; ".join(self.after_failure(error))
                        raise EngineHung(error.engines, error.what, message=f"{error}. {saved}") from error
                raise
            with timer.phase("training"):
                metrics |= experience | self.train(batch, step)
            hand_off.wake_engines(timer)  # for the sync, which reads from the learners' GPU
            last = step == cfg.train.max_steps
            with timer.phase("sync"):
                if not self.policy_frozen(step):
                    metrics |= self.sync(settle=last)
                elif last:  # nothing to send; async mode still compares the receipts it waits for
                    metrics |= (self.roles.supervisor or self.roles.weights).settle()
            hand_off.offload_learners(timer)  # then the learners' states leave the GPU for the generation
            if self.eval_data is not None and (step % cfg.eval.eval_steps == 0 or last):
                with timer.phase("eval"):
                    metrics |= self.rollouts.evaluate(self.eval_data)
            metrics |= self.rollouts.engine_activity()  # the engines' idle time since the last step's line
            if self.roles.supervisor is not None:  # engine/restarts, engine/restart_s
                metrics |= self.roles.supervisor.metrics()
            consumed += len(records)
            best = self.new_best(step, metrics)
            if best:
                tracker.message(f"new best checkpoint: {self.describe_best()}")
            metrics["policy_version"] = float(self.version)
            if last or best or cfg.ckpt.save_due(step, time.monotonic() - saved_at):
                with timer.phase("checkpoint"):
                    self.save(step, consumed, metrics=metrics)
                saved_step, saved_at = step, time.monotonic()
            elapsed = time.perf_counter() - began
            metrics |= timer.metrics() | {
                "time/step": elapsed,
                "throughput/samples_per_s": len(records) / elapsed,
                "throughput/tokens_per_s": float(batch.sequence_lengths.sum()) / elapsed,
            }
            tracker.log(step, metrics)
            for warning in self.health.check(step, metrics):  # raises HealthError to stop the run
                tracker.message(warning)
            if preemption is not None and preemption.requested and step < cfg.train.max_steps:
                raise self.stop_for_signal(preemption, step, saved_step, self.training_state(step, consumed))

    def best_line(self) -> str | None:
        """The closing line of `ckpt.best_metric_key`: the best checkpoint, or that the metric was
        never logged; None without the option."""
        key = self.config.ckpt.best_metric_key
        if key is None:
            return None
        if self.best is None:
            return f"best checkpoint: none, {key} was never logged (ckpt.best_metric_key)"
        return f"best checkpoint: {self.describe_best()}"


def steps_of_episodes(config: PPOConfig, prompts: int) -> PPOConfig:
    """`config` with train.max_steps = num_episodes × ⌊prompts / rollout_batch_size⌋ (at least 1):
    OpenRLHF's length of training in passes over the prompt data, once its size is known."""
    per_episode = prompts // config.rollout.rollout_batch_size
    steps = max(1, config.train.num_episodes * per_episode)
    return msgspec.structs.replace(config, train=msgspec.structs.replace(config.train, max_steps=steps))


def _start_loading_data(config: PPOConfig, inputs: Any) -> concurrent.futures.Future:
    """Load the tokenizer and the prompts on a thread of its own; the future of
    (tokenizer, training prompts, evaluation prompts or None, seconds it took)."""
    from .prompts import load_prompts

    future: concurrent.futures.Future = concurrent.futures.Future()

    def load() -> None:
        began = time.perf_counter()
        try:
            if config.log.actor_output == "file":
                quiet_third_party_output()
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(inputs.model_path)
            train_data, eval_data = load_prompts(config, inputs, tokenizer)
        except BaseException as error:
            future.set_exception(error)
        else:
            future.set_result((tokenizer, train_data, eval_data, time.perf_counter() - began))

    threading.Thread(target=load, name="rl-launch-data", daemon=True).start()
    return future


class PPORecipe(Recipe):
    """`rl-launch ppo` as setup / train / cleanup (`rl_launch.command.run_recipe` maps the rest)."""

    name = "rl-launch ppo"

    def __init__(self, config: PPOConfig) -> None:
        self.config = config
        self.console = StartupLines(self.name)
        self.output_dir = Path(config.log.output_dir)
        self.started_ray, self.roles, self.trainer, self.log_dir = False, None, None, None

    @property
    def stepping(self) -> bool:
        return self.trainer is not None and self.trainer.stepping

    def setup(self) -> None:
        """Inputs and run folder, then Ray (the data loads meanwhile), the actors and the trainer."""
        from .cluster import start_ray
        from .plugins import import_plugins, resolve_plugins
        from .preflight import (
            check_context,
            check_packages,
            check_ray_address,
            resolve_inputs,
            settle_accelerator,
            settle_attention,
        )
        from .runs import open_run_folder

        config, say = self.config, self.console.say
        self.plugins = resolve_plugins(config.plugins)
        import_plugins(self.plugins)  # already imported by `validation.prepare`: a no-op then
        settle_accelerator(config)
        config, attention_note = settle_attention(config)
        self.config = config
        if attention_note is not None:
            say(attention_note)
        check_packages(config)  # before Ray is imported: a missing package is named, not Ray's error
        check_ray_address(config.ray.address)
        import ray

        self.ray_errors = (ray.exceptions.RayError,)
        preset = None
        if config.preset != "none":
            from .presets import prepare_preset

            preset = prepare_preset(config.preset, config.preset_root, seed=0)
            say(f"preset {config.preset}: model and prompts in {Path(preset.model_path).parent}")
        self.inputs = resolve_inputs(config, preset)
        context_note = check_context(config, self.inputs)
        if context_note is not None:
            say(context_note)
        self.plan = open_run_folder(
            config,
            roles=["policy", "critic"]
            if estimator_needs(config.algo.advantage.estimator).critic
            else ["policy"],
            say=say,
        )
        # The tokenizer and the prompts load on a thread while Ray starts (mostly imports against
        # Ray's processes starting); a bad row is raised here once Ray is up, before any actor.
        data = _start_loading_data(config, self.inputs)
        self.started_ray = start_ray(config, temp_dir=config.ray.temp_dir)
        # after ray.init, which sets a SIGTERM handler of its own
        self.guard = PreemptionGuard(self.name, config.ckpt.preemption_timeout_s).install()
        # Until the first step, a signal stops at once: nothing has been trained that a checkpoint
        # would keep (a resumed run's own checkpoint stays as it was).
        with self.guard.abandonable(STARTUP_STOP):
            say(ray_line(self.started_ray, config.ray.address))
            self._start(data)

    def _start(self, data: concurrent.futures.Future) -> None:
        """The prompts, the actors and their weight sync, the trainer at its resumed state."""
        from .prompts import describe_data

        say = self.console.say
        tokenizer, train_data, eval_data, took = data.result()
        # the line's own seconds: how long the data kept the run waiting once Ray was up
        say(f"{describe_data(train_data, eval_data)}; loaded in {took:.1f} s while Ray started")
        config = self.config
        if config.train.num_episodes is not None:
            config = self.config = steps_of_episodes(config, len(train_data))
            say(
                f"train.num_episodes {config.train.num_episodes}: train.max_steps {config.train.max_steps} "
                f"({len(train_data)} prompts, {config.rollout.rollout_batch_size} per step)"
            )
        say(describe_algorithm(config))
        samples = config.rollout.rollout_batch_size * config.rollout.n_samples_per_prompt
        steps_per_batch = config.train.max_epochs * (samples // (config.train.train_batch_size or samples))
        roles = self.roles = Roles(config, plugins=self.plugins)
        self.log_dir = str(self.output_dir / "logs") if config.log.actor_output == "file" else None
        roles.start(self.inputs, log_dir=self.log_dir, total_steps=steps_per_batch * config.train.max_steps)
        say(roles.describe())
        say(f"weight sync: {roles.init_weight_sync()}")
        from rl_data.datasets import PromptLoader

        loader = PromptLoader(
            train_data, batch_size=config.rollout.prompts_per_round, seed=config.train.seed, shuffle=True
        )
        roles.supervisor.notify, roles.supervisor.log_dir = self.console.warn, self.log_dir
        rollouts = make_rollouts(config, roles.supervisor, loader)
        rollouts.log_dir, rollouts.notify = self.log_dir, self.console.warn
        normalization = None
        if config.reward.normalize == "model":
            normalization = score_normalization(self.inputs.reward_model_path)
            say(describe_score_normalization(normalization, self.inputs.reward_model_path))
        self.trainer = PPOTrainer(
            config,
            roles,
            rollouts,
            eval_data,
            self.plan,
            tokenizer=tokenizer,
            score_normalization=normalization,
        )
        self.state = self.trainer.resume()

    def train(self) -> int:
        """The steps, then the final export and the run's outputs; the exit code."""
        config, roles, trainer, plan = self.config, self.roles, self.trainer, self.plan
        with Tracker.for_run(config, start_step=self.state.step) as tracker:
            try:
                trainer.fit(tracker, self.state, preemption=self.guard)
            except Preempted as stop:
                roles.close_engines()  # runs while the outputs are written
                summary = tracker.close(exit_code=stop.exit_code)
                print_outputs(self.output_dir, summary, plan.ckpt_root, log_dir=self.log_dir)
                print(f"{self.name}: {stop}", file=sys.stderr)
                return stop.exit_code
            roles.close_engines()  # vLLM's shutdown takes seconds: it runs while the outputs are written
            final = None
            if config.ckpt.save_hf_model:
                final = hf_output_dir(config)
                roles.export(str(final), self.inputs.model_path)
                if config.train.ema_beta is not None:
                    roles.export_ema(str(self.output_dir / "final_ema"), self.inputs.model_path)
            best = trainer.best_line()
            if best is not None:
                tracker.message(best)
            summary = tracker.close()
        if best is not None:
            with open(Path(summary.metrics_path).parent / "summary.txt", "a") as handle:
                handle.write(best + "\n")
        print_outputs(self.output_dir, summary, plan.ckpt_root, final=final, log_dir=self.log_dir)
        return 0

    def cleanup(self) -> None:
        import ray

        if self.roles is not None and ray.is_initialized():
            self.roles.shutdown()
        if self.started_ray and ray.is_initialized():
            ray.shutdown()
        if self.guard is not None:
            self.guard.finish()

    def diagnose(self, error: BaseException) -> str:
        """Which actor failed, where its log is, why, and what the run saved before it stopped."""
        return _diagnosis(error, self.roles, self.trainer, self.log_dir)


def _diagnosis(
    error: BaseException, roles: Roles | None, trainer: PPOTrainer | None, log_dir: str | None
) -> str:
    """`PPORecipe.diagnose`: the failed actor, its log, why, the restarts used, what was saved."""
    names = roles.actor_names() if roles is not None else {}
    _, text = describe_actor_failure(error, names, log_dir)
    cause = death_cause(error, names, log_dir)
    lines = [text, *([f"  why: {cause}"] if cause is not None else [])]
    supervisor = roles.supervisor if roles is not None else None
    if supervisor is not None and supervisor.restarts:
        engines = ", ".join(f"engine-{restart.index}" for restart in supervisor.restarts)
        lines.append(
            f"  engine restarts: {len(supervisor.restarts)} of rollout.engine_restarts = {supervisor.limit} "
            f"used in this run ({engines})"
        )
    if trainer is not None:
        lines += [f"  {line}" for line in trainer.after_failure(error)]
    return "\n".join(lines)


def describe_algorithm(config: PPOConfig) -> str:
    """The start-up line of the algorithm: its components and where the old log-probs come from."""
    return (
        f"algorithm: {describe_components(config)}; old log-probs "
        + ("from the training forward" if old_logprobs_from_training(config) else "from a separate forward")
        + (
            "; learners run a prompt shared by several samples once (model.share_prefix)"
            if learners_share_prefix(config)
            else ""
        )
    )


def describe_score_normalization(normalization: tuple[float, float] | None, path: str | None) -> str:
    """The start-up line of reward.normalize model."""
    if normalization is None:
        return (
            f"reward.normalize model: {path}/config.json has no usable mean "
            "and std; the reward model's scores stay raw"
        )
    return f"reward.normalize model: scores ← (s − {normalization[0]:g}) / {normalization[1]:g}"


def run(config: PPOConfig) -> int:
    """Run `rl-launch ppo` with a config that passed `rl_launch.validation.prepare` (the command
    line prepares it once, for --print-config and the run alike; nothing here checks it again);
    the process exit code (0 on success)."""
    return run_recipe(PPORecipe(config))
