"""Built-in presets: a task, a locally built model and tuned settings that run out of the box.

`arithmetic` is the CPU preset that `rl-launch ppo` runs with no arguments; `colours` is the
vision-language one (`--preset colours`: a tiny Qwen2-VL names an image's colour). A preset gives two
things: `preset_settings(name)`, the configuration it layers under the user's file and flags
(so any of it can be overridden), and `prepare_preset(name, root, seed)`, the inputs it builds
(model, datasets, reward) for whatever the user left unset.
"""

from __future__ import annotations

import os
from typing import Any

import msgspec

from . import arithmetic, colours
from .arithmetic import PresetArtifacts, arithmetic_reward, build_preset, make_problems

__all__ = [
    "PRESETS",
    "PresetArtifacts",
    "PresetInputs",
    "arithmetic_reward",
    "build_preset",
    "make_problems",
    "prepare_preset",
    "preset_settings",
]

PRESETS: tuple[str, ...] = ("arithmetic", "colours")
_MODULES = {"arithmetic": arithmetic, "colours": colours}


class PresetInputs(msgspec.Struct, frozen=True, kw_only=True):
    """What a preset fills in: model folder, train/eval prompt files, reward function name."""

    model_path: str
    train_path: str
    eval_path: str | None
    reward_function: str
    apply_chat_template: bool = True


def _check(name: str) -> None:
    if name not in PRESETS:
        raise ValueError(f"preset: {name!r} is not one of {', '.join(PRESETS)}, none")


def preset_settings(name: str) -> dict[str, Any]:
    """The nested configuration of preset `name` (sections as in `rl_launch.config.PPOConfig`).

    A copy of the preset module's `SETTINGS`, the one place its run settings are written.
    """
    _check(name)
    return _MODULES[name].settings()


def prepare_preset(name: str, root: str | os.PathLike[str] | None = None, *, seed: int = 0) -> PresetInputs:
    """Build (or reuse from the cache under `root`) the inputs of preset `name`."""
    _check(name)
    root = root or os.path.join(os.path.expanduser("~"), ".cache", "rl-launch", "presets")
    artifacts = _MODULES[name].build_preset(root, seed=seed)
    return PresetInputs(
        model_path=str(artifacts.model_path),
        train_path=str(artifacts.train_path),
        eval_path=str(artifacts.eval_path),
        reward_function=name,
        apply_chat_template=artifacts.apply_chat_template,
    )
