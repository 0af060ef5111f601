"""OpenRLHF 0.11's PPO flag names, accepted by `rl-launch ppo` and rewritten to its own options.

OpenRLHF 0.11 names its PPO flags by owner and dot (`--algo.kl.init_coef`, `--rollout.batch_size`,
`--actor.eps_clip_low_high 0.2 0.28`, `--ckpt.load_enable`, ...): the argument list of
`openrlhf/cli/train_ppo_ray.py`, whose old flat names (`--init_kl_coef`, `--rollout_batch_size`,
...) were removed. `expand_aliases` rewrites a command line written with those names into this
launcher's options before argparse sees it, and returns one note per rewritten flag, which the
CLI prints so that nothing is translated silently:

    argv, notes = expand_aliases(["--algo.kl.use_loss", "--actor.eps_clip_low_high", "0.2", "0.28"])
    argv == ["--algo.kl.use_kl_loss", "true", "--algo.policy.options.epsilon_low", "0.2",
             "--algo.policy.options.epsilon_high", "0.28"]
    notes == ["--algo.kl.use_loss → --algo.kl.use_kl_loss true",
              "--actor.eps_clip_low_high 0.2 0.28 → --algo.policy.options.epsilon_low 0.2 ..."]

The rule: an alias renames what the user wrote; it never changes a default. A setting the command
line does not give keeps rl-launch's default wherever OpenRLHF's differs (the KL coefficient is
0.01 there and 0 here, GSPO's clip range is 0.2 there and GSPO's own 3e-4 / 4e-4 here, OpenRLHF
aggregates GSPO per sequence and rl-launch by `algo.policy.aggregation`, ...). A flag is aliased
only where it means the same thing here; conversions stay within that meaning:

- a rename, maybe with its value converted (`--actor.policy_loss_type gspo` → `--algo.policy.loss
  gspo_sequence`, OpenRLHF's form of GSPO) or spread over several options (`--algo.kl.estimator`
  sets both `algo.kl.reward_estimator` and `algo.kl.loss_estimator`: OpenRLHF has one estimator
  for whichever side the run uses);
- flags that combine into one option (`--train.colocate_*` → `--ray.colocate`;
  `--actor.num_nodes` × `--actor.num_gpus_per_node` → `--ray.policy.num_actors`);
- flags whose meaning is what rl-launch always does (`--ds.packing_samples`, `--actor.optim adam`):
  accepted and dropped, with a note; another value than rl-launch's is refused;
- flags OpenRLHF itself ignores in the run at hand (`--algo.advantage.gamma` with `group_norm`,
  which OpenRLHF runs with gamma 1): dropped, with a note saying why.

`UNSUPPORTED` lists OpenRLHF 0.11 flags with no counterpart here and why; `expand_aliases` refuses
them with that reason (one `ValueError` naming every such flag) instead of argparse's "unknown
option". OpenRLHF flags whose name is already an rl-launch option (`--algo.advantage.estimator`,
`--rollout.n_samples_per_prompt`, `--rollout.temperature`, `--train.max_epochs`, `--ckpt.path`,
...) pass through untouched; every OpenRLHF estimator name is registered in `rl_algos` under the
same name (`group_norm` is grpo's alias). One such name takes a second meaning in OpenRLHF:
`--reward.remote_url path.py` names a local reward function file there, which is
`--reward.function path.py` here (an http(s) URL stays as it is).

rl-launch's own former option names are rewritten the same way, with a note: the rollout
correction's four options `algo.policy.is_correction` / `_level` / `_gating` / `_bounds` are now
`algo.policy.correction` and its options `algo.policy.correction_options` (`FORMER_CORRECTION_KEYS`).
`expand_former_options` rewrites a command line, `migrate_former_keys` a config file's settings
and the configuration of a format-1 `run.json` (so an old run folder resumes).
"""

from __future__ import annotations

import dataclasses
import shlex
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = [
    "ALIASES",
    "FORMER_CORRECTION_KEYS",
    "UNSUPPORTED",
    "Alias",
    "Context",
    "expand_aliases",
    "expand_former_options",
    "migrate_former_keys",
]

Pairs = list[tuple[str, str]]
"""(our dotted option, its command-line text) pairs, in order."""


@dataclasses.dataclass(frozen=True)
class Context:
    """What a conversion may consult besides its own values: the rest of the command line."""

    given: Mapping[str, tuple[str, ...]]
    """Every aliased OpenRLHF flag on the command line (no dashes) -> the values it was given last."""
    estimator: str | None
    """The value of `--algo.advantage.estimator` on the command line, None when it is not there."""


Convert = Callable[[tuple[str, ...], Context], "Pairs | str"]
"""(values, context) -> the options to emit, or a str: why nothing is emitted. Raises ValueError
for a value that has no counterpart here."""


