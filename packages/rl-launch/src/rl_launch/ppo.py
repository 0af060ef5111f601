"""`rl-launch ppo`: the PPO family (PPO, REINFORCE++, GRPO, Dr.GRPO, RLOO, ...) on Ray.

One step, top to bottom (`PPOTrainer.fit`):

    generate   the engines sample n responses per prompt; the reward function scores them
    experience the learners compute old log-probs, reference log-probs, values (and reward-model
               scores); `rl_algos` turns them into KL, token rewards, advantages and returns
    training   critic then policy, `train.max_epochs` epochs of `train.train_batch_size` samples
    sync       the policy's new weights go to every engine (bucketed broadcast, checksums)
    log / eval / checkpoint

The reference model is skipped when β = 0, the critic when the estimator needs none. In async
mode (`rollout.async_train`) the engines generate the next batch while the learners train on
this one; records carry the policy version that produced them and the importance-sampling
correction is on. The intelligence lives in the packages; this file only orders the calls.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import torch

from rl_algos import (
    ADVANTAGE_ESTIMATORS,
    POLICY_LOSSES,
    AdaptiveKLController,
    FixedKLController,
    compute_advantages,
    kl_penalty,
    token_level_rewards,
)
from rl_data import (
    ExperienceBatch,
    PromptSample,
    Trajectory,
    build_experience,
    decode,
    encode,
    micro_batches,
    plan_micro_batches,
)
from rl_learner import (
    DeepSpeedConfig,
    LoraOptions,
    OptimizerConfig,
    PolicyLossConfig,
    TrainingState,
    ValueLossConfig,
)
from rl_rollout import SamplingParams, filter_groups

from .actors import ActorGroup, EngineSpec, LearnerSpec, LearnerWorker, RolloutWorker
from .cluster import ClusterError, cluster_has_gpus, place_roles, plan_roles, start_ray
from .config import ConfigError, PPOConfig
from .preflight import PreflightError, Resolved, resolve_inputs
from .tracking import PhaseTimer, StartupLines, Tracker, quiet_third_party_output

__all__ = ["PPOTrainer", "run"]

TRAINED_ROLES = ("policy", "critic")


def _estimator_takes(estimator: str, name: str) -> bool:
    """Whether the advantage estimator registered as `estimator` has an argument `name`."""
    return name in inspect.signature(ADVANTAGE_ESTIMATORS[estimator]).parameters


def check_combination(config: PPOConfig) -> None:
    """Combinations the single sections cannot see; ConfigError naming the fields."""
    kl = config.algo.kl
    if (
        kl.init_kl_coef > 0
        and not kl.use_kl_loss
        and not _estimator_takes(config.algo.advantage.estimator, "token_rewards")
    ):
        raise ConfigError(
            f"algo.kl.init_kl_coef: {kl.init_kl_coef} puts the KL into the reward, but estimator "
            f"{config.algo.advantage.estimator!r} uses outcome rewards only and would ignore it; set "
            "algo.kl.use_kl_loss true (GRPO style) or pick gae / reinforce / reinforce_baseline"
        )
    if kl.init_kl_coef > 0 and kl.use_kl_loss and kl.kl_estimator == "k1":
        # E[∇ k1] = E[∇ log π] = 0 under π's own samples: as a loss, k1 pulls nowhere on average
        raise ConfigError(
            "algo.kl.kl_estimator: 'k1' as a loss term (algo.kl.use_kl_loss true) has zero expected "
            "gradient; use 'k3' or 'low_var_kl' (GRPO), 'k2', or a '+' variant such as 'k3+'"
        )
    if kl.kl_target is not None and kl.init_kl_coef == 0:
        raise ConfigError(
            f"algo.kl.kl_target: {kl.kl_target} needs algo.kl.init_kl_coef > 0: the adaptive "
            "controller scales β, and β = 0 stays 0 (and starts no reference model)"
        )
    estimator = config.algo.advantage.estimator
    whiten = config.algo.advantage.whiten
    if whiten is not None and not _estimator_takes(estimator, "whiten"):
        raise ConfigError(
            f"algo.advantage.whiten: {whiten} is not an option of estimator {estimator!r} (gae, reinforce and "
            "reinforce_baseline take it; group estimators normalise within each group); leave it unset"
        )
    if estimator == "remax" and config.model.reward_pretrain is not None:
        raise ConfigError(
            "algo.advantage.estimator: 'remax' takes the rule / remote reward of a greedy answer as its "
            "baseline; with model.reward_pretrain the sampled rewards include the reward model's score "
            "and the baseline would not: use grpo, rloo or reinforce_baseline with a reward model"
        )
    if config.algo.policy.eps_clip >= 1:
        raise ConfigError(
            f"algo.policy.eps_clip: {config.algo.policy.eps_clip} must be < 1 (the ratio's lower bound "
            "1 - eps_clip must stay positive)"
        )
    try:
        policy_loss_config(config, kl_coef=kl.init_kl_coef)
    except ValueError as error:  # e.g. a correction mode with a gating it cannot use
        raise ConfigError(f"algo.policy: {error}") from None


def old_logprobs_from_training(config: PPOConfig) -> bool:
    """True when the old log-probs equal the training forward's own log-probs, detached.

    That holds when each batch gets exactly one optimizer step (one epoch, one mini-batch):
    the weights that would score the batch are the weights that train on it. The separate
    forward is then skipped (TRL does the same) and the learner uses its own detached
    log-probs, so the ratio is exactly 1. It also needs a run without a reference model
    (β = 0): the KL and its controller are computed from the old log-probs before training.
    In async mode the rollout weights lag, but the old log-probs are still those of the
    current weights, so the rule is the same; the rollout correction compares them with the
    sampler's log-probs inside the learner.
    """
    samples = config.rollout.rollout_batch_size * config.rollout.n_samples_per_prompt
    one_step = config.train.max_epochs == 1 and (config.train.train_batch_size or samples) >= samples
    return one_step and not config.needs_reference


def policy_loss_config(config: PPOConfig, *, kl_coef: float) -> PolicyLossConfig:
    """The learner's objective from `algo.policy` and `algo.kl` (β = `kl_coef` when the KL is in the loss).

    Raises ValueError naming the `PolicyLossConfig` field for a combination it refuses.
    """
    policy = config.algo.policy
    options = {
        "epsilon_low": policy.eps_clip,
        "epsilon_high": policy.eps_clip_high,
        "dual_clip": policy.dual_clip,
    }
    accepted = inspect.signature(POLICY_LOSSES[policy.loss]).parameters
    options = {k: v for k, v in options.items() if k in accepted and v is not None}
    correction = policy.is_correction
    if correction == "auto":
        correction = "tis" if config.rollout.async_train else "none"
    kl = config.algo.kl
    return PolicyLossConfig(
        name=policy.loss,
        options=options,
        aggregation=policy.aggregation,
        horizon=config.rollout.generate_max_len if policy.aggregation == "seq-mean-token-sum-norm" else None,
        kl_coef=kl_coef if kl.use_kl_loss else 0.0,
        kl_estimator=kl.kl_estimator,
        entropy_coef=policy.entropy_coef,
        correction=correction,
        correction_level=policy.is_correction_level,
        correction_gating=policy.is_correction_gating,
        correction_bounds=policy.is_correction_bounds,
        temperature=config.rollout.temperature,
        old_logprobs_from_forward=old_logprobs_from_training(config),
    )


def _estimator_options(estimator: str, **options: Any) -> dict[str, Any]:
    return {name: value for name, value in options.items() if _estimator_takes(estimator, name)}


def _assemble(
    batch: ExperienceBatch, parts: Sequence[Sequence[ExperienceBatch]], results: Sequence[Sequence]
) -> torch.Tensor:
    """Per-token results of every rank's micro-batches → one [N] tensor aligned with `batch`."""
    mask = batch.response_action_mask()
    full = torch.zeros(mask.shape, dtype=torch.float32)
    for rank_parts, rank_results in zip(parts, results, strict=True):
        for part, values in zip(rank_parts, rank_results, strict=True):
            if part.indices.numel() == 0:
                continue
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


