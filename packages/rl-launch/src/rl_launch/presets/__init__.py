"""Built-in presets: a task, a locally built model and tuned settings that run out of the box.

`arithmetic` is the CPU preset that `rl-launch ppo` runs with no arguments. A preset gives two
things: `preset_settings(name)`, the configuration it layers under the user's file and flags
(so any of it can be overridden), and `prepare_preset(name, root, seed)`, the inputs it builds
(model, datasets, reward) for whatever the user left unset.
"""

from __future__ import annotations

import os
from typing import Any

import msgspec

from .arithmetic import DEFAULT_RL_SETTINGS, PresetArtifacts, arithmetic_reward, build_preset, make_problems

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

PRESETS: tuple[str, ...] = ("arithmetic",)


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
    """The nested configuration of preset `name` (sections as in `rl_launch.config.PPOConfig`)."""
    _check(name)
    rl = DEFAULT_RL_SETTINGS
    return {
        "algo": {
            "advantage": {"estimator": rl["advantage_estimator"]},
            "policy": {"loss": rl["policy_loss"], "eps_clip": float(rl["clip_epsilon"])},
            "kl": {"init_kl_coef": float(rl["kl_coef"])},
        },
        "rollout": {
            "n_samples_per_prompt": int(rl["n_samples_per_prompt"]),
            "rollout_batch_size": int(rl["prompts_per_step"]),
            "generate_max_len": int(rl["max_new_tokens"]),
            "temperature": float(rl["temperature"]),
            "top_p": float(rl["top_p"]),
        },
        "train": {
            "max_steps": int(rl["num_steps"]),
            "actor_learning_rate": float(rl["actor_learning_rate"]),
            "adam_betas": [float(beta) for beta in rl["adam_betas"]],
            "lr_warmup_ratio": float(rl["lr_warmup_ratio"]),
            "max_norm": float(rl["max_grad_norm"]),
        },
        "data": {"prompt_max_len": 64},
        "eval": {"eval_steps": 10},
        "ckpt": {"save_steps": 10},
        "log": {"output_dir": "runs/ppo-arithmetic"},
    }


def prepare_preset(name: str, root: str | os.PathLike[str] | None = None, *, seed: int = 0) -> PresetInputs:
    """Build (or reuse from the cache under `root`) the inputs of preset `name`."""
    _check(name)
    root = root or os.path.join(os.path.expanduser("~"), ".cache", "rl-launch", "presets")
    artifacts = build_preset(root, seed=seed)
    return PresetInputs(
        model_path=str(artifacts.model_path),
        train_path=str(artifacts.train_path),
        eval_path=str(artifacts.eval_path),
        reward_function="arithmetic",
        apply_chat_template=artifacts.apply_chat_template,
    )