@dataclasses.dataclass(frozen=True)
class Alias:
    """One OpenRLHF 0.11 flag and what it becomes here."""

    flag: str
    """OpenRLHF's name, without the dashes (`actor.eps_clip_low_high`)."""
    targets: tuple[str, ...]
    """Every rl-launch option it may set (`algo.policy.options.epsilon_low`, ...); () when dropped."""
    nargs: int | None = 1
    """Values after the flag: 0 for OpenRLHF's store_true flags, None for one or more (nargs="*")."""
    convert: Convert | None = None
    """None: the plain rename of `_rename`."""
    remark: str = ""
    """What a reader of the README should know about it (a differing convention, a condition)."""

    def expand(self, values: tuple[str, ...], context: Context) -> Pairs | str:
        if self.convert is None:
            return _rename(self, values, context)
        return self.convert(values, context)


def _rename(alias: Alias, values: tuple[str, ...], context: Context) -> Pairs:
    """The plain rename: a bare flag sets each target to true; one value goes to every target;
    n values to n targets go pairwise; several values to one target are joined by commas (a
    tuple or list option here, `0.2,0.28`)."""
    del context
    if alias.nargs == 0:
        return [(target, "true") for target in alias.targets]
    if len(alias.targets) == 1:
        return [(alias.targets[0], ",".join(values))]
    if len(values) == 1:
        return [(target, values[0]) for target in alias.targets]
    return list(zip(alias.targets, values, strict=True))


# --------------------------------------------------------------------------------------------
# Conversions that need more than a rename.


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"expected a number, got {text!r}") from None


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"expected an integer, got {text!r}") from None


def _same(text: str, other: str) -> bool:
    try:
        return float(text) == float(other)
    except ValueError:
        return text.strip().lower() == other.strip().lower()


def _always(reason: str, value: str | None = None) -> Convert:
    """A flag meaning what rl-launch always does: dropped with `reason`; any other value refused."""

    def convert(values: tuple[str, ...], context: Context) -> str:
        if value is not None and not _same(values[0], value):
            raise ValueError(f"rl-launch always uses {value} ({reason}); {values[0]!r} is not available")
        return f"rl-launch always does so: {reason}"

    return convert


# OpenRLHF sets gamma to 1.0 for these estimators, whatever the flag says; lambd is gae's alone.
_UNDISCOUNTED_ESTIMATORS = ("rloo", "reinforce_baseline", "group_norm", "dr_grpo")


def _gamma(values: tuple[str, ...], context: Context) -> Pairs | str:
    if context.estimator in _UNDISCOUNTED_ESTIMATORS:
        return f"OpenRLHF ignores it for {context.estimator}, which it runs with gamma 1.0"
    return [("algo.advantage.options.gamma", values[0])]


def _lambd(values: tuple[str, ...], context: Context) -> Pairs | str:
    if context.estimator is not None and context.estimator != "gae":
        return f"lambda is GAE's; OpenRLHF ignores it for {context.estimator}"
    return [("algo.advantage.options.lam", values[0])]


def _reward_normalize(values: tuple[str, ...], context: Context) -> Pairs | str:
    # OpenRLHF applies the mean and std of the reward model's config.json to that model's score;
    # rewards of a function or a server are never normalised there.
    del values
    if "reward.model_name_or_path" not in context.given:
        return "OpenRLHF normalises only a reward model's score, and no --reward.model_name_or_path is given"
    return [("reward.normalize", "model")]


_EPSILON_LOW = "algo.policy.options.epsilon_low"
_EPSILON_HIGH = "algo.policy.options.epsilon_high"


def _eps_clip(values: tuple[str, ...], context: Context) -> Pairs | str:
    if "actor.eps_clip_low_high" in context.given:
        return "OpenRLHF uses --actor.eps_clip_low_high instead when both are given"
    return [(_EPSILON_LOW, values[0]), (_EPSILON_HIGH, values[0])]


# OpenRLHF's GSPO differentiates the sequence ratio itself: rl_algos' gspo_sequence.
_POLICY_LOSSES = {"ppo": "ppo", "gspo": "gspo_sequence"}


def _policy_loss(values: tuple[str, ...], context: Context) -> Pairs:
    loss = values[0]
    if loss not in _POLICY_LOSSES:
        raise ValueError(
            f"OpenRLHF's choices are {', '.join(_POLICY_LOSSES)}, got {loss!r}; "
            "rl-launch's own loss names go to --algo.policy.loss"
        )
    return [("algo.policy.loss", _POLICY_LOSSES[loss])]


_IS_ENABLE = "algo.advantage.is_correction_enable"
_IS_TYPE = "algo.advantage.is_correction_type"


def _is_correction(values: tuple[str, ...], context: Context) -> Pairs:
    if _IS_ENABLE not in context.given:
        raise ValueError(
            f"turns nothing on without --{_IS_ENABLE} (OpenRLHF ignores it); add that flag or drop this one"
        )
    kind = context.given.get(_IS_TYPE, ("tis",))[0]  # OpenRLHF's type when only the switch is given
    return [("algo.policy.correction", kind)]


