"""Gymnasium-style text environments as the environments of `MultiTurnExecutor`.

A text environment in the Gymnasium API (OpenEnv's and textarena's are close) is any object with

    reset(*, seed=None, options=None) -> (observation: str, info: dict)
    step(action: str) -> (observation: str, reward: float, terminated: bool, truncated: bool, info: dict)
    close()                                                   (optional)

`GymTextEnv` wraps one into the executor's environment protocol (OpenRLHF's `reset(states)` /
`step(states)` dicts), duck-typed: gymnasium need not be installed. Per episode:

    observation, info = env.reset(seed=<the prompt's label when it is an integer, else None>,
                                  options={"prompt": <prompt text>, "label": <label>})
    the model sees `observation` (rendered as a user turn by the chat template with
    render="chat", as it is with render="text"; an empty observation keeps the dataset's prompt)
    each action: observation, reward, terminated, truncated, info = env.step(action_text)
    the observation is the next turn's feedback; the episode ends when terminated or truncated

The episode's reward is the sum of the step rewards (as for every `MultiTurnExecutor`
environment); numbers in a step's `info` go to the metrics as extra logs. `close()` is called once
per episode: when the environment says done, else when `MultiTurnExecutor` ends the episode
(max_turns, length, an error; not a timeout, whose thread is abandoned). The environment's code
runs where `MultiTurnExecutor` runs an environment's code: on the episode's own thread, under
`episode_timeout_s`, its errors following `on_error` (see `rl_rollout.executors`).

`load_env_factory("my_pkg.envs:GuessNumber")` (or `"path/to/envs.py:GuessNumber"`) finds the class
or function that makes one; `gym_env_factory` makes the executor's zero-argument factory of it.
"""

from __future__ import annotations

import importlib
import importlib.util
import numbers
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

__all__ = ["RENDER_MODES", "GymTextEnv", "gym_env_factory", "load_env_factory"]

RENDER_MODES = ("chat", "text")


def load_env_factory(spec: str) -> Callable[..., Any]:
    """The callable `spec` names: "package.module:NAME" (imported by module name, so it must be
    importable where the rollout runs) or "path/to/file.py:NAME" (imported from that file).

    Raises:
      ValueError: a spec without ":NAME". ImportError / FileNotFoundError / AttributeError /
        TypeError: the module, the file or the name (each message names the spec).
    """
    if not isinstance(spec, str) or ":" not in spec:
        raise ValueError(
            f"env: {spec!r}; expected 'package.module:NAME' or 'path/to/file.py:NAME' naming a class or "
            "function that returns a Gymnasium-style text environment"
        )
    where, _, name = spec.rpartition(":")
    if where.endswith(".py") or "/" in where:
        from .rewards import load_python_file

        module = load_python_file(Path(where).expanduser().resolve(), "env")
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as error:
            raise ImportError(
                f"env: {spec!r}: cannot import module {where!r} ({error}); it must be importable in the "
                "rollout actors (installed or on PYTHONPATH), or give a file: path/to/file.py:NAME"
            ) from None
    factory = getattr(module, name, None)
    if factory is None:
        raise AttributeError(f"env: {spec!r}: {where} has no attribute {name!r}")
    if not callable(factory):
        raise TypeError(f"env: {spec!r}: {name} is a {type(factory).__name__}, not a class or function")
    return factory


def _seed(label: Any) -> int | None:
    if isinstance(label, numbers.Integral) and not isinstance(label, bool):
        return int(label)
    if isinstance(label, str) and label.strip().lstrip("-").isdigit():
        return int(label)
    return None


def _info_logs(info: Any) -> dict[str, float]:
    if not isinstance(info, Mapping):
        return {}
    return {
        str(key): float(value)
        for key, value in info.items()
        if isinstance(value, numbers.Real) and not isinstance(value, bool)
    }


