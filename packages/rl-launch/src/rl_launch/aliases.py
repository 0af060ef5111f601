"""OpenRLHF 0.11's flag names, accepted by `rl-launch ppo`, `sft`, `rm`, `dpo` and `serve-rm` and
rewritten to their own options.

OpenRLHF 0.11 names its flags by owner and dot (`--algo.kl.init_coef`, `--rollout.batch_size`,
`--actor.eps_clip_low_high 0.2 0.28`, `--ckpt.load_enable`, ...): the argument lists of
`openrlhf/cli/train_ppo_ray.py`, `train_sft.py`, `train_rm.py`, `train_dpo.py` and `serve_rm.py`.
One table (`ALIASES`) serves every command: each entry names the commands it applies to, and a
flag with two meanings has two entries (`--data.max_len` is a total budget for ppo, split into
the prompt and response lengths, and `data.max_len` itself for sft). `expand_aliases(argv,
command)` rewrites a command line written with those names into the command's options before
argparse sees it, and returns one note per rewritten flag, which the CLI prints so that nothing
is translated silently:

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
- flags whose meaning is what rl-launch always does (`--ds.packing_samples`, `--actor.adam.eps 1e-8`):
  accepted and dropped, with a note; another value than rl-launch's is refused;
- flags OpenRLHF itself ignores in the run at hand (`--algo.advantage.gamma` with `group_norm`,
  which OpenRLHF runs with gamma 1): dropped, with a note saying why;
- flags that change nothing a run computes here (`--train.micro_batch_size`: micro-batches are
  packed to a token budget): dropped, with a note saying what happens instead;
- translations whose note states the assumption (`--data.max_len` split into two lengths,
  `--vllm.sync_backend nccl` → the broadcast strategy) or names the option the loop resolves
  (`--train.num_episodes`, sft's `--train.max_epochs` → `train.epochs`: steps from the data's size);
- DeepSpeed's own keys (`--ds.overlap_comm`, `--ds.zpg`, `--ds.grad_accum_dtype`), passed through
  `train.deepspeed_config`.

`UNSUPPORTED` lists OpenRLHF 0.11 flags with no counterpart here and why, for every command
without an alias for the flag (`refusals_of`); `expand_aliases` refuses them with that reason (one `ValueError` naming every such flag) instead of argparse's "unknown
option". OpenRLHF flags whose name is already an rl-launch option (`--algo.advantage.estimator`,
`--rollout.n_samples_per_prompt`, `--rollout.temperature`, `--train.max_epochs`, `--ckpt.path`,
...) pass through untouched; every OpenRLHF estimator name is registered in `rl_algos` under the
same name (`group_norm` is grpo's alias). One such name takes a second meaning in OpenRLHF:
`--reward.remote_url path.py` names a local reward function file there, which is
`--reward.function path.py` here (an http(s) URL stays as it is). `--algo.advantage.estimator
group_norm` / `rloo` / `dr_grpo` with the KL in the reward is a KL-regularised estimator there;
it is one here too, whichever spelling sets the coefficient (`--algo.kl.init_coef`,
`--algo.kl.init_kl_coef`, a config file): `rl_launch.validation.kl_in_reward_form` runs it as
`group_reward_to_go` with `algo.advantage.options.preset <name>` and prints a note saying so.

rl-launch's own former option names are rewritten the same way, with a note, by
`rl_launch.former` (a module of its own, so that resuming an old run folder does not import this
table).
"""

from __future__ import annotations

import dataclasses
import os
import shlex
from collections.abc import Callable, Mapping, Sequence

from .former import option_tokens

__all__ = [
    "ALIASES",
    "COMMANDS",
    "UNSUPPORTED",
    "Alias",
    "Context",
    "aliases_of",
    "expand_aliases",
    "refusals_of",
    "render_mapping_table",
]

Pairs = list[tuple[str, str]]
"""(our dotted option, its command-line text) pairs, in order."""


COMMANDS: tuple[str, ...] = ("ppo", "sft", "rm", "dpo", "serve-rm")
"""The `rl-launch` commands that take OpenRLHF's flags (its train_ppo_ray, train_sft, train_rm,
train_dpo and serve_rm)."""
PPO: tuple[str, ...] = ("ppo",)
SUPERVISED: tuple[str, ...] = ("sft", "rm", "dpo")
TRAINERS: tuple[str, ...] = (*PPO, *SUPERVISED)


@dataclasses.dataclass(frozen=True)
class Context:
    """What a conversion may consult besides its own values: the rest of the command line."""

    given: Mapping[str, tuple[str, ...]]
    """Every aliased OpenRLHF flag on the command line (no dashes) -> the values it was given last."""
    estimator: str | None
    """The value of `--algo.advantage.estimator` on the command line, None when it is not there."""
    command: str = "ppo"
    """The rl-launch command the line is for."""
    options: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """rl-launch's own options written on the command line (no dashes) -> their last value."""
    environment: dict[str, str] = dataclasses.field(default_factory=dict)
    """Variables a flag puts into the run's environment (`--logger.wandb.key` → WANDB_API_KEY):
    `expand_aliases` sets them in this process, whose environment the run and its actors inherit."""


Expansion = "Pairs | str | tuple[Pairs, str]"
Convert = Callable[[tuple[str, ...], Context], Expansion]
"""(values, context) -> the options to emit; a str: why nothing is emitted; or (options, what the
note should add: a split, a condition). Raises ValueError for a value that has no counterpart here."""


@dataclasses.dataclass(frozen=True)
class Alias:
    """One OpenRLHF 0.11 flag and what it becomes here, for the commands in `commands`."""

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
    commands: tuple[str, ...] = PPO
    """The rl-launch commands whose OpenRLHF counterpart has this flag with this meaning."""
    note: str = ""
    """Printed with the rewrite every time (a translation that is not a plain rename)."""
    secret: bool = False
    """Its value is a credential: notes and errors show `***` in its place."""

    def expand(self, values: tuple[str, ...], context: Context) -> Pairs | str | tuple[Pairs, str]:
        if self.convert is None:
            pairs = _rename(self, values, context)
            return (pairs, self.note) if self.note else pairs
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


def _tensor_parallel(values: tuple[str, ...], context: Context) -> Pairs | tuple[Pairs, str]:
    """--ds.tensor_parallel_size N: DeepSpeed AutoTP is not wired into the learners; the FSDP2 learners' TP is."""
    pairs = [("train.tensor_parallel_size", values[0])]
    if _int(values[0]) == 1:
        return pairs
    backend = context.options.get("train.backend")
    where = (
        "" if backend == "fsdp2" else "; it needs --train.backend fsdp2 (refused at start under deepspeed)"
    )
    return pairs, (
        "DeepSpeed AutoTP is not wired into these learners: taken as the FSDP2 learners' DTensor tensor "
        f"parallelism (q/k/v/gate/up split by columns, o/down by rows, over groups of {values[0]} "
        f"consecutive ranks that share their micro-batches){where}"
    )


# OpenRLHF sets gamma to 1.0 for these estimators, whatever the flag says; lambd is gae's alone.
_UNDISCOUNTED_ESTIMATORS = ("rloo", "reinforce_baseline", "group_norm", "dr_grpo", "flash_reinforce")


