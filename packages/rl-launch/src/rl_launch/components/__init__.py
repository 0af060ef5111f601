"""The components of `rl-launch ppo`: each found by name in a registry, each given its own options.

| kind                | registry                          | name in the config        | its options, verbatim     |
|---------------------|-----------------------------------|---------------------------|---------------------------|
| advantage estimator | `rl_algos.ADVANTAGE_ESTIMATORS`   | `algo.advantage.estimator`| `algo.advantage.options`  |
| policy loss         | `rl_algos.POLICY_LOSSES`          | `algo.policy.loss`        | `algo.policy.options`     |
| rollout correction  | `rl_algos.CORRECTIONS`            | `algo.policy.correction`  | `algo.policy.correction_options` |
| KL in the reward    | `rl_algos.KL_ESTIMATORS`          | `algo.kl.reward_estimator`| `algo.kl.reward_options`  |
| KL in the loss      | `rl_algos.KL_ESTIMATORS`          | `algo.kl.loss_estimator`  | `algo.kl.loss_options`    |
| reward function     | `REWARDS`                         | `reward.function`         | the function's own file   |
| rollout engine      | `ENGINES`                         | `rollout.engine`          | `rollout.engine_options`  |
| rollout executor    | `EXECUTORS`                       | `rollout.executor`        | `rollout.executor_options`|
| weight sync         | `SYNC_STRATEGIES`                 | `rollout.weight_sync`     |                           |

Each kind is one module of this package holding a `ComponentKind` (`base.py`): where a config
names it, what a name accepts, its own dry-run checks and its part of the start-up line. What a
component needs from the run is data: an estimator's from its signature (`values`: a critic), an
engine's and an executor's from the entry it was registered with (`EngineEntry.receives_weights`,
`ExecutorEntry.runs_agent`). The generic code below checks, describes and lists every kind.

A component's options reach it unchanged: nothing is filtered, renamed or borrowed from another
component's setting, so GSPO's clip range is GSPO's own default unless `algo.policy.options` says
otherwise. An option a component does not take is an error naming the dotted option and what the
component takes. The one default rl-launch sets on a component is in `ESTIMATOR_DEFAULTS` (gae
whitens its advantages, as OpenRLHF runs it; `rl_algos.gae` leaves them raw for library users).

Adding a component is one registration, in a module passed with `--plugin` (imported in the
driver and in every Ray actor)::

    from rl_algos import ADVANTAGE_ESTIMATORS

    @ADVANTAGE_ESTIMATORS.register("my_estimator")
    def my_estimator(*, rewards, group_ids, action_mask, scale: float = 1.0): ...

and `rl-launch ppo --plugin my_plugin --algo.advantage.estimator my_estimator
--algo.advantage.options.scale 2`. An estimator declares the batch fields it needs
(`rl_algos.estimators.BATCH_FIELDS`, plus `reward_clip`, the value of `reward.clip`, for one
that clips rewards itself); every other keyword argument with a default is an option.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError
from .base import (
    ComponentKind,
    ComponentRegistry,
    Selection,
    check_options,
    component_options,
    format_options,
)
from .corrections import CORRECTION, correction_name
from .engines import ENGINE, ENGINES, EngineEntry
from .estimators import (
    ESTIMATOR,
    ESTIMATOR_DEFAULTS,
    ESTIMATOR_INPUTS,
    EstimatorNeeds,
    estimator_needs,
    estimator_options,
    estimator_takes,
)
from .executors import (
    EXECUTOR,
    EXECUTOR_INPUTS,
    EXECUTORS,
    ExecutorEntry,
    executor_name,
    executor_options,
    validation_engine,
)
from .kl import KL
from .losses import POLICY_LOSS
from .objective import policy_loss_config
from .rewards import REWARD, REWARDS
from .weight_sync import SYNC_STRATEGIES, WEIGHT_SYNC, SyncPlacement, SyncStrategy, choose_weight_sync

if TYPE_CHECKING:
    from ..config import PPOConfig

__all__ = [
    "ENGINES",
    "ESTIMATOR_DEFAULTS",
    "ESTIMATOR_INPUTS",
    "EXECUTORS",
    "EXECUTOR_INPUTS",
    "KINDS",
    "REWARDS",
    "SYNC_STRATEGIES",
    "ComponentKind",
    "EngineEntry",
    "EstimatorNeeds",
    "ExecutorEntry",
    "SyncPlacement",
    "SyncStrategy",
    "check_components",
    "choose_weight_sync",
    "component_options",
    "correction_name",
    "describe_components",
    "estimator_needs",
    "estimator_options",
    "estimator_takes",
    "executor_name",
    "executor_options",
    "list_components",
    "validation_engine",
]

KINDS: tuple[ComponentKind, ...] = (
    ESTIMATOR,
    POLICY_LOSS,
    CORRECTION,
    KL,
    ENGINE,
    REWARD,
    WEIGHT_SYNC,
    EXECUTOR,
)
"""Every component kind of `rl-launch ppo`, in the order they are checked and listed."""


def _check_selection(kind: ComponentKind, selection: Selection) -> None:
    names = kind.registry if selection.names is None else selection.names
    if selection.name not in names and selection.name not in selection.allowed:
        allowed = ", ".join([*selection.allowed, *sorted(names)])
        raise ConfigError(f"{selection.key}: {selection.name!r} is not one of {allowed}")
    if selection.options_key is not None and selection.takes is not None:
        owner, name = selection.options_owner or (kind.singular, selection.name)
        check_options(selection.options_key, owner, name, selection.options, selection.takes)


def check_components(config: PPOConfig) -> None:
    """Check every component's name and options and dry-run the math on a tiny batch: the one
    place a registered name is checked (decoding a config looks up none), once per run, by
    `rl_launch.validation.prepare` after the plugins are imported.

    Every kind's names and options first, so a kind's own checks may look up any name the config
    gives (the estimator's inputs, the KL estimator's entry); then each kind's checks.

    Raises:
        ConfigError: naming the dotted option (`algo.policy.options.epsilon`), the given name and
            the registered ones, the component and what it takes, or the combination that cannot
            work (k1 as a loss KL, a KL target with β = 0, a reward KL for an estimator that
            ignores token rewards, ...).
    """
    for kind in KINDS:
        for selection in kind.select(config):
            _check_selection(kind, selection)
    for kind in KINDS:
        if kind.check is not None:
            kind.check(config)
    try:
        policy_loss_config(config, kl_coef=config.algo.kl.init_kl_coef)
    except ValueError as error:  # e.g. a correction mode with a gating it cannot use
        raise ConfigError(f"algo.policy: {error}") from None


def describe_components(config: PPOConfig) -> str:
    """One start-up line naming each algorithm component with every option it will run with."""
    parts = [kind.describe(config) for kind in KINDS if kind.describe is not None]
    return ", ".join(part for part in parts if part)


def _builder(registry: Any, value: Any) -> Any:
    """What a registry holds under a name: a function, or an entry wrapping one."""
    return registry.builder_of(value) if isinstance(registry, ComponentRegistry) else value


def list_components() -> str:
    """Every registered component by kind: name, options with their defaults, the doc's first line
    (what `rl-launch components` prints)."""
    lines: list[str] = []
    for kind in KINDS:
        lines.append(f"{kind.title}  ({kind.where})")
        names: dict[int, list[str]] = {}
        values: dict[int, Any] = {}
        for name, value in kind.registry.items():
            names.setdefault(id(value), []).append(name)
            values[id(value)] = value
        for key, aliases in names.items():
            label = " / ".join(aliases)
            if kind.options_of is not None:
                label += f"({format_options(kind.options_of(aliases[0]))})"
            doc = (inspect.getdoc(_builder(kind.registry, values[key])) or "").strip().split("\n")[0]
            lines.append(f"  {label}" + (f"\n      {doc}" if doc else ""))
        if kind.listing_note:
            lines.append(f"  ({kind.listing_note})")
        lines.append("")
    lines.append(
        "rl-launch's own option defaults: "
        + "; ".join(f"{name}: {format_options(options)}" for name, options in ESTIMATOR_DEFAULTS.items())
        + " (OpenRLHF's)"
    )
    return "\n".join(lines) + "\n"
