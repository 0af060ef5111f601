"""rl_launch: the full RL post-training stack on Ray, `rl-launch ppo`."""

from .__about__ import __version__

__all__ = ["__version__"]
