"""The config `rl-launch ppo` runs, for tests that check options without starting anything."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rl_launch.cli import resolve_ppo_config
from rl_launch.config import PPOConfig
from rl_launch.validation import prepare


def ppo_config(base: Mapping[str, Any], /, **overrides: Any) -> PPOConfig:
    """`base`'s options, then `overrides` (`a__b` stands for the dotted `a.b`; a None value drops
    the option; other values are given as strings, as on a command line), decoded as the command
    line is (`resolve_ppo_config`) and then through its one validation pass
    (`rl_launch.validation.prepare`, its notes dropped)."""
    given = {**base, **{key.replace("__", "."): value for key, value in overrides.items()}}
    options = {
        key: value if isinstance(value, str) else str(value)
        for key, value in given.items()
        if value is not None
    }
    return prepare(resolve_ppo_config(None, options), say=lambda note: None)