_COLOCATE = {
    "train.colocate_all": "all",
    "train.colocate_actor_ref": "policy_ref",
    "train.colocate_critic_reward": "critic_reward",
}


def _colocate(values: tuple[str, ...], context: Context) -> Pairs:
    given = [value for flag, value in _COLOCATE.items() if flag in context.given]
    return [("ray.colocate", "all" if "all" in given else "+".join(given))]


_ROLES = {"actor": "policy", "critic": "critic", "ref": "ref", "reward": "reward_model"}


def _num_actors(entity: str) -> Convert:
    """OpenRLHF places num_nodes × num_gpus_per_node ranks of a role; rl-launch counts them."""
    nodes_flag, gpus_flag = f"{entity}.num_nodes", f"{entity}.num_gpus_per_node"
    target = f"ray.{_ROLES[entity]}.num_actors"

    def convert(values: tuple[str, ...], context: Context) -> Pairs:
        nodes, gpus = context.given.get(nodes_flag), context.given.get(gpus_flag)
        if nodes is None or gpus is None:
            raise ValueError(
                f"give --{nodes_flag} and --{gpus_flag} together (their product is the number of "
                f"ranks, --{target}), or give --{target} itself"
            )
        return [(target, str(_int(nodes[0]) * _int(gpus[0])))]

    return convert


def _shared(option: str, target: str) -> Convert:
    """`--actor.<option>` and `--critic.<option>`, which rl-launch holds once, in `target`."""

    def convert(values: tuple[str, ...], context: Context) -> Pairs:
        actor, critic = context.given.get(f"actor.{option}"), context.given.get(f"critic.{option}")
        if actor is not None and critic is not None and not all(map(_same, actor, critic)):
            raise ValueError(
                f"--actor.{option} {' '.join(actor)} and --critic.{option} {' '.join(critic)} differ; "
                f"rl-launch has one --{target} for the policy and the critic"
            )
        return [(target, ",".join(values))]

    return convert


def _reward_clip(values: tuple[str, ...], context: Context) -> Pairs:
    low, high = (_float(value) for value in values)
    if not (high > 0 and low == -high):
        raise ValueError(
            f"rl-launch clips rewards to [-c, c] (--reward.clip c); ({values[0]}, {values[1]}) is not of that form"
        )
    return [("reward.clip", values[1])]


def _remote_url(values: tuple[str, ...], context: Context) -> Pairs:
    url = values[0]
    if url.endswith(".py") and "://" not in url:  # OpenRLHF's local reward function file
        return [("reward.function", url)]
    return [("reward.remote_url", url)]


def _wandb_key(values: tuple[str, ...], context: Context) -> Pairs:
    # The value is an API key or True (use the stored login); a key is never echoed back.
    if values[0].strip().lower() in ("true", "1"):
        return [("log.use_wandb", "true")]
    raise ValueError(
        "rl-launch takes no wandb API key on the command line: log in once (`wandb login`, or "
        "WANDB_API_KEY in the environment) and give --logger.wandb.key True or --log.use_wandb"
    )


# --------------------------------------------------------------------------------------------
# The tables.


def _alias(
    flag: str, *targets: str, nargs: int | None = 1, convert: Convert | None = None, remark: str = ""
) -> Alias:
    return Alias(flag, targets, nargs, convert, remark)


_PACKING = "sequences are packed into micro-batches of at most --train.micro_batch_tokens tokens"

