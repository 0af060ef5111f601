"""KL estimators (`rl_algos.KL_ESTIMATORS`), one per side: `algo.kl.reward_estimator` with
`algo.kl.reward_options` (the KL subtracted from the token rewards) and `algo.kl.loss_estimator`
with `algo.kl.loss_options` (the KL term of the loss, `algo.kl.use_kl_loss`). The options are
those of `rl_algos.kl_penalty`, which computes either side. The KL to a distillation teacher
(`algo.distill`, `rl_algos.distillation`) is checked and described here too: it is the same
choice, reward or loss, against another frozen model."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from rl_algos import KL_ESTIMATORS, StraightThroughKL, kl_penalty

from ..errors import ConfigError
from .base import ComponentKind, Selection, component_options, dry_run
from .estimators import estimator_needs

if TYPE_CHECKING:
    from ..config import PPOConfig

__all__ = ["KL"]

_REWARD_INPUTS = frozenset({"estimator", "old_logprobs", "unbiased_gradient"})
_LOSS_INPUTS = frozenset({"estimator", "old_logprobs"})


def _in_reward() -> list[str]:
    """The KL estimators a reward may use: a "+" one (k2's gradient) changes nothing in a reward,
    which carries no gradient."""
    return [name for name, entry in KL_ESTIMATORS.items() if not isinstance(entry, StraightThroughKL)]


def _select(config: PPOConfig) -> list[Selection]:
    kl = config.algo.kl
    return [
        Selection(
            "algo.kl.reward_estimator",
            kl.reward_estimator,
            "algo.kl.reward_options",
            kl.reward_options,
            component_options(kl_penalty, inputs=_REWARD_INPUTS),
            options_owner=("KL penalty", "kl_penalty"),
            names=_in_reward(),
        ),
        Selection(
            "algo.kl.loss_estimator",
            kl.loss_estimator,
            "algo.kl.loss_options",
            kl.loss_options,
            component_options(kl_penalty, inputs=_LOSS_INPUTS),
            options_owner=("KL penalty", "kl_penalty"),
        ),
        Selection("algo.distill.estimator", config.algo.distill.estimator, None, {}, None),
    ]


def _check(config: PPOConfig) -> None:
    kl = config.algo.kl
    one, ref = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]])
    dry_run(
        "algo.kl.reward_options",
        f"KL estimator {kl.reward_estimator!r}",
        lambda: kl_penalty(one, ref, kl.reward_estimator, **kl.reward_options),
    )
    extra = {"old_logprobs": one} if kl.loss_options.get("unbiased_gradient") else {}
    dry_run(
        "algo.kl.loss_options",
        f"KL estimator {kl.loss_estimator!r}",
        lambda: kl_penalty(one, ref, kl.loss_estimator, **kl.loss_options, **extra),
    )
    if (
        kl.init_kl_coef > 0
        and kl.use_kl_loss
        and KL_ESTIMATORS[kl.loss_estimator] is KL_ESTIMATORS["k1"]  # "k1" or "kl"; "k1+" is not
    ):
        # E[∇ k1] = E[∇ log π] = 0 under π's own samples: as a loss, k1 pulls nowhere on average
        raise ConfigError(
            f"algo.kl.loss_estimator: {kl.loss_estimator!r} as a loss term has zero expected gradient; "
            "use 'k3' or 'low_var_kl' (GRPO), 'k2', or a '+' variant such as 'k3+'"
        )
    if kl.kl_target is not None and kl.init_kl_coef == 0:
        raise ConfigError(
            f"algo.kl.kl_target: {kl.kl_target} needs algo.kl.init_kl_coef > 0: the adaptive "
            "controller scales β, and β = 0 stays 0 (and starts no reference model)"
        )
    _check_distill(config)
    if (
        kl.init_kl_coef > 0
        and not kl.use_kl_loss
        and not estimator_needs(config.algo.advantage.estimator).token_rewards
    ):
        raise ConfigError(
            f"algo.kl.init_kl_coef: {kl.init_kl_coef} puts the KL into the reward, but estimator "
            f"{config.algo.advantage.estimator!r} uses outcome rewards only and would ignore it; set "
            "algo.kl.use_kl_loss true (GRPO style) or pick gae / reinforce / reinforce_baseline, or "
            "group_reward_to_go (OpenRLHF's KL-in-reward form of group_norm / rloo / dr_grpo: its "
            "preset option) / flash_reinforce"
        )


def _check_distill(config: PPOConfig) -> None:
    distill = config.algo.distill
    if not config.needs_teacher:
        return
    if distill.mode == "loss" and KL_ESTIMATORS[distill.estimator] is KL_ESTIMATORS["k1"]:
        raise ConfigError(
            f"algo.distill.estimator: {distill.estimator!r} as a loss term has zero expected gradient; "
            "use 'k2' (the reverse KL's gradient), 'k3' (the forward KL's) or a '+' variant"
        )
    estimator = config.algo.advantage.estimator
    if distill.mode == "reward" and not estimator_needs(estimator).token_rewards:
        raise ConfigError(
            f"algo.distill.mode: 'reward' adds the teacher's per-token reward to the token rewards, but "
            f"estimator {estimator!r} uses outcome rewards only and would ignore it; set algo.distill.mode "
            "loss, or pick reinforce / reinforce_baseline / gae, or group_reward_to_go (the token-reward "
            "form of grpo / rloo / dr_grpo: its preset option) / flash_reinforce"
        )


def _describe(config: PPOConfig) -> str:
    kl = config.algo.kl
    words = "no KL"
    if config.needs_reference:
        side = "loss" if kl.use_kl_loss else "reward"
        estimator = kl.loss_estimator if kl.use_kl_loss else kl.reward_estimator
        words = f"KL {estimator} in the {side} (β = {kl.init_kl_coef:g})"
    if config.needs_teacher:
        distill = config.algo.distill
        how = (
            "reward −β_d·(log π − log π_T)"
            if distill.mode == "reward"
            else f"{distill.estimator} in the loss"
        )
        words += (
            f", distillation to {config.model.teacher_pretrain}: {how} (β_d = {distill.coef:g}"
            + ("" if distill.outcome else ", outcome reward off")
            + ")"
        )
    return words


KL = ComponentKind(
    title="KL estimators",
    singular="KL estimator",
    registry=KL_ESTIMATORS,
    where=(
        "algo.kl.reward_estimator / loss_estimator; options of kl_penalty: algo.kl.reward_options / "
        "loss_options; algo.distill.estimator (the KL to a distillation teacher in the loss)"
    ),
    select=_select,
    check=_check,
    describe=_describe,
)