def _gamma(values: tuple[str, ...], context: Context) -> Pairs | str:
    if context.estimator in _UNDISCOUNTED_ESTIMATORS:
        return f"OpenRLHF ignores it for {context.estimator}, which it runs with gamma 1.0"
    return [("algo.advantage.options.gamma", values[0])]


def _lambd(values: tuple[str, ...], context: Context) -> Pairs | str:
    if context.estimator is not None and context.estimator != "gae":
        return f"lambda is GAE's; OpenRLHF ignores it for {context.estimator}"
    return [("algo.advantage.options.lam", values[0])]


def _unbiased_gradient(values: tuple[str, ...], context: Context) -> Pairs | str:
    # OpenRLHF caps the weight π/π_old of this gradient at 10 (KL_IS_WEIGHT_CLIP); kl_penalty's cap
    # is off unless given.
    if "algo.kl.use_loss" not in context.given:
        return "OpenRLHF uses it only for the KL in the loss (--algo.kl.use_loss)"
    return [
        ("algo.kl.loss_options.unbiased_gradient", "true"),
        ("algo.kl.loss_options.importance_weight_cap", "10"),
    ]


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
_IS_LEVEL = "algo.advantage.is_correction_level"
_IS_MODE = "algo.advantage.is_correction_mode"
_IS_GATING = "algo.advantage.is_correction_gating"
_IS_THRESHOLD = "algo.advantage.is_correction_threshold"
_CORRECTION_OPTION = "algo.policy.correction_options."
_DIVERGENCES = ("binary_kl", "tv")


def _correction_bounds(values: tuple[str, ...], divergence: bool) -> Pairs:
    """OpenRLHF's threshold `[LOW] HIGH`: one value is an upper bound only (a divergence's δ)."""
    if len(values) > 2:
        raise ValueError(f"--{_IS_THRESHOLD} takes LOW HIGH or HIGH, got {len(values)} values")
    if len(values) == 1:
        if not divergence:
            raise ValueError(
                f"--{_IS_THRESHOLD} {values[0]}: one value is an upper bound only, which a ratio "
                f"gating cannot use (its low bound is > 0); give LOW HIGH, or --{_IS_GATING} binary_kl / tv"
            )
        return [(f"{_CORRECTION_OPTION}low", "0"), (f"{_CORRECTION_OPTION}high", values[0])]
    return [(f"{_CORRECTION_OPTION}low", values[0]), (f"{_CORRECTION_OPTION}high", values[1])]


def _correction(values: tuple[str, ...], context: Context) -> Pairs:
    """The rollout correction of OpenRLHF's flags, 0.11.0's or 0.11.2's, as one choice.

    0.11.0: `--is_correction_enable` with `--is_correction_type tis|icepop|seq-mask-tis` (tis when
    absent) names the correction. 0.11.2: `--is_correction_level off|token|seq`, `--_mode mask|clip`
    and `--_gating ratio|binary_kl|tv`: clip is `tis` (a token ratio truncated to the bounds); mask
    is `mask` (units outside the bounds dropped, survivors keep their token weight), at level
    `token`, or per sequence: the geometric-mean ratio (`geometric`) with ratio gating, the mean
    divergence (`sequence`) with binary_kl / tv. Without a mode, seq and a divergence gating mask
    (the only mode they have) and token clips. `--_threshold` sets the bounds (one value: δ of a
    divergence); alone it sets the options of the automatic choice.
    """
    del values
    given = context.given
    zero_eleven_two = [flag for flag in (_IS_LEVEL, _IS_MODE, _IS_GATING) if flag in given]
    gating = given.get(_IS_GATING, ("ratio",))[0]
    if gating not in ("ratio", *_DIVERGENCES):
        raise ValueError(f"--{_IS_GATING}: OpenRLHF's choices are ratio, binary_kl, tv, got {gating!r}")
    options: Pairs = []
    if _IS_THRESHOLD in given:
        options = _correction_bounds(given[_IS_THRESHOLD], gating in _DIVERGENCES)
    if _IS_ENABLE in given or _IS_TYPE in given:
        if zero_eleven_two:
            raise ValueError(
                f"give OpenRLHF 0.11.0's --{_IS_ENABLE} / --{_IS_TYPE} or 0.11.2's --{_IS_LEVEL} / "
                f"--{_IS_MODE} / --{_IS_GATING}, not both"
            )
        if _IS_ENABLE not in given:
            raise ValueError(
                f"turns nothing on without --{_IS_ENABLE} (OpenRLHF ignores it); add that flag or drop this one"
            )
        return [("algo.policy.correction", given.get(_IS_TYPE, ("tis",))[0]), *options]
    if not zero_eleven_two:
        return options  # the threshold alone: the bounds of the automatic choice
    level = given.get(_IS_LEVEL, (None,))[0]
    if level is None:
        raise ValueError(f"turns nothing on without --{_IS_LEVEL} token or seq (OpenRLHF's default is off)")
    if level == "off":
        return [("algo.policy.correction", "none")]
    if level not in ("token", "seq"):
        raise ValueError(f"--{_IS_LEVEL}: OpenRLHF's choices are off, token, seq, got {level!r}")
    mode = given.get(_IS_MODE, ("mask" if level == "seq" or gating != "ratio" else "clip",))[0]
    if mode == "clip":
        if level == "seq" or gating != "ratio":
            raise ValueError(
                f"--{_IS_MODE} clip truncates a token's ratio: it takes --{_IS_LEVEL} token with ratio "
                f"gating, not level {level!r} with gating {gating!r} (use --{_IS_MODE} mask)"
            )
        return [("algo.policy.correction", "tis"), *options]
    if mode != "mask":
        raise ValueError(f"--{_IS_MODE}: OpenRLHF's choices are mask, clip, got {mode!r}")
    pairs: Pairs = [("algo.policy.correction", "mask")]
    if level == "seq":
        pairs.append((f"{_CORRECTION_OPTION}level", "geometric" if gating == "ratio" else "sequence"))
    if gating != "ratio":
        pairs.append((f"{_CORRECTION_OPTION}gating", gating))
    return [*pairs, *options]


_COLOCATE = {
    "train.colocate_all": "all",
    "train.colocate_actor_ref": "policy_ref",
    "train.colocate_critic_reward": "critic_reward",
}


def _colocate(values: tuple[str, ...], context: Context) -> Pairs | tuple[Pairs, str]:
    given = [value for flag, value in _COLOCATE.items() if flag in context.given]
    if "all" in given and "train.async_enable" in context.given:
        # OpenRLHF's async mode colocates only its DeepSpeed models; the engines keep their GPUs.
        pairs = ["policy_ref"]
        if {"critic.model_name_or_path", "reward.model_name_or_path"} & set(context.given):
            pairs.append("critic_reward")
        return (
            [("ray.colocate", "+".join(pairs))],
            "with --train.async_enable OpenRLHF colocates only the DeepSpeed models; the engines generate "
            "on GPUs of their own",
        )
    return [("ray.colocate", "all" if "all" in given else "+".join(given))]


_ROLES = {"actor": "policy", "critic": "critic", "ref": "ref", "reward": "reward_model"}