ALIASES: tuple[Alias, ...] = (
    # Models.
    _alias("actor.model_name_or_path", "model.pretrain"),
    _alias("critic.model_name_or_path", "model.critic_pretrain"),
    _alias("reward.model_name_or_path", "model.reward_pretrain"),
    _alias(
        "reward.remote_url",
        "reward.function",
        "reward.remote_url",
        convert=_remote_url,
        remark="a `.py` file is a local reward function (`reward.function`); a URL stays `reward.remote_url`",
    ),
    _alias("ds.param_dtype", "model.dtype"),
    _alias("ds.attn_implementation", "model.attn_implementation"),
    _alias("actor.gradient_checkpointing_enable", "model.gradient_checkpointing", nargs=0),
    _alias("ds.lora.rank", "model.lora_rank"),
    _alias("ds.lora.alpha", "model.lora_alpha"),
    _alias("ds.lora.target_modules", "model.target_modules", nargs=None),
    # Data and evaluation.
    _alias("data.prompt_dataset", "data.prompt_data"),
    _alias("eval.dataset", "data.eval_dataset"),
    _alias("eval.steps", "eval.eval_steps"),
    _alias("data.prompt_probs", "data.prompt_probs"),
    _alias("data.prompt_split", "data.prompt_split"),
    _alias("eval.split", "eval.split"),
    _alias(
        "data.input_template",
        "data.input_template",
        remark="used instead of the chat template; OpenRLHF ignores it when --data.apply_chat_template is given",
    ),
    # Rollout.
    _alias("rollout.batch_size", "rollout.rollout_batch_size"),
    _alias("rollout.max_new_tokens", "rollout.generate_max_len"),
    _alias(
        "rollout.vllm_generate_batch_size",
        "rollout.generate_batch_size",
        remark="prompts per sampling round; the surplus accepted groups are dropped here (OpenRLHF keeps them "
        "for its next steps), so a value above the batch needs dynamic filtering",
    ),
    _alias("vllm.num_engines", "rollout.num_engines"),
    _alias("vllm.tensor_parallel_size", "rollout.tensor_parallel_size"),
    _alias("vllm.gpu_memory_utilization", "rollout.gpu_memory_utilization"),
    _alias("vllm.enforce_eager", "rollout.enforce_eager", nargs=0),
    _alias("vllm.enable_prefix_caching", "rollout.engine_options.enable_prefix_caching", nargs=0),
    _alias("train.async_enable", "rollout.async_train", nargs=0),
    _alias("train.async_queue_size", "rollout.async_depth"),
    _alias("algo.dynamic_filtering_enable", "rollout.dynamic_filtering", nargs=0),
    _alias(
        "train.agent_func_path",
        "rollout.agent_func_path",
        remark="runs rollout.executor multi_turn; its options: --rollout.executor_options.max_turns, ...",
    ),
    _alias("algo.dynamic_filtering_range", "rollout.dynamic_filtering_reward_range", nargs=2),
    # Reward.
    _alias(
        "reward.clip_range",
        "reward.clip",
        nargs=2,
        convert=_reward_clip,
        remark="symmetric ranges only: -c c",
    ),
    _alias("reward.overlong_buffer_len", "reward.overlong_buffer_len"),
    _alias("reward.overlong_penalty_factor", "reward.overlong_penalty_factor"),
    _alias("reward.stop_properly_penalty_coef", "reward.stop_properly_penalty_coef"),
    _alias(
        "reward.normalize_enable",
        "reward.normalize",
        nargs=0,
        convert=_reward_normalize,
        remark="the reward model's score by its config.json's mean and std; dropped without a reward model",
    ),
    # Advantage estimator (`--algo.advantage.estimator` is the same name here).
    _alias(
        "algo.advantage.gamma",
        "algo.advantage.options.gamma",
        convert=_gamma,
        remark="dropped for rloo, reinforce_baseline, group_norm, dr_grpo, which OpenRLHF runs with gamma 1",
    ),
    _alias(
        "algo.advantage.lambd",
        "algo.advantage.options.lam",
        convert=_lambd,
        remark="dropped for an estimator other than gae, which OpenRLHF ignores it for",
    ),
    # KL.
    _alias("algo.kl.init_coef", "algo.kl.init_kl_coef"),
    _alias("algo.kl.use_loss", "algo.kl.use_kl_loss", nargs=0),
    _alias(
        "algo.kl.estimator",
        "algo.kl.reward_estimator",
        "algo.kl.loss_estimator",
        remark="one OpenRLHF estimator serves the side the run uses (reward or loss)",
    ),
    _alias("algo.kl.target", "algo.kl.kl_target"),
    _alias("algo.kl.horizon", "algo.kl.kl_horizon"),
    # Policy loss and the rollout/learner mismatch correction.
    _alias("actor.policy_loss_type", "algo.policy.loss", convert=_policy_loss, remark="gspo → gspo_sequence"),
    _alias(
        "actor.eps_clip",
        _EPSILON_LOW,
        _EPSILON_HIGH,
        convert=_eps_clip,
        remark="dropped when --actor.eps_clip_low_high is given, as OpenRLHF does",
    ),
    _alias("actor.eps_clip_low_high", _EPSILON_LOW, _EPSILON_HIGH, nargs=2),
    _alias("actor.dual_clip", "algo.policy.options.dual_clip"),
    _alias("actor.entropy_coef", "algo.policy.entropy_coef"),
    _alias("actor.aux_loss_coef", "algo.policy.aux_loss_coef", remark="the policy's MoE load-balancing loss"),
    _alias(
        _IS_ENABLE,
        "algo.policy.correction",
        nargs=0,
        convert=_is_correction,
        remark="with --algo.advantage.is_correction_type (default tis, as OpenRLHF)",
    ),
    _alias(_IS_TYPE, "algo.policy.correction", convert=_is_correction, remark="tis, icepop, seq-mask-tis"),
    _alias(
        "algo.advantage.is_correction_threshold",
        "algo.policy.correction_options.low",
        "algo.policy.correction_options.high",
        nargs=2,
    ),
    _alias("critic.value_clip", "algo.value_clip"),
    # Training.
    _alias("train.batch_size", "train.train_batch_size"),
    _alias("train.max_tokens_per_gpu", "train.micro_batch_tokens"),
    _alias("train.dynamic_batch_enable", nargs=0, convert=_always(_PACKING)),
    _alias("ds.packing_samples", nargs=0, convert=_always(_PACKING)),
    _alias("actor.adam.lr", "train.actor_learning_rate"),
    _alias("critic.adam.lr", "train.critic_learning_rate"),
    *(
        _alias(
            f"{entity}.{option}",
            target,
            nargs=nargs,
            convert=_shared(option, target),
            remark="one value for both roles",
        )
        for option, target, nargs in (
            ("adam.betas", "train.adam_betas", 2),
            ("adam.weight_decay", "train.weight_decay", 1),
            ("lr_warmup_ratio", "train.lr_warmup_ratio", 1),
            ("min_lr_ratio", "train.min_lr_ratio", 1),
            ("max_norm", "train.max_norm", 1),
        )
        for entity in ("actor", "critic")
    ),
    *(
        _alias(f"{entity}.{option}", convert=_always(reason, value=value))
        for option, value, reason in (
            ("optim", "adam", "the optimizer is AdamW"),
            ("adam.eps", "1e-8", "AdamW's epsilon is 1e-8"),
            ("lr_scheduler", "cosine_with_min_lr", "the schedule is cosine, with warmup and a floor"),
        )
        for entity in ("actor", "critic")
    ),
    _alias("ds.zero_stage", "train.zero_stage"),
    _alias("ds.adam_offload", "train.adam_offload", nargs=0),
    # Ray placement.
    *(
        _alias(
            f"{entity}.{part}",
            f"ray.{role}.num_actors",
            convert=_num_actors(entity),
            remark="num_nodes × num_gpus_per_node",
        )
        for entity, role in _ROLES.items()
        for part in ("num_nodes", "num_gpus_per_node")
    ),
    *(_alias(flag, "ray.colocate", nargs=0, convert=_colocate) for flag in _COLOCATE),
    # Checkpoints and logging.
    _alias("ckpt.load_enable", "ckpt.load_checkpoint", nargs=0),
    _alias("ckpt.max_num", "ckpt.max_ckpt_num"),
    _alias(
        "logger.wandb.key",
        "log.use_wandb",
        convert=_wandb_key,
        remark="True only; log in to wandb beforehand",
    ),
    _alias("logger.wandb.project", "log.wandb_project"),
    _alias("logger.wandb.run_name", "log.run_name"),
    _alias("logger.logging_steps", convert=_always("every step is logged", value="1")),
)
"""Every OpenRLHF 0.11 flag `rl-launch ppo` accepts; see the module docstring."""

