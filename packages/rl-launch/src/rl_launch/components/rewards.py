"""Reward functions by name: `reward.function` (or an OpenRLHF `reward_func` file `path.py`).

A registered reward is a factory called in the rollout actor, returning an `rl_rollout` reward."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rl_algos import Registry

from ..errors import ConfigError
from .base import ComponentKind, Selection

if TYPE_CHECKING:
    from ..config import PPOConfig

__all__ = ["REWARD", "REWARDS"]

REWARDS = Registry("reward function")
"""Reward functions by name: name -> a factory returning an `rl_rollout` reward (called in the
rollout actor). `reward.function` may also be an OpenRLHF `reward_func` file (`path.py`)."""


def _select(config: PPOConfig) -> list[Selection]:
    return []  # a name or a file path: checked below


def _check(config: PPOConfig) -> None:
    function = config.reward.function
    if function is not None and function not in REWARDS and not function.endswith(".py"):
        raise ConfigError(
            f"reward.function: {function!r} is neither a registered reward ({', '.join(sorted(REWARDS))}) nor a .py file"
        )
    buffer, longest = config.reward.overlong_buffer_len, config.rollout.generate_max_len
    if buffer is not None and buffer > longest:
        raise ConfigError(
            f"reward.overlong_buffer_len: {buffer} must be <= rollout.generate_max_len ({longest}): the "
            "penalty grows over the last overlong_buffer_len tokens before that limit"
        )


REWARD = ComponentKind(
    title="reward functions",
    singular="reward function",
    registry=REWARDS,
    where="reward.function; or an OpenRLHF reward_func file path.py",
    select=_select,
    check=_check,
)


@REWARDS.register("arithmetic")
def arithmetic_reward() -> Any:
    """1.0 when the first integer of the response equals the label (the arithmetic preset's)."""
    from rl_rollout import BatchedReward

    from ..presets.arithmetic import arithmetic_reward as score

    return BatchedReward(score, name="arithmetic")


@REWARDS.register("colours")
def colours_reward() -> Any:
    """1.0 when the response's first word is the label (the colours preset's: an image's colour)."""
    from rl_rollout import BatchedReward

    from ..presets.colours import colour_reward as score

    return BatchedReward(score, name="colours")


@REWARDS.register("numeric")
def numeric_reward() -> Any:
    """`rl_rollout.NumericAnswerReward`: the last number of the response against the label."""
    from rl_rollout import NumericAnswerReward

    return NumericAnswerReward()


@REWARDS.register("exact_match")
def exact_match_reward() -> Any:
    """`rl_rollout.ExactMatchReward`: the stripped response equals the label."""
    from rl_rollout import ExactMatchReward

    return ExactMatchReward()


@REWARDS.register("code")
def code_reward() -> Any:
    """`rl_rollout.CodeReward`: the pass fraction of the label's tests against the response's
    code, run in the sandbox (5 s, 512 MiB, no network; `rl_rollout.sandbox`). For other limits,
    a reward file: `reward_func = CodeReward(limits=SandboxLimits(...))`."""
    from rl_rollout import CodeReward

    return CodeReward()


@REWARDS.register("reasoning_gym")
def reasoning_gym_reward() -> Any:
    """`rl_rollout.ReasoningGymReward`: the reasoning-gym task's own score_answer on the response's
    last <answer>...</answer> (else the whole response), for prompts of --data.prompt_data
    reasoning_gym:<task> (pip install 'rl-launch[reasoning-gym]')."""
    from rl_rollout import ReasoningGymReward

    return ReasoningGymReward()


@REWARDS.register("verifiers")
def verifiers_reward() -> Any:
    """`rl_rollout.VerifiersReward`: the verifiers task's own rubric (`Task.score`: its weighted
    `@vf.reward`s) on a trace of the prompt and the response, for prompts of --data.prompt_data
    verifiers:<taskset> (a single-turn taskset; pip install 'rl-launch[verifiers]')."""
    from rl_rollout import VerifiersReward

    return VerifiersReward()