def _multiturn(values: tuple[str, ...], context: Context) -> Pairs:
    """OpenRLHF's multi-turn SFT reads whole conversations from --data.input_key ("input" unless
    given) and trains every assistant turn: rl-launch's data.messages_key names that column."""
    column = context.options.get("data.input_key", "input")
    return [("data.messages_key", column)]


# OpenRLHF's defaults of --<role>.num_nodes and --<role>.num_gpus_per_node, for the one a script leaves out
_OPENRLHF_NUM_NODES, _OPENRLHF_GPUS = "1", "8"


def _num_actors(entity: str, target: str | None = None) -> Convert:
    """OpenRLHF places num_nodes × num_gpus_per_node ranks of a role; rl-launch counts them
    (`target`: ppo's ray.<role>.num_actors by default)."""
    nodes_flag, gpus_flag = f"{entity}.num_nodes", f"{entity}.num_gpus_per_node"
    target = target or f"ray.{_ROLES[entity]}.num_actors"

    def convert(values: tuple[str, ...], context: Context) -> Pairs | tuple[Pairs, str]:
        nodes, gpus = context.given.get(nodes_flag), context.given.get(gpus_flag)
        pairs = [
            (target, str(_int((nodes or (_OPENRLHF_NUM_NODES,))[0]) * _int((gpus or (_OPENRLHF_GPUS,))[0])))
        ]
        if nodes is None:
            return pairs, f"--{nodes_flag} not given: OpenRLHF's default {_OPENRLHF_NUM_NODES}"
        if gpus is None:
            return pairs, f"--{gpus_flag} not given: OpenRLHF's default {_OPENRLHF_GPUS}"
        return pairs

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


def _optimizer(target: str) -> Convert:
    """`--actor.optim` / `--critic.optim` / `--optim`: OpenRLHF's adam (AdamW) or muon, to `target`."""

    def convert(values: tuple[str, ...], context: Context) -> Pairs | tuple[Pairs, str]:
        names = {"adam": "adamw", "muon": "muon"}
        if values[0] not in names:
            raise ValueError(f"OpenRLHF's choices are adam and muon, got {values[0]!r}")
        pairs = [(target, names[values[0]])]
        if values[0] == "muon":
            return pairs, (
                "under ZeRO 1-3 DeepSpeed clips Muon's orthogonalised update, not the gradient "
                "(--train.max_norm 0 turns clipping off)"
            )
        return pairs

    return convert


# DeepSpeed 0.19's Muon calls its update with 5 Newton–Schulz steps and Nesterov momentum, the
# function's defaults; its optimizer config has no key for either (OpenRLHF keeps the flags as
# placeholders and warns when they differ).
_MUON_FIXED = "DeepSpeed's Muon always uses {}; its optimizer config has no setting for it"


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


_OPENRLHF_EMA_BETA = "0.992"  # OpenRLHF's --train.ema_beta default, the beta of a bare --train.enable_ema


def _enable_ema(values: tuple[str, ...], context: Context) -> Pairs | str:
    if "train.ema_beta" in context.given:  # rl-launch's own option, passed through: it turns the EMA on
        return "--train.ema_beta, given too, turns the EMA on here"
    return [("train.ema_beta", _OPENRLHF_EMA_BETA)]


def _freezing_steps(values: tuple[str, ...], context: Context) -> Pairs:
    steps = _int(values[0])
    if steps < -1:
        raise ValueError(f"{values[0]!r} is not -1 (off) or a number of steps >= 0")
    return [("train.critic_warmup_steps", str(max(steps, 0)))]


def _best_metric_key(values: tuple[str, ...], context: Context) -> Pairs | str:
    key = values[0].strip()
    if key.lower() in ("", "none"):
        return "no best checkpoint, as without the flag (rl-launch does not pick a pass@1 metric by itself)"
    return [("ckpt.best_metric_key", key)]


def _wandb_key(values: tuple[str, ...], context: Context) -> Pairs | tuple[Pairs, str]:
    # The value is an API key or True (use the stored login); a key is never echoed back.
    key = values[0].strip()
    if key.lower() in ("true", "1"):
        return [("log.use_wandb", "true")]
    if not key:
        raise ValueError("an empty key; give the API key, or True to use the stored login (`wandb login`)")
    context.environment["WANDB_API_KEY"] = key
    return [("log.use_wandb", "true")], (
        "the key goes into the run's environment as WANDB_API_KEY; a key on a command line is visible "
        "to other users of this machine (its process list, shell history): `wandb login` or WANDB_API_KEY "
        "in the environment keep it off"
    )


def _dropped(reason: str) -> Convert:
    """A flag whose setting has no effect on what a run computes here: accepted, dropped, `reason` printed."""

    def convert(values: tuple[str, ...], context: Context) -> str:
        return reason

    return convert


def _colocated(context: Context) -> bool:
    """Whether the run is the hybrid engine (ray.colocate all); not in OpenRLHF's async mode."""
    if "train.async_enable" in context.given:
        return False
    return "train.colocate_all" in context.given or context.options.get("ray.colocate") == "all"


def _sleep(option: str, side: str) -> Convert:
    """`--vllm.enable_sleep` / `--ds.enable_sleep`: `ray.engine_sleep` / `ray.learner_offload`
    true, the hybrid engine's sleep (rl-launch's default there; OpenRLHF's is off). Without the
    hybrid engine OpenRLHF ignores them, and so do those options."""

    def convert(values: tuple[str, ...], context: Context) -> tuple[Pairs, str]:
        note = (
            f"with --ray.colocate all the {side}"
            if _colocated(context)
            else f"no effect here, as in OpenRLHF without the hybrid engine (--train.colocate_all, not "
            f"async): the {side} only where the engines share the learners' GPUs (--ray.colocate all)"
        )
        return [(option, "true")], note

    return convert


def _sync_backend(values: tuple[str, ...], context: Context) -> tuple[Pairs, str]:
    if values[0] not in ("nccl", "gloo"):
        raise ValueError(f"OpenRLHF's backends are nccl and gloo, got {values[0]!r}")
    return (
        [("rollout.weight_sync", "broadcast")],
        "the bucketed torch.distributed broadcast, over NCCL on GPUs and gloo on CPU (the device picks)",
    )


def _save_hf(values: tuple[str, ...], context: Context) -> tuple[Pairs, str]:
    return (
        [("ckpt.save_hf_model", "true")],
        "the HF model is exported once, at the end, to --ckpt.hf_output_dir; checkpoints stay DeepSpeed states",
    )


def _max_len(values: tuple[str, ...], context: Context) -> tuple[Pairs, str]:
    """PPO: OpenRLHF's total budget (prompt + response) split into this launcher's two lengths."""
    total = _int(values[0])
    new_tokens = context.given.get(
        "rollout.max_new_tokens", (context.options.get("rollout.generate_max_len"),)
    )[0]
    prompt = context.options.get("data.prompt_max_len")
    if new_tokens is not None:
        if _int(new_tokens) >= total:
            raise ValueError(f"{total} leaves no room for a prompt beside {new_tokens} generated tokens")
        if prompt is not None:
            return [], "the prompt and response lengths are given separately"
        return (
            [("data.prompt_max_len", str(total - _int(new_tokens)))],
            f"prompt + response ≤ {total}: the prompt gets what the {new_tokens} generated tokens leave",
        )
    if total < 2:
        raise ValueError(f"{total} cannot hold a prompt and a response")
    prompt_len = _int(prompt) if prompt is not None else total // 2
    if prompt_len >= total:
        raise ValueError(f"--data.prompt_max_len {prompt_len} leaves no room for a response within {total}")
    pairs = [] if prompt is not None else [("data.prompt_max_len", str(prompt_len))]
    return (
        [*pairs, ("rollout.generate_max_len", str(total - prompt_len))],
        f"prompt + response ≤ {total}: {prompt_len} for the prompt, {total - prompt_len} for the response "
        "(OpenRLHF gives each response what its own prompt leaves; here the two are fixed)",
    )