_TOKEN_BUDGET = "micro-batches are packed to a token budget here: --train.micro_batch_tokens"
_NO_VISION = "vision-language models are not supported"
_NO_MUON = (
    "the optimizer is AdamW: Muon is not implemented in rl-learner (DeepSpeed's own Muon optimizer is not "
    "wired into its optimizer settings)"
)

UNSUPPORTED: Mapping[str, str] = {
    # Models and DeepSpeed.
    "ref.model_name_or_path": "the reference model is always the policy's initial model (--model.pretrain)",
    "ds.value_head_prefix": "a reward model here is a sequence classifier with one label, whatever its head's name",
    "ds.zpg": "DeepSpeed's ZeRO++ partition size is not an option here",
    "ds.overlap_comm": "DeepSpeed's communication overlap is not an option here",
    "ds.grad_accum_dtype": "DeepSpeed's gradient accumulation dtype is not an option here",
    "ds.deepcompile": "DeepCompile is not supported",
    "ds.enable_sleep": "there is no sleep mode for the learners",
    "ds.use_universal_ckpt": "checkpoints are DeepSpeed's own format only",
    "ds.tensor_parallel_size": "the learners are data-parallel (ZeRO) only",
    "ds.ring_attn_size": "ring attention (sequence parallelism) is not supported",
    "ds.ring_attn_head_stride": "ring attention (sequence parallelism) is not supported",
    "ds.experts_implementation": "the MoE expert kernel is not an option here",
    "ds.use_liger_kernel": "Liger kernels are not supported",
    "ds.load_in_4bit": (
        "4-bit (QLoRA) loading is not implemented: the learners load full-precision weights, and the "
        "bitsandbytes package that 4-bit loading needs is not a dependency of rl-learner"
    ),
    "ds.lora.dropout": "LoRA dropout is not an option here (--model.lora_rank, --model.lora_alpha are)",
    "actor.gradient_checkpointing_reentrant": "the reentrant variant of gradient checkpointing is not an option here",
    "actor.freeze_visual_encoder": _NO_VISION,
    "ref.offload": "the reference model is not offloaded to CPU",
    "reward.offload": "the reward model is not offloaded to CPU",
    "critic.freezing_steps": "the policy is not frozen while the critic warms up",
    "critic.save_value_network": "the critic is kept in checkpoints only, not exported",
    **{
        f"{entity}.muon.{part}": _NO_MUON
        for entity in ("actor", "critic")
        for part in ("lr", "momentum", "ns_steps", "nesterov", "no_nesterov")
    },
    "use_ms": "models and datasets are not fetched from ModelScope",
    "local_rank": "set by DeepSpeed's launcher; rl-launch starts its ranks as Ray actors",
    # vLLM.
    "vllm.sync_backend": "weights reach the engines by rl-launch's own strategies: choose one with --rollout.weight_sync (broadcast: NCCL on GPUs, gloo on CPU; shm)",
    "vllm.sync_with_ray": "weights reach the engines by rl-launch's own strategies: choose one with --rollout.weight_sync (broadcast, shm)",
    "vllm.enable_sleep": "there is no sleep mode for the engines",
    # Data.
    "data.max_len": "the lengths are separate here: --data.prompt_max_len and --rollout.generate_max_len",
    "data.disable_fast_tokenizer": "the fast tokenizer is always used",
    "data.dataloader_num_workers": "the prompt loader has no worker processes",
    "data.image_key": _NO_VISION,
    "data.max_images_per_prompt": _NO_VISION,
    # Rollout and training.
    "rollout.micro_batch_size": _TOKEN_BUDGET,
    "train.micro_batch_size": _TOKEN_BUDGET,
    "rollout.max_tokens_per_gpu": "one token budget serves every learner forward: --train.micro_batch_tokens (--train.max_tokens_per_gpu)",
    "train.num_episodes": "the length of training is --train.max_steps (one rollout batch per step)",
    "train.partial_rollout_enable": "partial rollouts are not supported (--rollout.async_train overlaps whole steps)",
    "train.full_determinism_enable": "there is no full-determinism mode",
    "train.enable_ema": "there is no EMA copy of the policy",
    "train.ema_beta": "there is no EMA copy of the policy",
    # Algorithm and reward.
    "algo.advantage.no_std_norm": (
        "there is no mean-only whitening here; without the std division use --algo.advantage.estimator "
        "dr_grpo (instead of group_norm), or turn whitening off with --algo.advantage.options.whiten false"
    ),
    # Checkpoints and logging.
    "ckpt.output_dir": "the final HF model goes to <log.output_dir>/final: give --log.output_dir",
    "ckpt.save_hf": "only the final policy is exported as an HF model (--ckpt.save_hf_model); checkpoints are DeepSpeed states",
    "ckpt.disable_ds": "checkpoints are always DeepSpeed states",
    "ckpt.max_mem": "checkpoints are limited by count only: --ckpt.max_ckpt_num",
    "ckpt.best_metric_key": "there is no best-checkpoint tracking",
    "logger.wandb.org": "not an option here; wandb reads WANDB_ENTITY from the environment",
    "logger.wandb.group": "not an option here; wandb reads WANDB_RUN_GROUP from the environment",
    "logger.tensorboard_dir": "TensorBoard events go to <log.output_dir>/tensorboard: give --log.use_tensorboard",
}
"""OpenRLHF 0.11 flags with no counterpart in `rl-launch ppo` (no dashes) -> why."""

