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
        ConfigError: a missing or invalid file, an unknown preset or any invalid option.
    """
    import msgspec

    from ..options import load_config, parse_value, read_config_file

    cls = COMMANDS[command]
    data: Any = read_config_file(path) if path is not None else {}

    def given(dotted: str) -> Any:
        if dotted in overrides:
            return overrides[dotted]
        value = data
        for key in dotted.split("."):
            if not isinstance(value, Mapping) or key not in value:
                return None
            value = value[key]
        return value

    field = next(f for f in msgspec.structs.fields(cls) if f.name == "preset")
    preset = given("preset")
    preset = parse_value(str(preset) if preset is not None else "auto", field.type, name="preset")
    if preset == "auto":
        own = any(given(key) is not None for key in ("model.pretrain", "data.dataset"))
        preset = "none" if own else "arithmetic"
    settings = preset_settings(command) if preset != "none" else {}
    return load_config(cls, path, {**overrides, "preset": preset}, base=settings)


def run(command: str, config: Any) -> int:
    """Run `rl-launch <command>` with a resolved config; the exit code."""
    import importlib

    return importlib.import_module(f"{__name__}.{command}").run(config)
