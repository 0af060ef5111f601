"""Checks that run before anything slow starts: paths, datasets, reward sources, the preset.

Each check fails with a `PreflightError` naming the option and what was wrong, so a run with a
missing dataset file, a model folder that is not there or a reward server that is down stops in
seconds, before Ray, the engines or DeepSpeed start.
"""

from __future__ import annotations

import os
import re
import socket
import urllib.parse
from pathlib import Path
from typing import Any

import msgspec

from .components import REWARDS
from .config import PPOConfig, data_sources

__all__ = ["PreflightError", "Resolved", "check_model_path", "check_reward_server", "resolve_inputs"]

# A hub id: "name" or "org/name" of letters, digits, ".", "-" and "_".
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


class PreflightError(ValueError):
    """An input of the run (path, dataset, reward source) is not usable; the message names it."""


class Resolved(msgspec.Struct, frozen=True, kw_only=True):
    """The concrete inputs of a run once the preset (if any) filled the gaps."""

    model_path: str
    critic_path: str
    reward_model_path: str | None
    prompt_data: tuple[str, ...]
    """Each training dataset: a local path (resolved) or a Hugging Face dataset name."""
    eval_data: tuple[str, ...] | None
    reward_function: str | None
    apply_chat_template: bool


def check_model_path(option: str, value: str) -> str:
    """A local folder with config.json, or something shaped like a hub id; else PreflightError."""
    path = Path(value).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise PreflightError(
                f"{option}: {value!r} exists but has no config.json (not an HF model folder)"
            )
        return str(path)
    if value.startswith((".", "/", "~")) or not _HUB_ID.match(value):
        raise PreflightError(f"{option}: model folder {value!r} does not exist")
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0", "false", "False"):
        from huggingface_hub import try_to_load_from_cache

        if not isinstance(try_to_load_from_cache(value, "config.json"), str):
            raise PreflightError(
                f"{option}: {value!r} is neither a local folder nor in the hub cache, and HF_HUB_OFFLINE is set"
            )
    return value


def check_reward_server(url: str, *, timeout_s: float = 5.0) -> None:
    """Open a TCP connection to the reward server's host and port; PreflightError if nobody answers."""
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise PreflightError(f"reward.remote_url: {url!r} is not an http(s) URL")
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        with socket.create_connection((parsed.hostname, port), timeout=timeout_s):
            pass
    except OSError as error:
        raise PreflightError(
            f"reward.remote_url: cannot reach the reward server at {url} ({error.strerror or error}); "
            "is it running?"
        ) from None


def _check_reward_function(name: str | None) -> None:
    if name is None or name in REWARDS:
        return
    from rl_rollout import load_reward_function

    try:
        load_reward_function(name)
    except (FileNotFoundError, ImportError, AttributeError, TypeError) as error:
        raise PreflightError(f"reward.function: {error}") from None


def _check_headers_env(headers_env: dict[str, str]) -> None:
    """Every variable reward.headers_env names is set here (the rollout actors get it from the driver)."""
    missing = [f"{header} -> {name}" for header, name in headers_env.items() if name not in os.environ]
    if missing:
        raise PreflightError(
            f"reward.headers_env: environment variables not set: {', '.join(missing)}; set each to its "
            "header's value (e.g. REWARD_TOKEN='Bearer ...') before starting the run"
        )


# Extensions of the local dataset files rl_data reads: such a name is a file, never a hub dataset.
_DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv", ".arrow")


def _check_data_file(option: str, value: str) -> str:
    """A local file or folder (resolved), or a name shaped like a hub dataset `org/name`."""
    path = Path(value).expanduser()
    if path.exists():
        return str(path)
    looks_like_file = path.suffix.lower() in _DATA_SUFFIXES or (path.suffix and "/" not in value)
    if value.startswith((".", "/", "~")) or looks_like_file:
        raise PreflightError(f"{option}: dataset file {value!r} does not exist")
    if not _HUB_ID.match(value):
        raise PreflightError(
            f"{option}: {value!r} is neither a local file or folder nor a Hugging Face dataset name (org/name)"
        )
    return value


def _check_data_files(option: str, value: str | list[str]) -> tuple[str, ...]:
    return tuple(_check_data_file(option, item) for item in data_sources(value))


def resolve_inputs(config: PPOConfig, preset: Any | None) -> Resolved:
    """Fill unset inputs from the preset's artifacts and check every one of them."""
    model = config.model.pretrain or (preset.model_path if preset else None)
    prompt_data = config.data.prompt_data or (preset.train_path if preset else None)
    eval_data = config.data.eval_dataset or (preset.eval_path if preset else None)
    reward_function = config.reward.function
    if reward_function is None and config.reward.remote_url is None and preset is not None:
        reward_function = preset.reward_function
    if model is None or prompt_data is None:  # PPOConfig already refuses this without a preset
        raise PreflightError("model.pretrain and data.prompt_data are required")
    model = check_model_path("model.pretrain", model)
    critic = check_model_path("model.critic_pretrain", config.model.critic_pretrain or model)
    reward_model = None
    if config.model.reward_pretrain is not None:
        reward_model = check_model_path("model.reward_pretrain", config.model.reward_pretrain)
    prompt_data = _check_data_files("data.prompt_data", prompt_data)
    if eval_data is not None:
        eval_data = _check_data_files("data.eval_dataset", eval_data)
    _check_reward_function(reward_function)
    for url in config.reward.urls:
        check_reward_server(url)
    _check_headers_env(config.reward.headers_env)
    return Resolved(
        model_path=model,
        critic_path=critic,
        reward_model_path=reward_model,
        prompt_data=prompt_data,
        eval_data=eval_data,
        reward_function=reward_function,
        apply_chat_template=config.data.apply_chat_template,
    )