def _tensorboard_dir(values: tuple[str, ...], context: Context) -> Pairs:
    return [("log.use_tensorboard", "true"), ("log.tensorboard_dir", values[0])]


def _deepspeed_key(key: str, value: str | None = None) -> Convert:
    """A DeepSpeed config key, passed through `train.deepspeed_config` (merged into every learner's)."""
    target = f"train.deepspeed_config.{key}"

    def convert(values: tuple[str, ...], context: Context) -> Pairs:
        return [(target, values[0] if value is None else value)]

    return convert


def _rm_loss_type(values: tuple[str, ...], context: Context) -> str:
    if values[0] not in ("sigmoid", "logexpsigmoid"):
        raise ValueError(f"OpenRLHF's choices are sigmoid and logexpsigmoid, got {values[0]!r}")
    return "both are Bradley-Terry's −log σ(r_chosen − r_rejected), the loss of rl-launch rm"


def _margin_loss(values: tuple[str, ...], context: Context) -> tuple[Pairs, str]:
    pairs = [("loss.use_margin", "true")]
    if "data.margin_key" not in context.options:
        pairs.append(("data.margin_key", "margin"))
    return pairs, "the margin of each pair is read from its column, `margin` as OpenRLHF's"


def _ipo(values: tuple[str, ...], context: Context) -> Pairs:
    return [("loss.loss_type", "ipo")]


def _zero_only(reason: str) -> Convert:
    """A coefficient of a loss term rl-launch does not have: 0 (off) is accepted, anything else refused."""

    def convert(values: tuple[str, ...], context: Context) -> str:
        if _float(values[0]) != 0:
            raise ValueError(f"{reason}; only 0 (off) is accepted, got {values[0]}")
        return f"0 turns it off: {reason}"

    return convert


# --------------------------------------------------------------------------------------------
# The tables.


def _alias(
    flag: str,
    *targets: str,
    nargs: int | None = 1,
    convert: Convert | None = None,
    remark: str = "",
    commands: tuple[str, ...] = PPO,
    note: str = "",
    secret: bool = False,
) -> Alias:
    return Alias(flag, targets, nargs, convert, remark, commands, note, secret)


_PACKING = "sequences are packed into micro-batches of at most --train.micro_batch_tokens tokens"
_MICRO_BATCH = (
    "micro-batches are packed to a token budget here (--train.micro_batch_tokens, OpenRLHF's "
    "--train.max_tokens_per_gpu), so a count of samples per GPU does not apply; the update is the same"
)
_SUPERVISED_ADAM = (
    ("adam.lr", "train.actor_learning_rate", 1),
    ("adam.betas", "train.adam_betas", 2),
    ("adam.weight_decay", "train.weight_decay", 1),
    ("lr_warmup_ratio", "train.lr_warmup_ratio", 1),
    ("min_lr_ratio", "train.min_lr_ratio", 1),
    ("max_norm", "train.max_norm", 1),
)

