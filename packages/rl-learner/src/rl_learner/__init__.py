"""rl_learner: DeepSpeed learners, weight sync (sender side) and checkpoints."""

from .__about__ import __version__

__all__ = ["__version__"]
