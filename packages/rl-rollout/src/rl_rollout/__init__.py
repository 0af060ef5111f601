"""rl_rollout: token-in/token-out engines, executors, rewards and the receiving side of weight sync."""

from .__about__ import __version__

__all__ = ["__version__"]