ALIASES: tuple[Alias, ...] = (
    # Models.
    _alias("actor.model_name_or_path", "model.pretrain"),
    _alias("model.model_name_or_path", "model.pretrain", commands=SUPERVISED),
    _alias("critic.model_name_or_path", "model.critic_pretrain"),
    _alias("reward.model_name_or_path", "model.reward_pretrain"),
    _alias("reward.model_name_or_path", "reward_pretrain", commands=("serve-rm",)),
    _alias(
        "reward.remote_url",
        "reward.function",
        "reward.remote_url",
        convert=_remote_url,
        remark="a `.py` file is a local reward function (`reward.function`); a URL stays `reward.remote_url`",
    ),
    _alias("ds.param_dtype", "model.dtype", commands=TRAINERS),
    _alias("ds.param_dtype", "dtype", commands=("serve-rm",)),
    _alias("ds.attn_implementation", "model.attn_implementation", commands=TRAINERS),
    _alias(
        "ds.ring_attn_size",
        "model.sequence_parallel_size",
        commands=TRAINERS,
        remark="Ulysses, an all-to-all over heads, instead of ring attention: the same split of each micro-batch",
        note=(
            "sequence parallelism here is Ulysses (two all-to-alls around the packed attention) rather "
            "than ring attention: each of the N ranks of a group holds 1/N of every micro-batch, exactly; "
            "the query and key-value head counts must divide by N"
        ),
    ),
    _alias(
        "ds.ring_attn_head_stride",
        commands=TRAINERS,
        convert=_dropped(
            "ignored: it tunes ring attention's head chunks; Ulysses sequence parallelism "
            "(--model.sequence_parallel_size) exchanges all heads in one all-to-all"
        ),
    ),
    _alias("ds.attn_implementation", "attn_implementation", commands=("serve-rm",)),
    _alias("actor.gradient_checkpointing_enable", "model.gradient_checkpointing", nargs=0),
    _alias("actor.freeze_visual_encoder", "model.freeze_visual_encoder", nargs=0),
    _alias(
        "model.gradient_checkpointing_enable", "model.gradient_checkpointing", nargs=0, commands=SUPERVISED
    ),
    _alias(
        "ds.lora.rank",
        "model.lora_rank",
        commands=TRAINERS,
    ),
    _alias("ds.lora.alpha", "model.lora_alpha", commands=TRAINERS),
    _alias("ds.lora.dropout", "model.lora_dropout", commands=TRAINERS),
    _alias("ds.lora.target_modules", "model.target_modules", nargs=None, commands=TRAINERS),
    # Data and evaluation.
    _alias("data.prompt_dataset", "data.prompt_data"),
    _alias("eval.dataset", "data.eval_dataset"),
    _alias("eval.steps", "eval.eval_steps"),
    _alias(
        "eval.steps",
        commands=SUPERVISED,
        convert=_always("sft, rm and dpo have no evaluation set", value="-1"),
    ),
    _alias("data.prompt_probs", "data.prompt_probs"),
    _alias("data.image_key", "data.image_key"),
    _alias("data.max_images_per_prompt", "data.max_images_per_prompt"),
    _alias("data.prompt_split", "data.prompt_split"),
    _alias("eval.split", "eval.split"),
    _alias(
        "data.input_template",
        "data.input_template",
        remark="used instead of the chat template; OpenRLHF ignores it when --data.apply_chat_template is given",
    ),
    _alias(
        "data.max_len",
        "data.prompt_max_len",
        "rollout.generate_max_len",
        convert=_max_len,
        remark="OpenRLHF's total is split: the prompt gets what --rollout.max_new_tokens leaves, else half",
    ),
    _alias("data.max_len", "max_len", commands=("serve-rm",)),
    _alias(
        "data.dataloader_num_workers",
        convert=_dropped("the data is read in the driver; worker processes would not change what is trained"),
        commands=TRAINERS,
    ),
    # Rollout.
    _alias("rollout.batch_size", "rollout.rollout_batch_size"),
    _alias("rollout.max_new_tokens", "rollout.generate_max_len"),
    _alias(
        "rollout.vllm_generate_batch_size",
        "rollout.generate_batch_size",
        remark="prompts per sampling round; with --rollout.streaming true the surplus groups stay in flight "
        "for the next steps, as OpenRLHF keeps them; without streaming the surplus accepted groups are dropped, "
        "so a value above the batch needs dynamic filtering there",
    ),
    _alias("vllm.num_engines", "rollout.num_engines"),
    _alias("vllm.tensor_parallel_size", "rollout.tensor_parallel_size"),
    _alias("vllm.gpu_memory_utilization", "rollout.gpu_memory_utilization"),
    _alias("vllm.enforce_eager", "rollout.enforce_eager", nargs=0),
    _alias("vllm.enable_prefix_caching", "rollout.engine_options.enable_prefix_caching", nargs=0),
    _alias(
        "vllm.enable_sleep",
        "ray.engine_sleep",
        nargs=0,
        convert=_sleep("ray.engine_sleep", "engines sleep after generation and wake for the weight sync"),
        remark="rl-launch's default with --ray.colocate all (false keeps the engines resident); no effect "
        "without it, as in OpenRLHF",
    ),
    _alias(
        "ds.enable_sleep",
        "ray.learner_offload",
        nargs=0,
        convert=_sleep(
            "ray.learner_offload", "learners offload their DeepSpeed states while the engines generate"
        ),
        remark="rl-launch's default with --ray.colocate all (false keeps the states on the GPU); no effect "
        "without it, as in OpenRLHF",
    ),
    _alias(
        "vllm.sync_backend",
        "rollout.weight_sync",
        convert=_sync_backend,
        remark="nccl / gloo: the broadcast strategy, which picks NCCL on GPUs and gloo on CPU",
    ),
    _alias("train.async_enable", "rollout.async_train", nargs=0),
    _alias("train.async_queue_size", "rollout.async_depth"),
    _alias("train.partial_rollout_enable", "rollout.partial_rollout", nargs=0),
    _alias("algo.dynamic_filtering_enable", "rollout.dynamic_filtering", nargs=0),
    _alias(
        "train.agent_func_path",
        "rollout.agent_func_path",
        remark="runs rollout.executor multi_turn; its options: --rollout.executor_options.max_turns, ...",
    ),
    _alias("algo.dynamic_filtering_range", "rollout.dynamic_filtering_reward_range", nargs=2),
    _alias("rollout.micro_batch_size", convert=_dropped(_MICRO_BATCH)),
    _alias(
        "rollout.max_tokens_per_gpu",
        convert=_dropped(
            "the learners' forwards use the training token budget, --train.micro_batch_tokens "
            "(OpenRLHF's --train.max_tokens_per_gpu)"
        ),
    ),
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
        "normalize_reward",
        nargs=0,
        commands=("serve-rm",),
        remark="(r − mean) / std with the statistics stored in the reward model's config",
    ),
    _alias(
        "reward.normalize_enable",
        "reward.normalize",
        nargs=0,
        convert=_reward_normalize,
        remark="the reward model's score by its config.json's mean and std; dropped without a reward model",
    ),
    # Advantage estimator: the same option here. group_norm / rloo / dr_grpo with the KL in the
    # reward become group_reward_to_go once the config is decoded, whichever spelling gave the KL
    # coefficient (`rl_launch.validation.kl_in_reward_form`, with a note).
    _alias(
        "algo.advantage.estimator",
        "algo.advantage.estimator",
        remark="group_norm / rloo / dr_grpo with the KL in the reward run as group_reward_to_go with that "
        "preset, with a note, however the KL coefficient is spelled",
    ),
    _alias(
        "algo.advantage.gamma",
        "algo.advantage.options.gamma",
        convert=_gamma,
        remark="dropped for rloo, reinforce_baseline, group_norm, dr_grpo, flash_reinforce, which OpenRLHF runs with gamma 1",
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
    _alias(
        "algo.kl.unbiased_gradient",
        "algo.kl.loss_options.unbiased_gradient",
        "algo.kl.loss_options.importance_weight_cap",
        nargs=0,
        convert=_unbiased_gradient,
        remark="with OpenRLHF's cap of 10 on π/π_old; dropped without --algo.kl.use_loss",
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
    *(
        _alias(
            flag,
            "algo.policy.correction",
            "algo.policy.correction_options",
            nargs=nargs,
            convert=_correction,
            remark=remark,
        )
        for flag, nargs, remark in (
            (
                _IS_ENABLE,
                0,
                "OpenRLHF 0.11.0: with --algo.advantage.is_correction_type (default tis, as OpenRLHF)",
            ),
            (_IS_TYPE, 1, "tis, icepop, seq-mask-tis"),
            (
                _IS_LEVEL,
                1,
                "OpenRLHF 0.11.2: off → none; token; seq → level geometric (ratio gating) or sequence (binary_kl, tv)",
            ),
            (
                _IS_MODE,
                1,
                "clip → tis (token level, ratio gating); mask → mask (default for seq and binary_kl / tv)",
            ),
            (_IS_GATING, 1, "ratio, binary_kl, tv → correction_options.gating"),
            (
                _IS_THRESHOLD,
                None,
                "LOW HIGH → correction_options.low, .high; one value: δ of binary_kl / tv (low 0)",
            ),
        )
    ),
    _alias("critic.value_clip", "algo.value_clip"),
    # Training.
    _alias("train.batch_size", "train.train_batch_size", commands=TRAINERS),
    _alias("batch_size", "batch_size", commands=("serve-rm",)),
    _alias("train.max_tokens_per_gpu", "train.micro_batch_tokens"),
    _alias("train.micro_batch_size", convert=_dropped(_MICRO_BATCH), commands=TRAINERS),
    _alias("train.dynamic_batch_enable", nargs=0, convert=_always(_PACKING)),
    _alias("ds.packing_samples", nargs=0, convert=_always(_PACKING), commands=TRAINERS),
    _alias(
        "ds.packing_samples",
        nargs=0,
        convert=_dropped("the server scores each request's queries in batches of --batch_size"),
        commands=("serve-rm",),
    ),
    _alias(
        "train.num_episodes",
        "train.num_episodes",
        note="the loop sets train.max_steps = episodes × ⌊prompts / rollout.rollout_batch_size⌋ once the prompts are loaded",
        remark="train.max_steps = episodes × ⌊prompts / rollout_batch_size⌋, set once the prompts are loaded",
    ),
    _alias(
        "train.max_epochs",
        "train.epochs",
        commands=SUPERVISED,
        note="the loop sets train.max_steps = ⌈epochs × rows / train_batch_size⌉ once the data is loaded",
        remark="passes over the data: train.max_steps = ⌈epochs × rows / train_batch_size⌉, set once the data is loaded",
    ),
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
        for option, target, nargs in _SUPERVISED_ADAM[1:]
        for entity in ("actor", "critic")
    ),
    *(_alias(option, target, nargs=nargs, commands=SUPERVISED) for option, target, nargs in _SUPERVISED_ADAM),
    *(
        _alias(f"{entity}.{option}", convert=_always(reason, value=value))
        for option, value, reason in (
            ("adam.eps", "1e-8", "AdamW's epsilon is 1e-8"),
            ("lr_scheduler", "cosine_with_min_lr", "the schedule is cosine, with warmup and a floor"),
        )
        for entity in ("actor", "critic")
    ),
    *(
        _alias(option, convert=_always(reason, value=value), commands=SUPERVISED)
        for option, value, reason in (
            ("adam.eps", "1e-8", "AdamW's epsilon is 1e-8"),
            ("lr_scheduler", "cosine_with_min_lr", "the schedule is cosine, with warmup and a floor"),
        )
    ),
    # Muon (DeepSpeed's), per role as in OpenRLHF; sft / rm / dpo's flags are the trained model's.
    *(
        alias
        for prefix, role, commands in (
            ("actor.", "actor", PPO),
            ("critic.", "critic", PPO),
            ("", "actor", SUPERVISED),
        )
        for alias in (
            _alias(
                f"{prefix}optim",
                f"train.{role}_optimizer",
                convert=_optimizer(f"train.{role}_optimizer"),
                commands=commands,
                remark="adam → adamw; muon: DeepSpeed's Muon on the hidden matrices, AdamW on the rest",
            ),
            _alias(f"{prefix}muon.lr", f"train.{role}_muon_learning_rate", commands=commands),
            _alias(
                f"{prefix}muon.ns_steps",
                convert=_always(_MUON_FIXED.format("5 Newton–Schulz steps"), value="5"),
                commands=commands,
            ),
            _alias(
                f"{prefix}muon.nesterov",
                nargs=0,
                convert=_always(_MUON_FIXED.format("Nesterov momentum")),
                commands=commands,
            ),
        )
    ),
    *(
        _alias(
            f"{entity}.muon.momentum",
            "train.muon_momentum",
            convert=_shared("muon.momentum", "train.muon_momentum"),
            remark="one value for both roles",
        )
        for entity in ("actor", "critic")
    ),
    _alias("muon.momentum", "train.muon_momentum", commands=SUPERVISED),
    _alias("ds.zero_stage", "train.zero_stage", commands=TRAINERS),
    _alias("ds.adam_offload", "train.adam_offload", nargs=0, commands=TRAINERS),
    _alias(
        "ds.tensor_parallel_size",
        "train.tensor_parallel_size",
        convert=_tensor_parallel,
        commands=TRAINERS,
        remark="DTensor tensor parallelism of the FSDP2 learners (--train.backend fsdp2), not DeepSpeed AutoTP",
    ),
    # DeepSpeed config keys, passed through (merged into the config every learner builds).
    _alias(
        "ds.overlap_comm",
        "train.deepspeed_config.zero_optimization.overlap_comm",
        nargs=0,
        convert=_deepspeed_key("zero_optimization.overlap_comm", "true"),
        commands=TRAINERS,
    ),
    _alias(
        "ds.zpg",
        "train.deepspeed_config.zero_optimization.zero_hpz_partition_size",
        convert=_deepspeed_key("zero_optimization.zero_hpz_partition_size"),
        commands=TRAINERS,
    ),
    _alias(
        "ds.grad_accum_dtype",
        "train.deepspeed_config.data_types.grad_accum_dtype",
        convert=_deepspeed_key("data_types.grad_accum_dtype"),
        commands=TRAINERS,
    ),
    _alias(
        "local_rank",
        convert=_dropped("set by DeepSpeed's launcher; rl-launch starts its own ranks"),
        commands=TRAINERS,
    ),
    _alias(
        "ref.offload",
        "ray.ref.offload",
        nargs=0,
        remark="ZeRO-3 on GPUs, as in OpenRLHF; elsewhere a no-op said at start-up",
    ),
    _alias(
        "reward.offload",
        "ray.reward_model.offload",
        nargs=0,
        remark="ZeRO-3 on GPUs, as in OpenRLHF; elsewhere a no-op said at start-up",
    ),
    # Training.
    _alias(
        "train.enable_ema",
        "train.ema_beta",
        nargs=0,
        convert=_enable_ema,
        remark="beta 0.992 unless --train.ema_beta; the EMA goes to <log.output_dir>/final_ema, "
        "final stays the policy (OpenRLHF exports the EMA in its place)",
    ),
    _alias(
        "train.ema_beta",
        "train.ema_beta",
        remark="rl-launch's own option: it turns the EMA on by itself (OpenRLHF also needs --train.enable_ema)",
    ),
    _alias(
        "critic.freezing_steps",
        "train.critic_warmup_steps",
        convert=_freezing_steps,
        remark="-1 (OpenRLHF's off) becomes 0",
    ),
    # Ray placement.
    *(
        _alias(
            f"{entity}.{part}",
            f"ray.{role}.num_actors",
            convert=_num_actors(entity),
            remark="num_nodes × num_gpus_per_node; OpenRLHF's 1 node, 8 GPUs for the one not given",
        )
        for entity, role in _ROLES.items()
        for part in ("num_nodes", "num_gpus_per_node")
    ),
    *(
        _alias(
            f"actor.{part}",
            "ray.learner.num_actors",
            convert=_num_actors("actor", "ray.learner.num_actors"),
            remark="num_nodes × num_gpus_per_node: the trained model's Ray ranks; OpenRLHF's 1 node, 8 GPUs for the one not given",
            commands=SUPERVISED,
        )
        for part in ("num_nodes", "num_gpus_per_node")
    ),
    *(_alias(flag, "ray.colocate", nargs=0, convert=_colocate) for flag in _COLOCATE),
    _alias("model.pretrain_mode_enable", "data.pretrain_mode", nargs=0, commands=("sft",)),
    _alias("data.dataset_probs", "data.dataset_probs", commands=SUPERVISED),
    _alias("data.dataset_split", "data.dataset_split", commands=SUPERVISED),
    _alias(
        "data.multiturn",
        "data.messages_key",
        nargs=0,
        convert=_multiturn,
        commands=("sft",),
        remark="the conversations' column: --data.input_key (OpenRLHF's default input)",
    ),
    # Supervised losses (OpenRLHF's model.* flags of train_rm / train_dpo).
    _alias("model.beta", "loss.beta", commands=("dpo",)),
    _alias(
        "model.aux_loss_coef",
        "loss.aux_loss_coef",
        commands=SUPERVISED,
        remark="the MoE load-balancing loss of the trained model (Mixtral, Qwen2-MoE, ...)",
    ),
    _alias("model.ipo_enable", "loss.loss_type", nargs=0, convert=_ipo, commands=("dpo",), remark="→ ipo"),
    _alias("model.label_smoothing", "loss.label_smoothing", commands=("dpo",)),
    _alias(
        "model.nll_loss_coef",
        convert=_zero_only("there is no NLL term beside the DPO loss"),
        commands=("dpo",),
    ),
    _alias(
        "model.margin_loss_enable",
        "loss.use_margin",
        "data.margin_key",
        nargs=0,
        convert=_margin_loss,
        commands=("rm",),
        remark="the column `margin` unless --data.margin_key is given",
    ),
    _alias(
        "model.loss_type",
        convert=_rm_loss_type,
        commands=("rm",),
        remark="sigmoid and logexpsigmoid are the same loss",
    ),
    # Checkpoints and logging.
    _alias(
        "ckpt.output_dir",
        "ckpt.hf_output_dir",
        commands=TRAINERS,
        remark="where the final HF model goes (default <log.output_dir>/final)",
    ),
    _alias("ckpt.save_hf", "ckpt.save_hf_model", nargs=0, convert=_save_hf, commands=TRAINERS),
    _alias("ckpt.load_enable", "ckpt.load_checkpoint", nargs=0, commands=TRAINERS),
    _alias("ckpt.max_num", "ckpt.max_ckpt_num", commands=TRAINERS),
    _alias(
        "ckpt.best_metric_key",
        "ckpt.best_metric_key",
        convert=_best_metric_key,
        remark="rl-launch's metric names (eval/pass@1, reward/mean); none or empty: off",
    ),
    _alias(
        "logger.wandb.key",
        "log.use_wandb",
        convert=_wandb_key,
        commands=TRAINERS,
        remark="True: the stored login; a key: WANDB_API_KEY of the run (visible to other users of the machine)",
        secret=True,
    ),
    _alias("logger.wandb.project", "log.wandb_project", commands=TRAINERS),
    _alias("logger.wandb.run_name", "log.run_name", commands=TRAINERS),
    _alias("logger.wandb.org", "log.wandb_entity", commands=TRAINERS),
    _alias("logger.wandb.group", "log.wandb_group", commands=TRAINERS),
    _alias(
        "logger.tensorboard_dir",
        "log.use_tensorboard",
        "log.tensorboard_dir",
        convert=_tensorboard_dir,
        commands=TRAINERS,
    ),
    _alias("logger.logging_steps", convert=_always("every step is logged", value="1"), commands=TRAINERS),
)
"""Every OpenRLHF 0.11 flag the commands accept, each entry for the commands it names (a flag
may have one entry per meaning: `--data.max_len` is a total budget for ppo and the same
`data.max_len` for sft); see the module docstring."""

