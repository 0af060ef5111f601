"""`rl-launch sft`, `rl-launch rm`, `rl-launch dpo`: the supervised trainers, on the same stack as `ppo`.

One file per command (sft.py, rm.py, dpo.py: dataset, learner, preset settings), the shared
loop (loop.py), where the model trains (learners.py: one rank in the driver process, or a Ray
actor group of `ray.learner.num_actors` ranks), the configs (config.py) and the tiny locally
built demo (demo.py).

Configuration layers, in increasing priority: the command's struct defaults, the preset's
settings (`--preset auto`: arithmetic only when neither model.pretrain nor data.dataset is
given), the `--config` file, the dotted options.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .config import COMMANDS, DPOConfig, RMConfig, SFTConfig

__all__ = ["COMMANDS", "DPOConfig", "RMConfig", "SFTConfig", "preset_settings", "resolve_config", "run"]


def preset_settings(command: str) -> dict[str, Any]:
    """A copy of the arithmetic preset's settings of `command`."""
    import copy
    import importlib

    return copy.deepcopy(importlib.import_module(f"{__name__}.{command}").SETTINGS)


def resolve_config(command: str, path: str | None, overrides: Mapping[str, Any]) -> Any:
    """The config of `rl-launch <command>`: preset settings < file < dotted overrides.

    Raises:
        ConfigError: a missing or invalid file, an unknown preset or any invalid option, rl-learner's
            own checks of the trained learner's settings included (an infinite learning rate,
            which the config's `> 0` types admit), before anything starts.
    """
    from ..command import resolve_with_preset
    from ..errors import ConfigError
    from .loop import learner_options

    config = resolve_with_preset(
        COMMANDS[command],
        path,
        overrides,
        own_keys=("model.pretrain", "data.dataset"),
        settings_of=lambda preset: preset_settings(command),
    )
    try:
        learner_options(config)
    except ValueError as error:
        raise ConfigError(f"train (the {command} learner): {error}") from None
    return config


def run(command: str, config: Any) -> int:
    """Run `rl-launch <command>` with a resolved config; the exit code."""
    import importlib

    return importlib.import_module(f"{__name__}.{command}").run(config)
