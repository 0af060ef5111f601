"""What each actor of a run starts from: the learners' and the engines' specs, the engines' Ray options.

Pure functions of the config and the run's inputs (model paths, reward function), called by
`rl_launch.roles.Roles.start` once the device and precision are resolved.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import msgspec

from .actors import ACTIVITY_GROUP, GENERATE_GROUP, RECEIVE_GROUP, EngineSpec, LearnerSpec
from .components import executor_name
from .config import PPOConfig
from .learner_settings import learner_settings, role_optimizer
from .lora_sync import lora_sync_mode

__all__ = [
    "MAX_GENERATE_THREADS",
    "default_max_num_seqs",
    "engine_concurrency_groups",
    "engine_spec",
    "header_variables",
    "learner_specs",
]


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


def header_variables(config: PPOConfig) -> dict[str, str]:
    """The variables `reward.headers_env` names, for the engines' runtime environment on a joined
    cluster (`ray.address`), whose actors do not inherit the driver's environment. A local cluster's
    actors inherit it, and nothing is passed: Ray's runtime-env agent writes the variables it sets
    into its session log."""
    if config.ray.address is None:
        return {}
    return {name: os.environ[name] for name in config.reward.headers_env.values() if name in os.environ}


def learner_specs(
    cfg: PPOConfig, inputs: Any, *, dtype: str, use_gpus: bool, total_steps: int
) -> dict[str, LearnerSpec]:
    """Every learner role's spec (`rl_launch.actors.LearnerSpec`); the run starts those it needs."""
    actor = learner_settings(
        cfg.model, cfg.train, dtype=dtype, use_gpus=use_gpus, **role_optimizer(cfg.train, "actor")
    )
    critic = learner_settings(
        cfg.model, cfg.train, dtype=dtype, use_gpus=use_gpus, **role_optimizer(cfg.train, "critic")
    )
    ds = actor.deepspeed
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


def engine_spec(
    cfg: PPOConfig, inputs: Any, *, dtype: str, use_gpus: bool, log_dir: str | None, plugins: tuple = ()
) -> EngineSpec:
    """The engines' spec (`rl_launch.actors.EngineSpec`), the same for each of them."""
    r = cfg.rollout
    options = dict(r.engine_options)
    if cfg.ray.colocate == "all" and cfg.ray.engine_sleep and use_gpus and r.engine == "vllm":
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
        dtype=dtype,
        max_model_len=cfg.data.prompt_max_len + r.generate_max_len,
        seed=r.seed,
        tensor_parallel_size=r.tensor_parallel_size,
        gpu_memory_utilization=r.gpu_memory_utilization,
        max_num_seqs=r.max_num_seqs or default_max_num_seqs(cfg),
        enforce_eager=r.enforce_eager or not use_gpus,
        reward_function=inputs.reward_function,
        reward=cfg.reward,
        log_dir=log_dir,
        plugins=plugins,
        partial_rollout=r.partial_rollout,
        streaming=r.streaming,
        # vLLM logs every weight reload at INFO and WARNING; that would bury the progress bar.
        vllm_logging_level=os.environ.get("VLLM_LOGGING_LEVEL", "ERROR"),
        lora_rank=cfg.model.lora_rank if lora_sync_mode(cfg, use_gpus=use_gpus) == "adapter" else 0,
    )