_NO_VISION = (
    "sft, rm and dpo read text only; vision-language models train with rl-launch ppo "
    "(--data.image_key, --data.max_images_per_prompt, --actor.freeze_visual_encoder)"
)
_NO_NESTEROV = (
    "DeepSpeed's Muon always uses Nesterov momentum: its update runs with nesterov=True and its "
    "optimizer config has no key to turn it off"
)
_SEQUENCE_PARALLEL = (
    "serve-rm runs its model in one process, and sequence parallelism splits a micro-batch over "
    "several ranks; rl-launch ppo, sft, rm and dpo take --ds.ring_attn_size as --model.sequence_parallel_size"
)

UNSUPPORTED: Mapping[str, str] = {
    # Models and DeepSpeed.
    "ref.model_name_or_path": "the reference model is always the policy's initial model (--model.pretrain)",
    "ds.value_head_prefix": "a reward model here is a sequence classifier with one label, whatever its head's name",
    "ds.deepcompile": "DeepCompile is not supported",
    "ds.use_universal_ckpt": "checkpoints are DeepSpeed's own format only",
    "ds.ring_attn_size": _SEQUENCE_PARALLEL,
    "ds.ring_attn_head_stride": _SEQUENCE_PARALLEL,
    "ds.experts_implementation": "the MoE expert kernel is not an option here (transformers picks it)",
    "ds.use_liger_kernel": "Liger kernels are not supported",
    "ds.load_in_4bit": (
        "QLoRA (a 4-bit base under the LoRA adapters) is not implemented: the learners load the base in "
        "full precision (fp32 on CPU, bf16 on GPUs), and 4-bit loading (transformers' BitsAndBytesConfig) "
        "needs the bitsandbytes package on every device, which rl-learner does not depend on and the "
        "project's CPU environment does not hold (import bitsandbytes fails there, so its CPU backend was "
        "not tried); the engines would also have to load the same 4-bit base to serve adapter syncs. "
        "LoRA on the full-precision base runs: --model.lora_rank, each sync sending the adapter only "
        "(--model.lora_sync adapter)"
    ),
    "actor.gradient_checkpointing_reentrant": "the reentrant variant of gradient checkpointing is not an option here",
    "model.gradient_checkpointing_reentrant": "the reentrant variant of gradient checkpointing is not an option here",
    "actor.freeze_visual_encoder": _NO_VISION,
    "model.aux_loss_coef": (
        "it is the flag of OpenRLHF's sft, rm and dpo; rl-launch ppo's policy takes OpenRLHF's "
        "--actor.aux_loss_coef (→ --algo.policy.aux_loss_coef)"
    ),
    "critic.save_value_network": "the critic is kept in checkpoints only, not exported",
    **{f"{prefix}muon.no_nesterov": _NO_NESTEROV for prefix in ("actor.", "critic.", "")},
    "model.compute_fp32_loss_enable": "not an option here: the reward model's loss is computed from its scores as they come",
    "use_ms": "models and datasets are not fetched from ModelScope",
    # vLLM.
    "vllm.sync_with_ray": "weights reach the engines by rl-launch's own strategies: choose one with --rollout.weight_sync (broadcast, shm, file)",
    # Data.
    "data.disable_fast_tokenizer": "the fast tokenizer is always used",
    "data.input_template": (
        "sft, rm and dpo render rows with the chat template, or as plain text with "
        "--data.apply_chat_template false; there is no template string"
    ),
    "eval.dataset": "sft, rm and dpo have no evaluation set (ppo's is --data.eval_dataset)",
    "eval.split": "sft, rm and dpo have no evaluation set (ppo's is --data.eval_dataset)",
    "data.image_key": _NO_VISION,
    "data.max_images_per_prompt": _NO_VISION,
    "data.tokenizer_chat_template": "the tokenizer's own chat template is used; edit its tokenizer_config.json to change it",
    "data.dataset_probs": "ppo mixes its prompt datasets with --data.prompt_probs; serve-rm reads no dataset",
    "data.dataset_split": "ppo's split is --data.prompt_split; serve-rm reads no dataset",
    # Rollout and training.
    "train.full_determinism_enable": "there is no full-determinism mode",
    # Algorithm and reward.
    "algo.advantage.no_std_norm": (
        "there is no mean-only whitening here; without the std division use --algo.advantage.estimator "
        "dr_grpo (instead of group_norm), or turn whitening off with --algo.advantage.options.whiten false"
    ),
    # Checkpoints and logging.
    "ckpt.disable_ds": "checkpoints are always DeepSpeed states",
    "ckpt.max_mem": "checkpoints are limited by count only: --ckpt.max_ckpt_num",
}
"""OpenRLHF 0.11 flags with no counterpart here (no dashes) -> why; refused by every command that
has no `ALIASES` entry for the flag."""


