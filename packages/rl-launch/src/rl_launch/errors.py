"""The error every configuration check raises (re-exported by `rl_launch.config`)."""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the dotted field and what is allowed."""