_BY_FLAG: Mapping[str, Alias] = {alias.flag: alias for alias in ALIASES}


# --------------------------------------------------------------------------------------------
# Rewriting a command line.


@dataclasses.dataclass(frozen=True)
class _Occurrence:
    alias: Alias
    start: int
    end: int  # argv[start:end] is the flag and its values
    values: tuple[str, ...]


def _take_values(
    argv: Sequence[str], index: int, alias: Alias, inline: str | None
) -> tuple[tuple[str, ...], int]:
    """The values of the flag at argv[index] and the index after them."""
    if alias.nargs == 0:
        if inline is not None:
            raise ValueError("is a switch and takes no value")
        return (), index + 1
    if inline is not None:
        if alias.nargs not in (1, None):
            raise ValueError(f"takes {alias.nargs} values, written `--{alias.flag} A B`")
        return (inline,), index + 1
    end = index + 1
    if alias.nargs is None:
        while end < len(argv) and not argv[end].startswith("--"):
            end += 1
    else:
        end = min(index + 1 + alias.nargs, len(argv))
    values = tuple(argv[index + 1 : end])
    wanted = "one or more values" if alias.nargs is None else f"{alias.nargs} value{'s' * (alias.nargs > 1)}"
    if not values or any(value.startswith("--") for value in values) or len(values) < (alias.nargs or 1):
        raise ValueError(f"expects {wanted}")
    return values, end


def _estimator(argv: Sequence[str]) -> str | None:
    estimator = None
    for index, token in enumerate(argv):
        name, equals, inline = token.partition("=")
        if name == "--algo.advantage.estimator":
            if equals:
                estimator = inline
            elif index + 1 < len(argv):
                estimator = argv[index + 1]
    return estimator


def _tokens(pairs: Pairs) -> list[str]:
    # A value starting with "-" would read as an option to argparse (`-10,10`): keep it attached.
    tokens: list[str] = []
    for name, value in pairs:
        tokens.extend([f"--{name}={value}"] if value.startswith("-") else [f"--{name}", value])
    return tokens


def _failure(problems: list[str]) -> ValueError:
    if len(problems) == 1:
        return ValueError(problems[0])
    return ValueError("OpenRLHF flags rl-launch cannot take:\n  " + "\n  ".join(problems))