class GymTextEnv:
    """One Gymnasium-style text environment as a `MultiTurnExecutor` environment (module docstring).

    Args:
      env: the environment (reset / step / optional close, see the module docstring).
      render: "chat" renders the first observation as a user turn with `tokenizer`'s chat template
        and its generation prompt; "text" gives it to the model as it is.
      tokenizer: needed with render="chat".
    """

    def __init__(self, env: Any, *, render: str = "chat", tokenizer: Any = None) -> None:
        for method in ("reset", "step"):
            if not callable(getattr(env, method, None)):
                raise TypeError(
                    f"env: a {type(env).__name__} has no {method}() method; expected a Gymnasium-style "
                    "environment with reset(seed=, options=) and step(action)"
                )
        if render not in RENDER_MODES:
            raise ValueError(f"render: {render!r} is not allowed; expected one of {RENDER_MODES}")
        self.env, self.render, self.tokenizer = env, render, tokenizer
        self.closed = False

    def _first_prompt(self, observation: str) -> str:
        if self.render == "text":
            return observation
        messages = [{"role": "user", "content": observation}]
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def reset(self, states: Mapping[str, Any]) -> dict[str, Any]:
        label = states.get("label")
        result = self.env.reset(seed=_seed(label), options={"prompt": states.get("prompt"), "label": label})
        if not (isinstance(result, tuple) and len(result) == 2):
            raise TypeError(f"env.reset() returned {result!r}; expected (observation: str, info: dict)")
        observation = result[0]
        if not isinstance(observation, str):
            raise TypeError(
                f"env.reset() returned an observation of type {type(observation).__name__}; expected str"
            )
        return {"observation": self._first_prompt(observation) if observation else states["observation"]}

    def step(self, states: Mapping[str, Any]) -> dict[str, Any]:
        result = self.env.step(states["action_text"])
        if not (isinstance(result, tuple) and len(result) == 5):
            raise TypeError(
                f"env.step() returned {result!r}; expected (observation, reward, terminated, truncated, info)"
            )
        observation, reward, terminated, truncated, info = result
        if not isinstance(observation, str):
            raise TypeError(
                f"env.step() returned an observation of type {type(observation).__name__}; expected str"
            )
        if not (isinstance(reward, numbers.Real) and not isinstance(reward, bool)):
            raise TypeError(
                f"env.step() returned a reward of type {type(reward).__name__}; expected a number"
            )
        done = bool(terminated) or bool(truncated)
        if done:
            self.close()
        return {
            "rewards": float(reward),
            "scores": float(reward),
            "environment_feedback": "" if done else observation,
            "done": done,
            "extra_logs": _info_logs(info),
        }

    def close(self) -> None:
        if not self.closed and callable(getattr(self.env, "close", None)):
            self.closed = True
            self.env.close()


def gym_env_factory(
    env: str | Callable[..., Any],
    *,
    env_kwargs: Mapping[str, Any] | None = None,
    render: str = "chat",
    tokenizer: Any = None,
) -> Callable[[], GymTextEnv]:
    """A zero-argument factory for `MultiTurnExecutor(env=...)`: each call makes
    `GymTextEnv(env(**env_kwargs), render=render, tokenizer=tokenizer)`; `env` a callable or a
    `load_env_factory` spec (loaded now, so a wrong spec fails here)."""
    make = load_env_factory(env) if isinstance(env, str) else env
    if not callable(make):
        raise TypeError(
            f"env: expected a 'module:NAME' / 'file.py:NAME' string or a callable, got {type(make).__name__}"
        )
    if env_kwargs is not None and not isinstance(env_kwargs, Mapping):
        raise TypeError(
            f"env_kwargs: expected a mapping of keyword arguments, got {type(env_kwargs).__name__}"
        )
    if render not in RENDER_MODES:
        raise ValueError(f"render: {render!r} is not allowed; expected one of {RENDER_MODES}")
    kwargs = dict(env_kwargs or {})

    def factory() -> GymTextEnv:
        return GymTextEnv(make(**kwargs), render=render, tokenizer=tokenizer)

    factory.__qualname__ = f"gym_env_factory({getattr(make, '__qualname__', make)!s})"
    return factory
