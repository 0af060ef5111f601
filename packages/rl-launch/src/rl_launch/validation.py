"""The one validation pass of `rl-launch ppo`, between decoding a config and running it.

    decode   `rl_launch.cli.resolve_ppo_config`: preset < file < options, each section's own
             checks (types, ranges, combinations of plain values); no registry is consulted, so
             a config naming a plugin's components decodes before that plugin is imported
    prepare  this module: the config's plugins imported, one meaning settled for the run (a
             printed note for each translation), then every component kind's names and options
             checked once (`rl_launch.components.check_components`: the name, the given value
             and the registered names in each error), then what the learner backend does
             not do yet (`rl_launch.backends.fsdp2_refusals`), what stands in the way of
             train.tensor_parallel_size (`rl_launch.backends.tensor_parallel_refusals`) and
             the trained learners' own settings (`_check_learner_settings`)

`prepare` runs once per command line, for `--print-config` and the run alike (the YAML printed
is the config that runs); `rl_launch.ppo.run` trusts its result and checks nothing again.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec

from .errors import ConfigError

if TYPE_CHECKING:
    from .config import PPOConfig

__all__ = ["REWARD_TO_GO_FORMS", "kl_in_reward_form", "learner_roles", "prepare"]

REWARD_TO_GO_FORMS = ("group_norm", "rloo", "dr_grpo")
"""Outcome estimators that OpenRLHF runs, with the KL in the reward, through its compute_reward
(the KL as per-token rewards, then the reward-to-go): `group_reward_to_go` with the preset of the
same name here. Without that KL each is the outcome estimator of its name. rl-launch's own `grpo`
is not among them (its ε is verl's, not OpenRLHF's)."""

_PRESET_KNOBS = ("preset", "centre", "scale", "unbiased", "epsilon")
"""Options of `group_reward_to_go` that its preset replaces: given with a translated estimator,
they would be overridden without a word, so they are refused."""


def _note_on_stderr(note: str) -> None:
    print(f"rl-launch ppo: {note}", file=sys.stderr)  # stderr: --print-config's YAML stays clean


def kl_in_reward_form(config: PPOConfig) -> tuple[PPOConfig, str | None]:
    """The config with one meaning for an estimator of `REWARD_TO_GO_FORMS` given the KL in the
    reward (`algo.kl.init_kl_coef` > 0, `algo.kl.use_kl_loss` false), whichever spelling set the
    coefficient (`--algo.kl.init_kl_coef`, OpenRLHF's `--algo.kl.init_coef`, a config file):
    `algo.advantage.estimator group_reward_to_go` with `algo.advantage.options.preset <name>`,
    the estimator's other options kept verbatim; and the note saying so. Any other config comes
    back as it is, with None.

    Raises:
        ConfigError: an option of `_PRESET_KNOBS` given with such an estimator (the preset would
            replace it).
    """
    advantage, kl = config.algo.advantage, config.algo.kl
    name = advantage.estimator
    if name not in REWARD_TO_GO_FORMS or kl.init_kl_coef == 0 or kl.use_kl_loss:
        return config, None
    clash = [key for key in _PRESET_KNOBS if key in advantage.options]
    if clash:
        raise ConfigError(
            f"algo.advantage.options.{clash[0]}: {advantage.options[clash[0]]!r} cannot be combined with "
            f"algo.advantage.estimator {name} and the KL in the reward: that runs as group_reward_to_go "
            f"with preset {name} (OpenRLHF's form), whose preset sets {', '.join(_PRESET_KNOBS[1:])}; "
            "drop the option, or put the KL into the loss (algo.kl.use_kl_loss true)"
        )
    translated = msgspec.structs.replace(
        advantage, estimator="group_reward_to_go", options={**advantage.options, "preset": name}
    )
    config = msgspec.structs.replace(config, algo=msgspec.structs.replace(config.algo, advantage=translated))
    note = (
        f"algo.advantage.estimator {name} with the KL in the reward (algo.kl.init_kl_coef "
        f"{kl.init_kl_coef:g}, algo.kl.use_kl_loss false) runs as algo.advantage.estimator "
        f"group_reward_to_go with algo.advantage.options.preset {name}: OpenRLHF's KL-regularised "
        f"{name} (the outcome estimator {name} ignores per-token rewards)"
    )
    return config, note


def prepare(config: PPOConfig, say: Callable[[str], None] = _note_on_stderr) -> PPOConfig:
    """The validation pass of a decoded config (module docstring): import its plugins (in this
    process; the actors import them again), settle one meaning (`kl_in_reward_form`, its note
    given to `say`) and check every component once (`check_components`). Returns the config
    that runs.

    Raises:
        ConfigError: a plugin that does not resolve or import, or any component's name, options
            or combination (the message starts with the dotted option).
    """
    from .backends import fsdp2_refusals, tensor_parallel_refusals, zero_stage_note
    from .components import check_components
    from .config import _fail
    from .plugins import import_plugins, resolve_plugins

    try:
        import_plugins(resolve_plugins(config.plugins))
    except ValueError as error:
        raise ConfigError(str(error)) from None
    config, note = kl_in_reward_form(config)
    for line in (note, zero_stage_note(config)):
        if line is not None:
            say(line)
    check_components(config)
    for option, value, why in [
        *fsdp2_refusals(config),
        *tensor_parallel_refusals(config, learner_roles(config)),
    ]:
        _fail(option, value, why)
    _check_learner_settings(config)
    return config


def _check_learner_settings(config: PPOConfig) -> None:
    """Build the settings of each trained learner (`learner_settings`) once here, so that
    rl-learner's own checks refuse what the launcher's types admit (an infinite learning rate:
    `Positive` is only `> 0`) before anything starts, not in `roles.start` after Ray did.

    Resolved for this machine (`model.dtype` "auto" and train.adam_offload by whether it has a
    GPU), as a local run resolves them.

    Raises:
        ConfigError: "train (<role> learner): " and rl-learner's message, which names its field
            and the value.
    """
    import torch

    from .learner_settings import learner_dtype, learner_settings, role_optimizer

    use_gpus = torch.cuda.is_available()
    dtype = learner_dtype(config.model.dtype, use_gpus=use_gpus)
    for role, trained in (("actor", True), ("critic", learner_roles(config)["critic"])):
        if not trained:
            continue
        try:
            learner_settings(
                config.model,
                config.train,
                dtype=dtype,
                use_gpus=use_gpus,
                **role_optimizer(config.train, role),
            )
        except ValueError as error:
            raise ConfigError(f"train ({role} learner): {error}") from None


def learner_roles(config: PPOConfig) -> dict[str, bool]:
    """{ray section of a learner role: whether the run starts it}."""
    from .components.estimators import estimator_needs

    return {
        "policy": True,
        "critic": estimator_needs(config.algo.advantage.estimator).critic,
        "ref": config.needs_reference,
        "teacher": config.needs_teacher,
        "reward_model": config.model.reward_pretrain is not None,
    }
