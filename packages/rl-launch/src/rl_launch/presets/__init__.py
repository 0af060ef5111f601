"""Built-in presets: a task, a locally built model and tuned settings that run out of the box.

`arithmetic` is the CPU preset that `rl-launch ppo` runs with no arguments.
"""

from .arithmetic import PresetArtifacts, arithmetic_reward, build_preset, make_problems

__all__ = ["PresetArtifacts", "arithmetic_reward", "build_preset", "make_problems"]