def expand_aliases(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Rewrite the OpenRLHF 0.11 flags of `argv` into `rl-launch ppo` options.

    Handles `--flag value`, `--flag=value`, store_true switches (`--algo.kl.use_loss`) and flags
    with several values (`--actor.eps_clip_low_high 0.2 0.28`). Every other argument passes
    through untouched and in place, rl-launch's own options included; a rewritten flag's options
    take its place (a value starting with "-" is written `--option=value`). Options that flags
    combine into (`--ray.colocate`, `--ray.policy.num_actors`) are written once, at the first of
    those flags. Arguments after a bare `--` are left alone.

    Returns:
        (the new argument list, one note per rewritten flag: `"<as written> → <what it became>"`).

    Raises:
        ValueError: naming each OpenRLHF flag that has no counterpart here (`UNSUPPORTED`, with
            the reason) or a value that does not (an asymmetric `--reward.clip_range`, ...), or
            a flag without its values. Several are reported in one error, one per line.
    """
    argv = list(argv)
    stop = argv.index("--") if "--" in argv else len(argv)
    problems: list[str] = []
    occurrences: list[_Occurrence] = []
    index = 0
    while index < stop:
        token = argv[index]
        name, equals, inline = token[2:].partition("=") if token.startswith("--") else ("", "", "")
        if name in UNSUPPORTED:
            problems.append(f"--{name} (OpenRLHF) is not supported by rl-launch: {UNSUPPORTED[name]}")
        elif name in _BY_FLAG:
            alias = _BY_FLAG[name]
            try:
                values, end = _take_values(argv[:stop], index, alias, inline if equals else None)
            except ValueError as error:
                problems.append(f"--{name} (OpenRLHF) {error}")
            else:
                occurrences.append(_Occurrence(alias, index, end, values))
                index = end
                continue
        index += 1

    context = Context({o.alias.flag: o.values for o in occurrences}, _estimator(argv[:stop]))
    output: list[str] = []
    notes: list[str] = []
    written: dict[tuple[str, str], str] = {}  # an emitted option -> the flag it came from
    position = 0
    for occurrence in occurrences:
        output.extend(argv[position : occurrence.start])
        position = occurrence.end
        original = argv[occurrence.start : occurrence.end]
        try:
            expansion = occurrence.alias.expand(occurrence.values, context)
        except ValueError as error:
            problems.append(f"--{occurrence.alias.flag} (OpenRLHF): {error}")
            continue
        if isinstance(expansion, str):
            notes.append(f"{shlex.join(original)} → dropped: {expansion}")
            continue
        if expansion == [(occurrence.alias.flag, ",".join(occurrence.values))]:  # already rl-launch's option
            output.extend(original)
            continue
        merged = [
            pair for pair in expansion if written.get(pair, occurrence.alias.flag) != occurrence.alias.flag
        ]
        fresh = [pair for pair in expansion if pair not in merged]
        for pair in fresh:
            written[pair] = occurrence.alias.flag
        output.extend(_tokens(fresh))
        if fresh:
            notes.append(f"{shlex.join(original)} → {shlex.join(_tokens(fresh))}")
        else:
            notes.append(f"{shlex.join(original)} → (with {shlex.join(_tokens(merged))} above)")
    output.extend(argv[position:])
    if problems:
        raise _failure(problems)
    return output, notes


# --------------------------------------------------------------------------------------------
# rl-launch's own former option names (before run format 2), on the command line, in config
# files and in the run.json of a format-1 run folder.

FORMER_CORRECTION_KEYS: tuple[str, ...] = (
    "is_correction",
    "is_correction_level",
    "is_correction_gating",
    "is_correction_bounds",
)
"""`algo.policy` keys that named the rollout correction before it became a registry entry with
its own options: now `algo.policy.correction` and `algo.policy.correction_options`."""

_OLD_DEFAULTS = {
    "is_correction_level": "token",
    "is_correction_gating": "ratio",
    "is_correction_bounds": (0.5, 5.0),
}
_FILTERS = ("seq-mask", "seq-mask-tis")  # geometric by definition, ratio-gated only


def _bounds(value: Any) -> tuple[float, float]:
    parts = value.strip("[]() ").replace(",", " ").split() if isinstance(value, str) else list(value)
    try:
        low, high = (float(part) for part in parts)
    except (TypeError, ValueError):
        raise ValueError(
            f"algo.policy.is_correction_bounds: expected two numbers (low, high), got {value!r}"
        ) from None
    return low, high


def _former_correction(former: Mapping[str, Any]) -> list[tuple[str, Any, Pairs | str]]:
    """(former key, its value, the `algo.policy` keys and values it becomes or why it is dropped).

    The rule keeps every run's weights: a correction keeps its name (every former name is a
    registry name); a level, gating or bounds equal to the former default is dropped (it is the
    default of every correction that takes it), and so is one the former correction ignored
    (none's; seq-mask's level and gating; auto's gating, which ran only when auto picked none).
    """
    kind = str(former.get("is_correction", "auto"))
    changes: list[tuple[str, Any, Pairs | str]] = []
    for key in FORMER_CORRECTION_KEYS:
        if key not in former:
            continue
        value = former[key]
        if key == "is_correction":
            changes.append((key, value, [("correction", kind)]))
            continue
        if key == "is_correction_bounds":
            value = _bounds(value)
        if kind == "none":
            changes.append((key, value, "the correction is none"))
        elif value == _OLD_DEFAULTS[key]:
            changes.append((key, value, "it is the correction's default"))
        elif key == "is_correction_level":
            if kind in _FILTERS:
                changes.append((key, value, f"{kind} is geometric by definition; the level was unused"))
            else:
                changes.append((key, value, [("correction_options.level", value)]))
        elif key == "is_correction_gating":
            if kind in (*_FILTERS, "auto"):
                changes.append((key, value, f"{kind} gates on the ratio; this gating was unused"))
            else:
                changes.append((key, value, [("correction_options.gating", value)]))
        else:
            changes.append(
                (key, value, [("correction_options.low", value[0]), ("correction_options.high", value[1])])
            )
    return changes


def migrate_former_keys(config: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """A nested configuration (a config file's, a format-1 run.json's) with `algo.policy`'s former
    correction keys (`FORMER_CORRECTION_KEYS`) rewritten; one note per former key.

        {"algo": {"policy": {"is_correction": "tis", "is_correction_bounds": [0.5, 2.0]}}}
        → {"algo": {"policy": {"correction": "tis", "correction_options": {"high": 2.0}}}}

    Options the section already gives in `correction_options` win over converted ones.

    Raises:
        ValueError: both `is_correction` and `correction`, or bounds that are not two numbers.
    """
    algo = config.get("algo")
    policy = algo.get("policy") if isinstance(algo, Mapping) else None
    if not isinstance(policy, Mapping) or not any(key in policy for key in FORMER_CORRECTION_KEYS):
        return dict(config), []
    if "is_correction" in policy and "correction" in policy:
        raise ValueError(
            "algo.policy: give correction (its former name is_correction) once, not both; "
            f"got is_correction {policy['is_correction']!r} and correction {policy['correction']!r}"
        )
    new_policy = {key: value for key, value in policy.items() if key not in FORMER_CORRECTION_KEYS}
    options: dict[str, Any] = {}
    notes = []
    for key, value, change in _former_correction(policy):
        if isinstance(change, str):
            notes.append(f"algo.policy.{key} {value!r} → dropped: {change}")
            continue
        for name, new_value in change:
            if name.startswith("correction_options."):
                options[name.partition(".")[2]] = new_value
            else:
                new_policy[name] = new_value
        notes.append(
            f"algo.policy.{key} {value!r} → " + ", ".join(f"algo.policy.{n} {v!r}" for n, v in change)
        )
    if options:
        new_policy["correction_options"] = {**options, **dict(new_policy.get("correction_options") or {})}
    return {**config, "algo": {**algo, "policy": new_policy}}, notes


def expand_former_options(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Rewrite rl-launch's former option names in a command line (`--algo.policy.is_correction
    tis --algo.policy.is_correction_bounds 0.5,2`) into today's (`--algo.policy.correction tis
    --algo.policy.correction_options.high 2.0`), in place of the first of them; one note per
    former option, as `expand_aliases` writes them. Arguments after a bare `--` are left alone.

    Raises:
        ValueError: a former option without its value, or with a value that has no counterpart.
    """
    argv = list(argv)
    stop = argv.index("--") if "--" in argv else len(argv)
    former: dict[str, str] = {}
    written: dict[str, list[str]] = {}
    kept: list[str] = []
    first = None
    index = 0
    while index < stop:
        token = argv[index]
        name, equals, inline = token[2:].partition("=") if token.startswith("--") else ("", "", "")
        key = name.removeprefix("algo.policy.")
        if name.startswith("algo.policy.") and key in FORMER_CORRECTION_KEYS:
            if equals:
                value, index = inline, index + 1
            elif index + 1 < stop and not argv[index + 1].startswith("--"):
                value, index = argv[index + 1], index + 2
            else:
                raise ValueError(f"--{name} (the former name of --algo.policy.correction*) expects a value")
            first = len(kept) if first is None else first
            former[key] = value
            written[key] = [f"--{name}", value]
            continue
        kept.append(token)
        index += 1
    if not former:
        return argv, []
    tokens: list[str] = []
    notes: list[str] = []
    for key, _value, change in _former_correction(former):
        original = shlex.join(written[key])
        if isinstance(change, str):
            notes.append(f"{original} → dropped: {change}")
            continue
        new = _tokens([(f"algo.policy.{name}", str(new_value)) for name, new_value in change])
        tokens.extend(new)
        notes.append(f"{original} → {shlex.join(new)}")
    first = first or 0
    return [*kept[:first], *tokens, *kept[first:], *argv[stop:]], notes
