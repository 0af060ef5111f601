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

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from rl_learner import DeepSpeedConfig, LoraOptions, OptimizerConfig

from .plugins import PluginRef, import_plugins

__all__ = ["ActorGroup", "EngineSpec", "LearnerSpec", "LearnerWorker", "RolloutWorker"]

LEARNER_ROLES = ("policy", "ref", "critic", "reward_model")


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
    model_path: str
    dtype: str
    max_model_len: int
    seed: int
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.6
    max_num_seqs: int | None = None
    enforce_eager: bool = False
    reward_function: str | None = None
    reward_url: str | None = None
    reward_timeout_s: float = 60.0
    log_dir: str | None = None
    """Folder of the actor's output file (`engine-<index>.log`); None: Ray's own handling."""
    plugins: tuple[PluginRef, ...] = ()
    """User modules (`--plugin`) imported before anything else, so their registrations exist here."""


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


class LearnerWorker:
    """One data-parallel rank of one role (Ray actor class; see `ActorGroup`)."""

    def __init__(self, spec: LearnerSpec, rank: int, world_size: int, master_port: int) -> None:
        send_output_to(spec.log_dir, f"{spec.role}-{rank}")
        # First: a PolicyLossConfig checks its loss name against POLICY_LOSSES as it arrives here.
        import_plugins(spec.plugins)
        os.environ.update(
            RANK=str(rank),
            LOCAL_RANK="0",
            WORLD_SIZE=str(world_size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(master_port),
        )
        import torch

        from rl_learner import (
            PolicyLearner,
            ValueLearner,
            apply_lora,
            deepspeed_config,
            load_causal_lm,
            load_value_model,
        )
        from rl_learner.config import torch_dtype

        torch.manual_seed(spec.seed)
        self.spec = spec
        dtype = torch_dtype(spec.dtype)
        zero3 = None
        if spec.deepspeed.zero_stage == 3:
            zero3 = deepspeed_config(spec.deepspeed, spec.optimizer, world_size=world_size)
        options = {
            "dtype": dtype,
            "attn_implementation": spec.deepspeed.attn_implementation,
            "gradient_checkpointing": spec.deepspeed.gradient_checkpointing,
            "zero3_config": zero3,
        }
        if spec.role in ("policy", "ref"):
            model = load_causal_lm(spec.model_path, **options)
        else:
            model = load_value_model(spec.model_path, head_seed=spec.seed, **options)
        if spec.lora is not None:
            model = apply_lora(model, spec.lora)
        learner_class = PolicyLearner if spec.role in ("policy", "ref") else ValueLearner
        self.learner = learner_class(
            model,
            deepspeed=spec.deepspeed,
            optimizer=spec.optimizer,
            total_steps=spec.total_steps,
            on_non_finite=spec.on_non_finite,
        )
        self.sender = None

    def ready(self) -> bool:
        return True

    def logprobs(self, parts: list, temperature: float) -> list:
        """Log-probs at the action tokens (0 elsewhere): the loop reads nothing else."""
        return self.learner.logprobs(parts, temperature=temperature, only_actions=True)

    def values(self, parts: list) -> list:
        return self.learner.values(parts)

    def scores(self, parts: list) -> list:
        return self.learner.scores(parts)

    def train_step(self, parts: list, loss: Any) -> dict[str, float]:
        """One optimizer step (policy or critic: `loss` is a PolicyLossConfig or ValueLossConfig)."""
        return self.learner.train_step(parts, loss)

    def sync_layout(self, dtype: str) -> Any:
        """The `WeightSyncMeta` the engines must accept: names, shapes and `dtype` of every tensor."""
        from rl_learner import sync_layout
        from rl_learner.config import torch_dtype

        return sync_layout(self.learner.engine, dtype=torch_dtype(dtype))

    def init_sync(self, spec: Any) -> None:
        """Join the weight-sync group (blocks until every engine has joined too)."""
        from rl_learner import make_sender

        self.sender = make_sender(spec, self.learner.engine)

    def sync(self, version: int) -> Any:
        """Send the current weights; every rank calls, DP rank 0 returns the `WeightSyncReport`."""
        return self.sender.send(version)

    def save(self, root: str, step: int, state: Any, keep_last: int) -> str:
        from rl_learner import save_checkpoint

        return str(
            save_checkpoint(root, step, {self.spec.role: self.learner.engine}, state, keep_last=keep_last)
        )

    def load(self, root: str, tag: str) -> Any:
        from rl_learner import load_checkpoint

        return load_checkpoint(root, {self.spec.role: self.learner.engine}, tag=tag)

    def export(self, path: str, tokenizer_path: str) -> str:
        from transformers import AutoTokenizer

        from rl_learner import export_hf

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        return str(export_hf(self.learner.engine, path, tokenizer=tokenizer))

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
            self.sender = None


def build_reward(spec: EngineSpec) -> Any:
    """The reward function of a rollout worker: a reward server, a registered reward
    (`rl_launch.components.REWARDS`) or an OpenRLHF `reward_func` file."""
    from rl_rollout import BatchedReward, RemoteRewardClient, load_reward_function

    from .components import REWARDS

    name = spec.reward_function
    if spec.reward_url is not None:
        return RemoteRewardClient(spec.reward_url, timeout_s=spec.reward_timeout_s)
    if name is None:
        return BatchedReward(lambda queries, prompts, labels: [0.0] * len(queries), name="zero")
    if name in REWARDS:
        return REWARDS[name]()
    return load_reward_function(name)


class RolloutWorker:
    """One rollout engine with its tokenizer and reward function (Ray actor class)."""

    def __init__(self, spec: EngineSpec, index: int = 0) -> None:
        send_output_to(spec.log_dir, f"engine-{index}")
        import_plugins(spec.plugins)
        from transformers import AutoTokenizer

        self.spec = spec
        self.tokenizer = AutoTokenizer.from_pretrained(spec.model_path)
        self.reward_fn = build_reward(spec)
        from .components import ENGINES

        self.engine = ENGINES[spec.kind](spec, **spec.options)

    def ready(self) -> tuple[int, int | None]:
        """(weight-sync ranks this engine takes, its KV-cache bytes or None where vLLM sizes it)."""
        return self.engine.sync_world_size, getattr(self.engine, "kv_cache_bytes", None)

    def generate(
        self, samples: bytes, sampling: Any, first_group_id: int, greedy_baseline: bool = False
    ) -> bytes:
        """Run the single-turn executor on encoded `PromptSample`s; encoded `Trajectory`s back.

        With `greedy_baseline` (ReMax) each prompt is also answered greedily, and every sampled
        record of that prompt carries the greedy answer's reward as `extra["baseline_reward"]`.
        """
        import msgspec

        from rl_data import PromptSample, Trajectory, decode, encode
        from rl_rollout import SingleTurnExecutor

        prompts = decode(samples, list[PromptSample])

        def run(params: Any) -> list[Trajectory]:
            executor = SingleTurnExecutor(
                self.engine, self.reward_fn, self.tokenizer, params, first_group_id=first_group_id
            )
            return executor.run(prompts)

        records = run(sampling)
        if greedy_baseline:
            greedy = run(msgspec.structs.replace(sampling, n=1, temperature=0.0))
            baseline = {record.group_id: record.reward for record in greedy}
            for record in records:
                record.extra["baseline_reward"] = baseline[record.group_id]
        return encode(records)

    def init_sync(self, spec: Any, rank: int) -> None:
        self.engine.init_weight_sync(spec, rank=rank)

    def receive(self, version: int) -> Any:
        return self.engine.receive_weights(version=version)

    def policy_version(self) -> int:
        return self.engine.policy_version

    def close(self) -> None:
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()


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
    ) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.role = role
        remote_class = ray.remote(actor_class)
        self.actors = [
            remote_class.options(
                num_gpus=num_gpus,
                num_cpus=num_cpus,
                name=None,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=placement_group, placement_group_bundle_index=rank
                ),
                runtime_env={"env_vars": env} if env else None,
            ).remote(*args)
            for rank, args in enumerate(args_per_rank)
        ]

    def __len__(self) -> int:
        return len(self.actors)

    def submit(self, method: str, *args: Any, per_rank: Sequence[tuple] | None = None) -> list:
        """Call `method` on every actor without waiting: the same `args`, or `per_rank[i]` on actor i."""
        calls = per_rank if per_rank is not None else [args] * len(self.actors)
        return [getattr(actor, method).remote(*call) for actor, call in zip(self.actors, calls, strict=True)]

    def call(self, method: str, *args: Any, per_rank: Sequence[tuple] | None = None) -> list:
        """`submit` and wait for every actor's result."""
        import ray

        return ray.get(self.submit(method, *args, per_rank=per_rank))

    def kill(self) -> None:
        import ray

        for actor in self.actors:
            ray.kill(actor, no_restart=True)