def aliases_of(command: str) -> dict[str, Alias]:
    """The OpenRLHF flags `rl-launch <command>` accepts (no dashes) -> their alias."""
    if command not in COMMANDS:
        raise ValueError(f"command: {command!r} is not one of {', '.join(COMMANDS)}")
    return {alias.flag: alias for alias in ALIASES if command in alias.commands}


def refusals_of(command: str) -> dict[str, str]:
    """The OpenRLHF flags `rl-launch <command>` refuses (no dashes) -> why: `UNSUPPORTED` less the
    flags the command has an alias for."""
    accepted = aliases_of(command)
    return {flag: reason for flag, reason in UNSUPPORTED.items() if flag not in accepted}


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


def _own_options(argv: Sequence[str], flags: Mapping[str, Alias]) -> dict[str, str]:
    """rl-launch's own options written in `argv` (not OpenRLHF flags) -> their last value."""
    options: dict[str, str] = {}
    for index, token in enumerate(argv):
        if not token.startswith("--"):
            continue
        name, equals, inline = token[2:].partition("=")
        if name in flags:
            continue
        if equals:
            options[name] = inline
        elif index + 1 < len(argv) and not argv[index + 1].startswith("--"):
            options[name] = argv[index + 1]
        else:
            options[name] = "true"
    return options


