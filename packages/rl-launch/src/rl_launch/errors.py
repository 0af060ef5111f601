"""The errors of rl-launch's checks: ConfigError (re-exported by `rl_launch.config`) and ClusterError
(re-exported by `rl_launch.cluster`)."""

from __future__ import annotations

__all__ = ["ClusterError", "ConfigError"]


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the dotted field and what is allowed."""


class ClusterError(RuntimeError):
    """The cluster cannot host the run as configured (resources, placement, start-up)."""
