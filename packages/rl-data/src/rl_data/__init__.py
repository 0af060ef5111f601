"""rl_data."""

from .__about__ import __version__

__all__ = ["__version__"]