def _failure(problems: list[str]) -> ValueError:
    if len(problems) == 1:
        return ValueError(problems[0])
    return ValueError("OpenRLHF flags rl-launch cannot take:\n  " + "\n  ".join(problems))


def _scan(argv: list[str], flags: dict, refused: dict) -> tuple[list[_Occurrence], list[str]]:
    """The OpenRLHF flags of `argv` with their values, and a problem per refused or malformed one."""
    problems: list[str] = []
    occurrences: list[_Occurrence] = []
    index = 0
    while index < len(argv):
        token = argv[index]
        name, equals, inline = token[2:].partition("=") if token.startswith("--") else ("", "", "")
        if name in refused:
            problems.append(f"--{name} (OpenRLHF) is not supported by rl-launch: {refused[name]}")
        elif name in flags:
            alias = flags[name]
            try:
                values, end = _take_values(argv, index, alias, inline if equals else None)
            except ValueError as error:
                problems.append(f"--{name} (OpenRLHF) {error}")
            else:
                occurrences.append(_Occurrence(alias, index, end, values))
                index = end
                continue
        index += 1
    return occurrences, problems


def expand_aliases(argv: Sequence[str], command: str = "ppo") -> tuple[list[str], list[str]]:
    """Rewrite the OpenRLHF 0.11 flags of `argv` into `rl-launch <command>` options (`aliases_of`).

    Handles `--flag value`, `--flag=value`, store_true switches (`--algo.kl.use_loss`) and flags
    with several values (`--actor.eps_clip_low_high 0.2 0.28`). Every other argument passes
    through untouched and in place, rl-launch's own options included; a rewritten flag's options
    take its place (a value starting with "-" is written `--option=value`). Options that flags
    combine into (`--ray.colocate`, `--ray.policy.num_actors`) are written once, at the first of
    those flags. Arguments after a bare `--` are left alone.

    Variables a flag puts into the run's environment (`--logger.wandb.key <key>` →
    WANDB_API_KEY) are set in this process's environment, which the run and its actors inherit; a
    secret value is written `***` in the notes.

    Returns:
        (the new argument list, one note per rewritten flag: `"<as written> → <what it became>"`,
        with what a translation adds after a colon, or `"<as written> → dropped: <why>"`).

    Raises:
        ValueError: naming each OpenRLHF flag that has no counterpart here (`UNSUPPORTED`, with
            the reason) or a value that does not (an asymmetric `--reward.clip_range`, ...), or
            a flag without its values. Several are reported in one error, one per line.
    """
    argv = list(argv)
    flags, refused = aliases_of(command), refusals_of(command)
    stop = argv.index("--") if "--" in argv else len(argv)
    occurrences, problems = _scan(argv[:stop], flags, refused)
    options = _own_options(argv[:stop], flags)
    given = {o.alias.flag: o.values for o in occurrences}
    context = Context(
        given,
        # the estimator flag has the same name here: one of the command's own options, or an alias
        # where a command has one
        given.get("algo.advantage.estimator", (options.get("algo.advantage.estimator"),))[0],
        command=command,
        options=options,
    )
    output: list[str] = []
    notes: list[str] = []
    written: dict[tuple[str, str], str] = {}  # an emitted option -> the flag it came from
    position = 0
    for occurrence in occurrences:
        output.extend(argv[position : occurrence.start])
        position = occurrence.end
        original = argv[occurrence.start : occurrence.end]
        if occurrence.alias.secret:
            original = [argv[occurrence.start].partition("=")[0], "***"]
        try:
            expansion = occurrence.alias.expand(occurrence.values, context)
        except ValueError as error:
            problems.append(f"--{occurrence.alias.flag} (OpenRLHF): {error}")
            continue
        if isinstance(expansion, str):
            notes.append(f"{shlex.join(original)} → dropped: {expansion}")
            continue
        expansion, why = expansion if isinstance(expansion, tuple) else (expansion, "")
        if not expansion:
            notes.append(f"{shlex.join(original)} → dropped: {why}")
            continue
        if expansion == [(occurrence.alias.flag, ",".join(occurrence.values))]:  # already rl-launch's option
            output.extend(original)
            if why:
                notes.append(f"{shlex.join(original)} → {shlex.join(original)}: {why}")
            continue
        merged = [
            pair for pair in expansion if written.get(pair, occurrence.alias.flag) != occurrence.alias.flag
        ]
        fresh = [pair for pair in expansion if pair not in merged]
        for pair in fresh:
            written[pair] = occurrence.alias.flag
        output.extend(option_tokens(fresh))
        if fresh:
            notes.append(
                f"{shlex.join(original)} → {shlex.join(option_tokens(fresh))}" + (f": {why}" if why else "")
            )
        else:
            notes.append(f"{shlex.join(original)} → (with {shlex.join(option_tokens(merged))} above)")
    output.extend(argv[position:])
    if problems:
        raise _failure(problems)
    os.environ.update(context.environment)
    return output, notes


# --------------------------------------------------------------------------------------------
# The README's mapping table, rendered from the tables above (the one source).


def _status(alias: Alias) -> str:
    if not alias.targets:
        return "accepted, dropped with a note"
    if alias.targets == (alias.flag,) and not alias.note:
        return "same name"
    if alias.convert is None and not alias.note:
        return "renamed"
    return "translated"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render_mapping_table() -> str:
    """The markdown table of every OpenRLHF flag in `ALIASES` and `UNSUPPORTED`: the flag, the
    commands it applies to, what it becomes here (or why it is refused) and its status; one row
    per flag and meaning, sorted by flag. packages/rl-launch/README.md holds it verbatim."""
    rows = []
    for alias in ALIASES:
        targets = ", ".join(f"`--{target}`" for target in alias.targets) or "—"
        what = f"{targets} ({alias.remark})" if alias.remark else targets
        rows.append((alias.flag, ", ".join(alias.commands), what, _status(alias)))
    for flag, reason in UNSUPPORTED.items():
        commands = [command for command in COMMANDS if flag not in aliases_of(command)]
        scope = "all" if len(commands) == len(COMMANDS) else ", ".join(commands)
        rows.append((flag, scope, reason, "refused"))
    lines = ["| OpenRLHF flag | commands | rl-launch | status |", "| --- | --- | --- | --- |"]
    for flag, scope, what, status in sorted(rows, key=lambda row: (row[0], row[3] == "refused", row[1])):
        lines.append(f"| `--{flag}` | {scope} | {_cell(what)} | {status} |")
    return "\n".join(lines) + "\n"
