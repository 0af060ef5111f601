"""Advantage estimators (`rl_algos.ADVANTAGE_ESTIMATORS`): `algo.advantage.estimator` and its
options `algo.advantage.options`.

What an estimator needs from the run is read from its own signature (`rl_algos.estimator_inputs`):
`values` starts a critic, `baseline_rewards` has the engines answer each prompt greedily (ReMax),
`token_rewards` lets a KL in the reward reach it, `reward_clip` makes it clip rewards itself. A
plugin estimator that takes `values` gets a critic like gae does, with no list to add it to.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from rl_algos import ADVANTAGE_ESTIMATORS, compute_advantages
from rl_algos.estimators import BATCH_FIELDS, estimator_inputs

from ..config import check_sequence_parallel_actors
from ..errors import ConfigError
from .base import ComponentKind, Selection, component_options, dry_run, format_options

if TYPE_CHECKING:
    from ..config import PPOConfig

__all__ = [
    "ESTIMATOR",
    "ESTIMATOR_DEFAULTS",
    "ESTIMATOR_INPUTS",
    "EstimatorNeeds",
    "estimator_needs",
    "estimator_options",
    "estimator_takes",
    "tiny_batch",
]

ESTIMATOR_INPUTS: frozenset[str] = frozenset({*BATCH_FIELDS, "reward_clip"})
"""What the run hands an estimator from the batch (it receives those it declares): not options."""

ESTIMATOR_DEFAULTS: Mapping[str, Mapping[str, Any]] = {"gae": {"whiten": True}}
"""rl-launch's own defaults for an estimator's options, under the user's: OpenRLHF whitens GAE
advantages over the batch (reinforce and reinforce_baseline whiten by their own default)."""


@dataclasses.dataclass(frozen=True)
class EstimatorNeeds:
    """What an estimator needs from the run, from the inputs it declares."""

    critic: bool
    """It takes `values`: the run starts a critic and trains it."""
    greedy_baseline: bool
    """It takes `baseline_rewards`: the engines also answer every prompt greedily (ReMax)."""
    token_rewards: bool
    """It takes `token_rewards`: a KL in the reward reaches it."""
    clips_rewards: bool
    """It takes `reward_clip`: it gets the raw rewards and clips them itself."""


def estimator_takes(estimator: str, name: str) -> bool:
    """Whether the estimator registered as `estimator` has a keyword argument `name`."""
    return name in inspect.signature(ADVANTAGE_ESTIMATORS[estimator]).parameters


def estimator_needs(estimator: str) -> EstimatorNeeds:
    """`EstimatorNeeds` of the estimator registered as `estimator`."""
    inputs = estimator_inputs(estimator)
    return EstimatorNeeds(
        critic="values" in inputs,
        greedy_baseline="baseline_rewards" in inputs,
        token_rewards="token_rewards" in inputs,
        clips_rewards=estimator_takes(estimator, "reward_clip"),
    )


def estimator_options(config: PPOConfig) -> dict[str, Any]:
    """The options the estimator gets: rl-launch's defaults for it (`ESTIMATOR_DEFAULTS`) under
    `algo.advantage.options`."""
    advantage = config.algo.advantage
    return {**ESTIMATOR_DEFAULTS.get(advantage.estimator, {}), **advantage.options}


def _options_of(name: str) -> dict[str, Any]:
    return {
        **component_options(ADVANTAGE_ESTIMATORS[name], inputs=ESTIMATOR_INPUTS),
        **ESTIMATOR_DEFAULTS.get(name, {}),
    }


def tiny_batch() -> dict[str, torch.Tensor]:
    """Two groups of two responses, three tokens each (the last token of one is padding): what
    the dry runs of `check_components` compute on."""
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    rewards = torch.tensor([1.0, 0.0, 0.5, 1.0])
    token_rewards = torch.zeros(4, 3)
    token_rewards[[0, 1, 2, 3], [2, 1, 2, 0]] = rewards
    return {
        "rewards": rewards,
        "token_rewards": token_rewards,
        "values": torch.full((4, 3), 0.1),
        "action_mask": mask,
        "group_ids": torch.tensor([0, 0, 1, 1]),
        "baseline_rewards": torch.tensor([0.5, 0.5, 0.0, 0.0]),
    }


def _select(config: PPOConfig) -> list[Selection]:
    advantage = config.algo.advantage
    fn = ADVANTAGE_ESTIMATORS.get(advantage.estimator)  # None: an unknown name, refused by the caller
    takes = component_options(fn, inputs=ESTIMATOR_INPUTS) if fn is not None else None
    return [
        Selection(
            "algo.advantage.estimator",
            advantage.estimator,
            "algo.advantage.options",
            advantage.options,
            takes,
        )
    ]


def _check(config: PPOConfig) -> None:
    name = config.algo.advantage.estimator
    if estimator_needs(name).greedy_baseline and config.model.reward_pretrain is not None:
        raise ConfigError(
            f"algo.advantage.estimator: {name!r} takes the rule / remote reward of a greedy answer as its "
            "baseline; with model.reward_pretrain the sampled rewards include the reward model's score "
            "and the baseline would not: use grpo, rloo or reinforce_baseline with a reward model"
        )
    _check_critic(config)
    batch = tiny_batch()
    if estimator_takes(name, "reward_clip"):
        batch["reward_clip"] = config.reward.clip
    options = estimator_options(config)
    dry_run(
        "algo.advantage.options",
        f"advantage estimator {name!r}",
        lambda: compute_advantages(name, **batch, **options),
    )


def _check_critic(config: PPOConfig) -> None:
    """What depends on whether the estimator takes `values` (a critic): the critic warm-up and
    the critic's ranks under sequence parallelism."""
    if config.train.critic_warmup_steps and not estimator_needs(config.algo.advantage.estimator).critic:
        raise ConfigError(
            f"train.critic_warmup_steps: {config.train.critic_warmup_steps!r} needs a critic, and "
            f"algo.advantage.estimator {config.algo.advantage.estimator} uses none (gae does); leave it 0"
        )
    if config.model.sequence_parallel_size > 1 and estimator_needs(config.algo.advantage.estimator).critic:
        check_sequence_parallel_actors(config, "critic")


def _describe(config: PPOConfig) -> str:
    name = config.algo.advantage.estimator
    options = {
        **component_options(ADVANTAGE_ESTIMATORS[name], inputs=ESTIMATOR_INPUTS),
        **estimator_options(config),
    }
    return f"advantages {name}({format_options(options)})"


ESTIMATOR = ComponentKind(
    title="advantage estimators",
    singular="advantage estimator",
    registry=ADVANTAGE_ESTIMATORS,
    where="algo.advantage.estimator, options: algo.advantage.options",
    select=_select,
    options_of=_options_of,
    check=_check,
    describe=_describe,
    listing_note="an estimator that takes `values` gets a critic; `baseline_rewards`, a greedy answer per prompt",
)