def _get_all(futures: dict[str, list]) -> dict[str, list]:
    """Wait once for every future of several calls: name -> [result per rank]."""
    import ray

    done = iter(ray.get([future for per_rank in futures.values() for future in per_rank]))
    return {name: [next(done) for _ in per_rank] for name, per_rank in futures.items()}


def _mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    count = mask.sum()
    return float((values * mask).sum() / count) if count > 0 else 0.0


class PPOTrainer:
    """The run: actors on Ray, the prompt stream, the step loop, checkpoints and logs."""

    def __init__(self, config: PPOConfig, inputs: Resolved) -> None:
        self.config = config
        self.inputs = inputs
        self.output_dir = Path(config.log.output_dir)
        self.ckpt_root = Path(config.ckpt.path or self.output_dir / "checkpoints")
        self.actor_log_dir = self.output_dir / "logs"
        self.groups: dict[str, ActorGroup] = {}
        self.placement: dict[str, Any] = {}
        self.next_group_id = 0
        self.version = 0
        kl = config.algo.kl
        self.kl_controller = (
            AdaptiveKLController(kl.init_kl_coef, kl.kl_target, kl.kl_horizon)
            if kl.kl_target is not None
            else FixedKLController(kl.init_kl_coef)
        )
        self.pending = None  # async mode: the next step's generation, already under way
        # ReMax: the reward of a greedy answer to each prompt is the baseline of its samples
        self.greedy_baseline = _estimator_takes(config.algo.advantage.estimator, "baseline_rewards")

    # ------------------------------------------------------------------------------------------
    # Set-up

    def load_data(self) -> None:
        from transformers import AutoTokenizer

        from rl_data.datasets import PromptDataset, PromptLoader

        cfg = self.config
        self.tokenizer = AutoTokenizer.from_pretrained(self.inputs.model_path)

        def dataset(source: str, option: str, limit: int | None) -> PromptDataset:
            try:
                data = PromptDataset(
                    source,
                    self.tokenizer,
                    input_key=cfg.data.input_key,
                    label_key=cfg.data.label_key,
                    apply_chat_template=self.inputs.apply_chat_template,
                    max_length=cfg.data.prompt_max_len,
                )
            except (FileNotFoundError, KeyError, ValueError) as error:
                raise PreflightError(f"{option}: {error}") from None
            if len(data) == 0:
                raise PreflightError(f"{option}: {source!r} has no usable prompts")
            return data if limit is None or len(data) <= limit else _Subset(data, limit)

        self.train_data = dataset(self.inputs.prompt_data, "data.prompt_data", cfg.data.max_samples)
        if len(self.train_data) < cfg.rollout.rollout_batch_size:
            raise PreflightError(
                f"data.prompt_data: {len(self.train_data)} prompts, fewer than rollout.rollout_batch_size "
                f"= {cfg.rollout.rollout_batch_size}"
            )
        self.eval_data = None
        if self.inputs.eval_data is not None and cfg.eval.eval_steps != -1:
            self.eval_data = dataset(self.inputs.eval_data, "data.eval_dataset", cfg.data.eval_max_samples)
        self.loader = PromptLoader(
            self.train_data, batch_size=cfg.rollout.rollout_batch_size, seed=cfg.train.seed, shuffle=True
        )
        self.batches = iter(self.loader)

    def describe_data(self) -> str:
        """One start-up line: prompts kept for training and eval, and what the filters dropped."""
        line = f"data: {len(self.train_data)} training prompts ({_data_stats(self.train_data)})"
        if self.eval_data is not None:
            line += f", {len(self.eval_data)} eval prompts ({_data_stats(self.eval_data)})"
        return line

    def describe_algorithm(self) -> str:
        """One start-up line: estimator, loss, where the KL goes and where old log-probs come from."""
        algo = self.config.algo
        kl = "no KL"
        if self.config.needs_reference:
            kl = f"KL {algo.kl.kl_estimator} in the {'loss' if algo.kl.use_kl_loss else 'reward'}"
        old = (
            "from the training forward (one optimizer step per batch)"
            if old_logprobs_from_training(self.config)
            else "from a separate forward"
        )
        return f"algorithm: {algo.advantage.estimator} advantages, {algo.policy.loss} loss, {kl}, old log-probs {old}"

    def describe_actors(self) -> str:
        """One start-up line: the actors of every role and the engines' KV cache."""
        roles = ", ".join(f"{role} x{len(group)}" for role, group in self.groups.items())
        line = f"actors ready: {roles}, {self.config.rollout.engine} engine x{len(self.engines)}"
        sizes = {size for size in self.kv_cache_bytes if size is not None}
        if sizes:
            line += f" (KV cache {max(sizes) / 2**20:.0f} MiB each)"
        return line

    def start_actors(self) -> None:
        import ray

        cfg = self.config
        use_gpus = cfg.ray.device == "cuda" or (cfg.ray.device == "auto" and cluster_has_gpus())
        self.device = "cuda" if use_gpus else "cpu"
        dtype = cfg.model.dtype if cfg.model.dtype != "auto" else ("bf16" if use_gpus else "fp32")
        self.dtype = dtype
        layouts = {layout.role: layout for layout in plan_roles(cfg, use_gpus=use_gpus)}
        self.placement = place_roles(list(layouts.values()), timeout_s=cfg.ray.startup_timeout_s)
        steps = self.optimizer_steps_per_step() * cfg.train.max_steps
        ds = DeepSpeedConfig(
            zero_stage=cfg.train.zero_stage,
            dtype=dtype,
            offload_optimizer=cfg.train.adam_offload,
            gradient_checkpointing=cfg.model.gradient_checkpointing,
            attn_implementation=cfg.model.attn_implementation,
            micro_batch_tokens=cfg.train.micro_batch_tokens,
        )
        inference = msgspec.structs.replace(ds, zero_stage=min(ds.zero_stage, 3), offload_optimizer=False)

        def optimizer(lr: float) -> OptimizerConfig:
            return OptimizerConfig(
                lr=lr,
                betas=cfg.train.adam_betas,
                weight_decay=cfg.train.weight_decay,
                warmup_ratio=cfg.train.lr_warmup_ratio,
                min_lr_ratio=cfg.train.min_lr_ratio,
                grad_clip=cfg.train.max_norm,
            )

        lora = None
        if cfg.model.lora_rank > 0:
            targets = cfg.model.target_modules
            lora = LoraOptions(
                rank=cfg.model.lora_rank,
                alpha=float(cfg.model.lora_alpha),
                target_modules="all-linear" if targets == ["all-linear"] else list(targets),
            )
        specs = {
            "policy": LearnerSpec(
                role="policy",
                model_path=self.inputs.model_path,
                dtype=dtype,
                deepspeed=ds,
                optimizer=optimizer(cfg.train.actor_learning_rate),
                total_steps=steps,
                lora=lora,
                seed=cfg.train.seed,
            ),
            "ref": LearnerSpec(
                role="ref", model_path=self.inputs.model_path, dtype=dtype, deepspeed=inference
            ),
            "critic": LearnerSpec(
                role="critic",
                model_path=self.inputs.critic_path,
                dtype=dtype,
                deepspeed=ds,
                optimizer=optimizer(cfg.train.critic_learning_rate),
                total_steps=steps,
                seed=cfg.train.seed,
            ),
            "reward_model": LearnerSpec(
                role="reward_model",
                model_path=self.inputs.reward_model_path or "",
                dtype=dtype,
                deepspeed=inference,
            ),
        }
        from rl_data.transport import free_port

        log_dir = str(self.actor_log_dir) if cfg.log.actor_output == "file" else None
        futures = []
        for role, spec in specs.items():
            if role not in layouts:
                continue
            layout = layouts[role]
            port = free_port()
            spec = msgspec.structs.replace(spec, log_dir=log_dir)
            group = ActorGroup(
                role,
                LearnerWorker,
                [(spec, rank, layout.num_actors, port) for rank in range(layout.num_actors)],
                placement_group=self.placement[layout.group],
                num_gpus=layout.num_gpus,
                num_cpus=layout.num_cpus,
            )
            self.groups[role] = group
            futures += group.submit("ready")
        engine_layout = layouts["engine"]
        engine_spec = EngineSpec(
            kind=cfg.rollout.engine,
            model_path=self.inputs.model_path,
            dtype=dtype,
            max_model_len=cfg.data.prompt_max_len + cfg.rollout.generate_max_len,
            seed=cfg.rollout.seed,
            tensor_parallel_size=cfg.rollout.tensor_parallel_size,
            gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
            max_num_seqs=cfg.rollout.max_num_seqs
            or math.ceil(cfg.rollout.rollout_batch_size / cfg.rollout.num_engines)
            * cfg.rollout.n_samples_per_prompt,
            enforce_eager=cfg.rollout.enforce_eager or not use_gpus,
            reward_function=self.inputs.reward_function,
            reward_url=self.inputs.reward_url,
            reward_timeout_s=cfg.reward.timeout_s,
            log_dir=log_dir,
        )
        self.engines = ActorGroup(
            "engine",
            RolloutWorker,
            [(engine_spec, index) for index in range(engine_layout.num_actors)],
            placement_group=self.placement[engine_layout.group],
            num_gpus=engine_layout.num_gpus,
            num_cpus=engine_layout.num_cpus,
            # vLLM logs every weight reload at INFO and WARNING; that would bury the progress bar
            env={"VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "ERROR")},
        )
        engine_ready = self.engines.submit("ready")
        done, waiting = ray.wait(
            futures + engine_ready,
            num_returns=len(futures) + len(engine_ready),
            timeout=cfg.ray.startup_timeout_s,
        )
        ray.get(done)  # re-raises the first start-up error (model loading, engine start)
        if waiting:
            raise ClusterError(
                f"{len(waiting)} actors did not start within ray.startup_timeout_s = {cfg.ray.startup_timeout_s:g} s"
            )
        engines = ray.get(engine_ready)
        self.engine_sync_sizes = [size for size, _ in engines]
        self.kv_cache_bytes = [kv for _, kv in engines]

    def init_weight_sync(self) -> None:
        """One sync group: policy DP rank 0 sends, every engine worker receives."""
        import ray

        from rl_data.transport import WeightSyncSpec, free_port

        layout = self.groups["policy"].call("sync_layout", self.dtype)[0]
        spec = WeightSyncSpec(
            transport="broadcast",
            layout=layout,
            port=free_port(),
            world_size=1 + sum(self.engine_sync_sizes),
            backend="nccl" if self.device == "cuda" else "gloo",
            timeout_s=self.config.ray.startup_timeout_s,
        )
        offsets = [1 + sum(self.engine_sync_sizes[:i]) for i in range(len(self.engine_sync_sizes))]
        futures = self.groups["policy"].submit("init_sync", spec)
        futures += self.engines.submit("init_sync", per_rank=[(spec, offset) for offset in offsets])
        ray.get(futures)

    def optimizer_steps_per_step(self) -> int:
        cfg = self.config
        samples = cfg.rollout.rollout_batch_size * cfg.rollout.n_samples_per_prompt
        return cfg.train.max_epochs * (samples // (cfg.train.train_batch_size or samples))

    # ------------------------------------------------------------------------------------------
    # Checkpoints

    def resume(self) -> TrainingState:
        """Restore the newest step every trained role has a complete checkpoint of."""
        from rl_learner import list_checkpoints

        roles = [role for role in TRAINED_ROLES if role in self.groups]
        if not self.config.ckpt.load_checkpoint:
            return TrainingState(step=0)
        steps = None
        for role in roles:
            found = {info.step: info.tag for info in list_checkpoints(self.ckpt_root / role)}
            steps = set(found) if steps is None else steps & set(found)
        if not steps:
            return TrainingState(step=0)
        step = max(steps)
        states = {}
        for role in roles:
            tag = next(i.tag for i in list_checkpoints(self.ckpt_root / role) if i.step == step)
            states[role] = self.groups[role].call("load", str(self.ckpt_root / role), tag)[0]
        state = states["policy"]
        self.loader.load_state_dict(state.data_state)
        self.batches = iter(self.loader)
        self.next_group_id = int(state.extra.get("next_group_id", 0))
        self.kl_controller.value = float(state.extra.get("kl_coef", self.kl_controller.value))
        return state

    def save(self, step: int, consumed: int) -> None:
        state = TrainingState(
            step=step,
            consumed_samples=consumed,
            policy_version=self.version,
            data_state=msgspec.to_builtins(self.loader.state_dict()),
            extra={"next_group_id": self.next_group_id, "kl_coef": float(self.kl_controller.value)},
        )
        for role in TRAINED_ROLES:
            if role in self.groups:
                self.groups[role].call(
                    "save", str(self.ckpt_root / role), step, state, self.config.ckpt.max_ckpt_num
                )

    # ------------------------------------------------------------------------------------------
    # Generation

    def sampling(self, step: int) -> SamplingParams:
        r = self.config.rollout
        return SamplingParams(
            n=r.n_samples_per_prompt,
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=max(r.top_k, 0),  # -1 (OpenRLHF) and 0 (ours) both mean off
            max_new_tokens=r.generate_max_len,
            seed=r.seed + step,
        )

    def submit_generation(
        self, prompts: list[PromptSample], sampling: SamplingParams, *, for_training: bool = True
    ) -> list:
        """Split the prompts over the engines; futures of encoded records (with the greedy
        baseline's reward in each record when the estimator needs one and they are for training)."""
        count = len(self.engines)
        size = math.ceil(len(prompts) / count)
        futures = []
        for index in range(count):
            chunk = prompts[index * size : (index + 1) * size]
            if chunk:
                futures.append(
                    self.engines.actors[index].generate.remote(
                        encode(chunk), sampling, self.next_group_id, self.greedy_baseline and for_training
                    )
                )
                self.next_group_id += len(chunk)
        return futures

    def collect(self, futures: list) -> list[Trajectory]:
        import ray

        return [record for payload in ray.get(futures) for record in decode(payload, list[Trajectory])]

    def generate(self, step: int) -> tuple[list[Trajectory], dict[str, float]]:
        """The records of one step: `rollout_batch_size` prompts x n samples (DAPO-filtered if asked).

        In async mode the first batch of this step was submitted during the previous step, and
        the next step's is submitted here, before training, on the weights the engines hold now.
        """
        r = self.config.rollout
        futures = self.pending or self.submit_generation(next(self.batches), self.sampling(step))
        self.pending = None
        records = self.collect(futures)
        if r.async_train and step < self.config.train.max_steps:
            self.pending = self.submit_generation(next(self.batches), self.sampling(step + 1))
        if not r.dynamic_filtering:
            return records, {}
        low, high = r.dynamic_filtering_reward_range
        kept, _ = filter_groups(records, low=low, high=high)
        seen = len(records) // r.n_samples_per_prompt
        for attempt in range(1, r.max_sampling_rounds):
            if len(kept) >= r.rollout_batch_size:
                break
            sampling = msgspec.structs.replace(self.sampling(step), seed=r.seed + step + 7919 * attempt)
            more = self.collect(self.submit_generation(next(self.batches), sampling))
            kept += filter_groups(more, low=low, high=high)[0]
            seen += len(more) // r.n_samples_per_prompt
        if not kept:
            raise RuntimeError(
                f"dynamic filtering kept no group in {r.max_sampling_rounds} rounds (every group's mean reward "
                f"was outside {r.dynamic_filtering_reward_range}); widen rollout.dynamic_filtering_reward_range"
            )
        kept = kept[: r.rollout_batch_size]
        metrics = {"filter/groups_seen": float(seen), "filter/groups_kept": float(len(kept))}
        return [record for group in kept for record in group], metrics

    # ------------------------------------------------------------------------------------------
    # Experience

    def submit_forward(self, role: str, method: str, batch: ExperienceBatch, *args: Any) -> tuple[list, list]:
        """Every rank of `role` starts `method` on its share of `batch`; (parts per rank, futures)."""
        parts = self._split(batch, role)
        futures = self.groups[role].submit(method, per_rank=[(rank_parts, *args) for rank_parts in parts])
        return parts, futures

    def make_experience(self, records: list[Trajectory]) -> tuple[ExperienceBatch, dict[str, float]]:
        """Old / reference log-probs, values and reward-model scores (the roles run at the same
        time, one `ray.get`), then KL, token rewards, advantages and returns."""
        cfg = self.config
        batch = build_experience(records)
        temperature = cfg.rollout.temperature
        calls = {}
        if not old_logprobs_from_training(self.config):
            calls["old_logprobs"] = self.submit_forward("policy", "logprobs", batch, temperature)
        if "ref" in self.groups:
            calls["ref_logprobs"] = self.submit_forward("ref", "logprobs", batch, temperature)
        if "critic" in self.groups:
            calls["values"] = self.submit_forward("critic", "values", batch)
        if "reward_model" in self.groups:
            calls["scores"] = self.submit_forward("reward_model", "scores", batch)
        # one wait for all roles: the ranks of different roles run their forwards at the same time
        results = _get_all({name: futures for name, (_, futures) in calls.items()})
        for name, (parts, _) in calls.items():
            if name != "scores":
                setattr(batch, name, _assemble(batch, parts, results[name]))
        rewards = batch.rewards.clone()  # the rule / remote reward of each record
        metrics: dict[str, float] = {}
        if "scores" in calls:
            scores = _assemble_scores(batch, calls["scores"][0], results["scores"])
            metrics["reward/model_mean"] = float(scores.mean())
            rewards = rewards + scores

        mask = batch.response_action_mask()
        kl = None
        if batch.ref_logprobs is not None:  # never without old log-probs (old_logprobs_from_training)
            kl = kl_penalty(
                batch.response_view(batch.old_logprobs),
                batch.response_view(batch.ref_logprobs),
                cfg.algo.kl.kl_estimator.removesuffix("+"),
            )
            kl = kl * mask
            metrics["kl/mean"] = float(kl.sum(-1).mean())  # per-sequence KL, averaged
        beta = float(self.kl_controller.value)
        in_reward = kl is not None and not cfg.algo.kl.use_kl_loss
        clip = cfg.reward.clip
        outcome = rewards.clamp(-clip, clip) if clip else rewards
        token_rewards = token_level_rewards(
            rewards, mask, kl=kl if in_reward else None, kl_coef=beta if in_reward else 0.0, reward_clip=clip
        )
        estimator = cfg.algo.advantage.estimator
        # An estimator that clips itself (reinforce_baseline: OpenRLHF centres by the group mean,
        # then clips) gets the raw rewards and the clip; the others get the clipped rewards.
        clips_itself = _estimator_takes(estimator, "reward_clip")
        values = batch.response_view(batch.values) if batch.values is not None else None
        baseline = None
        if self.greedy_baseline:  # built like the rewards: the rule reward, clipped
            baseline = torch.tensor([record.extra["baseline_reward"] for record in records])
            baseline = baseline.clamp(-clip, clip) if clip and not clips_itself else baseline
            metrics["reward/greedy_baseline_mean"] = float(baseline.mean())
        advantages, returns = compute_advantages(
            estimator,
            baseline_rewards=baseline,
            rewards=rewards if clips_itself else outcome,
            token_rewards=token_rewards,
            values=values,
            action_mask=mask,
            group_ids=batch.group_ids,
            **_estimator_options(
                estimator,
                gamma=cfg.algo.advantage.gamma,
                lam=cfg.algo.advantage.lambd,
                reward_clip=clip,
                whiten=True if cfg.algo.advantage.whiten is None else cfg.algo.advantage.whiten,
            ),
        )
        batch.advantages = batch.from_response_view(advantages.float())
        batch.returns = batch.from_response_view(returns.float())
        if kl is not None:
            self.kl_controller.update(metrics["kl/mean"], len(records))

        lengths = batch.response_lengths.float()
        metrics.update(
            {
                "reward/mean": float(rewards.mean()),
                "reward/std": float(rewards.std()) if len(records) > 1 else 0.0,
                "reward/max": float(rewards.max()),
                "response_length/mean": float(lengths.mean()),
                "response_length/max": float(lengths.max()),
                "response/truncated": sum(r == "length" for r in batch.finish_reasons) / len(records),
                "advantages/mean": _mean(advantages, mask),
                "advantages/abs_mean": _mean(advantages.abs(), mask),
                "kl/coef": beta,
            }
        )
        if batch.rollout_logprobs is not None and batch.old_logprobs is not None:
            # without the old-log-prob forward the learner reports these from its training forward
            gap = (
                batch.response_view(batch.old_logprobs) - batch.response_view(batch.rollout_logprobs)
            ).abs()
            metrics["health/logprob_mismatch_mean"] = _mean(gap, mask)
            metrics["health/logprob_mismatch_max"] = float((gap * mask).max())
        metrics["health/policy_lag"] = float(self.version - batch.policy_versions.float().mean())
        return batch, metrics

    # ------------------------------------------------------------------------------------------
    # Training

    def policy_loss(self) -> PolicyLossConfig:
        return policy_loss_config(self.config, kl_coef=float(self.kl_controller.value))

    def train(self, batch: ExperienceBatch, step: int) -> dict[str, float]:
        cfg = self.config
        count = batch.rewards.numel()
        size = cfg.train.train_batch_size or count
        generator = torch.Generator().manual_seed(cfg.train.seed * 1_000_003 + step)
        policy_loss = self.policy_loss()
        value_loss = ValueLossConfig(
            clip_range=cfg.algo.value_clip, aggregation=policy_loss.aggregation, horizon=policy_loss.horizon
        )
        losses = {"critic": value_loss, "policy": policy_loss}
        roles = [role for role in losses if role in self.groups]
        history: dict[str, list[float]] = {}
        for _ in range(cfg.train.max_epochs):
            order = torch.randperm(count, generator=generator) if size < count else torch.arange(count)
            for start in range(0, count, size):
                mini = batch.select(order[start : start + size].tolist())
                # critic and policy train on the same mini-batch independently: both at once
                futures = {
                    role: self.groups[role].submit(
                        "train_step", per_rank=[(p, losses[role]) for p in self._split(mini, role)]
                    )
                    for role in roles
                }
                for role, per_rank in _get_all(futures).items():
                    for key, value in per_rank[0].items():  # the metrics are equal on every rank
                        name = f"health/{key}" if key.startswith("logprob_mismatch") else f"{role}/{key}"
                        history.setdefault(name, []).append(value)
        return {key: sum(values) / len(values) for key, values in history.items()}

    def _split(self, batch: ExperienceBatch, role: str) -> list[list[ExperienceBatch]]:
        """`batch` planned over the ranks of `role`: each rank's micro-batches (dynamic batching)."""
        ranks = len(self.groups[role])
        plan = plan_micro_batches(
            batch.sequence_lengths.tolist(), max_tokens=self.config.train.micro_batch_tokens, num_ranks=ranks
        )
        return [micro_batches(batch, plan, rank) for rank in range(ranks)]

    def sync_weights(self) -> dict[str, float]:
        import ray

        from rl_data import compare_checksums

        self.version += 1
        sent = self.groups["policy"].submit("sync", self.version)
        received = self.engines.submit("receive", self.version)
        reports = ray.get(sent)
        engine_reports = ray.get(received)
        report = reports[0]
        mismatched = sum(len(compare_checksums(report, other)) for other in engine_reports)
        return {
            "sync/seconds": float(report.seconds),
            "sync/gigabytes": report.num_bytes / 1e9,
            "health/sync_checksum_match": float(mismatched == 0),
        }

    # ------------------------------------------------------------------------------------------
    # Evaluation

    def evaluate(self) -> dict[str, float]:
        cfg = self.config
        samples = [self.eval_data[i] for i in range(len(self.eval_data))]
        sampling = SamplingParams(
            n=cfg.eval.n_samples_per_prompt,
            temperature=cfg.eval.temperature,
            max_new_tokens=cfg.rollout.generate_max_len,
            seed=cfg.rollout.seed,
        )
        group_id = self.next_group_id
        records = self.collect(self.submit_generation(samples, sampling, for_training=False))
        self.next_group_id = group_id  # evaluation does not consume group ids of the training stream
        rewards = torch.tensor([r.reward for r in records])
        lengths = torch.tensor([float(r.response_ids.numel()) for r in records])
        return {"eval/reward/mean": float(rewards.mean()), "eval/response_length/mean": float(lengths.mean())}

    # ------------------------------------------------------------------------------------------
    # The loop

    def fit(self, tracker: Tracker, start: TrainingState) -> None:
        cfg = self.config
        timer = PhaseTimer()
        consumed = start.consumed_samples
        self.version = start.policy_version
        if start.step > 0:
            with timer.phase("sync"):
                self.version -= 1  # sync_weights counts up: the engines get the restored weights as `version`
                self.sync_weights()
        elif self.eval_data is not None:
            tracker.log(0, self.evaluate())  # step 0: the starting policy, before any update
        for step in range(start.step + 1, cfg.train.max_steps + 1):
            timer.reset()
            began = time.perf_counter()
            with timer.phase("generation"):
                records, filter_metrics = self.generate(step)
            with timer.phase("experience"):
                batch, metrics = self.make_experience(records)
            with timer.phase("training"):
                metrics |= self.train(batch, step)
            with timer.phase("sync"):
                metrics |= self.sync_weights()
            if self.eval_data is not None and (
                step % cfg.eval.eval_steps == 0 or step == cfg.train.max_steps
            ):
                with timer.phase("eval"):
                    metrics |= self.evaluate()
            consumed += len(records)
            saving = (
                cfg.ckpt.save_steps > 0 and step % cfg.ckpt.save_steps == 0
            ) or step == cfg.train.max_steps
            if saving:
                with timer.phase("checkpoint"):
                    self.save(step, consumed)
            elapsed = time.perf_counter() - began
            metrics |= filter_metrics | timer.metrics()
            metrics["time/step"] = elapsed
            metrics["throughput/samples_per_s"] = len(records) / elapsed
            metrics["throughput/tokens_per_s"] = float(batch.sequence_lengths.sum()) / elapsed
            metrics["policy_version"] = float(self.version)
            tracker.log(step, metrics)

    def export(self) -> Path:
        path = self.output_dir / "final"
        self.groups["policy"].call("export", str(path), self.inputs.model_path)
        return path

    def shutdown(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for group in [*self.groups.values(), *([self.engines] if hasattr(self, "engines") else [])]:
            with contextlib.suppress(Exception):  # an actor that already died
                group.kill()
        for placement in self.placement.values():
            with contextlib.suppress(Exception):
                remove_placement_group(placement)


def _data_stats(data: Any) -> str:
    stats = getattr(getattr(data, "data", data), "stats", None)  # through _Subset
    return stats.summary() if stats is not None else "no statistics"


class _Subset:
    """The first `limit` items of a dataset (data.max_samples)."""

    def __init__(self, data: Any, limit: int) -> None:
        self.data, self.limit = data, limit

    def __len__(self) -> int:
        return self.limit

    def __getitem__(self, index: int) -> Any:
        if not 0 <= index < self.limit:
            raise IndexError(index)
        return self.data[index]


def _prepare_preset(config: PPOConfig) -> Any | None:
    """The preset's inputs (built once, then cached), or None without a preset."""
    if config.preset == "none":
        return None
    from .presets import prepare_preset

    return prepare_preset(config.preset, config.preset_root, seed=0)


def run(config: PPOConfig) -> int:
    """Run `rl-launch ppo` with a resolved config; the process exit code (0 on success)."""
    import ray

    from .options import dump_config

    started_ray = False
    trainer = None
    console = StartupLines("rl-launch ppo")
    try:
        check_combination(config)
        if config.log.actor_output == "file":
            quiet_third_party_output()
        preset = _prepare_preset(config)
        if preset is not None:
            console.say(f"preset {config.preset}: model and prompts in {Path(preset.model_path).parent}")
        inputs = resolve_inputs(config, preset)
        output_dir = Path(config.log.output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "config.yaml").write_text(dump_config(config))
        trainer = PPOTrainer(config, inputs)
        trainer.load_data()
        console.say(trainer.describe_data())
        console.say(trainer.describe_algorithm())
        tracker_options = {
            "progress_bar": config.log.progress_bar,
            "tensorboard": config.log.use_tensorboard,
            "wandb": config.log.use_wandb,
            "wandb_project": config.log.wandb_project,
            "run_name": config.log.run_name,
            "config": msgspec.to_builtins(config),
        }
        started_ray = start_ray(config, temp_dir=config.ray.temp_dir)
        console.say(
            f"ray: {'local cluster on 127.0.0.1' if started_ray else 'joined ' + str(config.ray.address)}"
        )
        trainer.start_actors()
        console.say(trainer.describe_actors())
        trainer.init_weight_sync()
        console.say(f"weight sync: bucketed broadcast ({'nccl' if trainer.device == 'cuda' else 'gloo'})")
        state = trainer.resume()
        with Tracker(
            output_dir, total_steps=config.train.max_steps, start_step=state.step, **tracker_options
        ) as tracker:
            if state.step:
                tracker.message(f"resumed from step {state.step} ({trainer.ckpt_root})")
            trainer.fit(tracker, state)
            final = trainer.export() if config.ckpt.save_hf_model else None
            summary = tracker.close()
        print(f"outputs in {output_dir.resolve()}:")
        print(f"  metrics   {Path(summary.metrics_path).resolve()}")
        if summary.plot_path:
            print(f"  plot      {Path(summary.plot_path).resolve()}")
        print(f"  checkpoints {trainer.ckpt_root.resolve()}")
        if final is not None:
            print(f"  model     {final.resolve()}")
        if config.log.actor_output == "file":
            print(f"  actor logs {trainer.actor_log_dir.resolve()}")
        return 0
    except (ConfigError, PreflightError, ClusterError) as error:
        print(f"rl-launch ppo: error: {error}", file=sys.stderr)
        return 2 if isinstance(error, ConfigError) else 1
    except KeyboardInterrupt:
        return 130
    except ray.exceptions.RayError as error:
        cause = getattr(error, "cause", None) or error
        print(f"rl-launch ppo: error in a Ray actor: {type(cause).__name__}: {cause}", file=sys.stderr)
        return 1
    finally:
        if trainer is not None and ray.is_initialized():
            trainer.shutdown()
        if started_ray and ray.is_initialized():
            ray.shutdown()
