"""Name -> function registries, so a config picks an estimator or a loss by name.

A `Registry` is a plain `dict` with two additions: `register` refuses a name that is taken
(unless `override=True`), and looking up a missing name raises `UnknownNameError` listing the
names that exist. Users add their own entries without touching the package::

    from rl_algos import POLICY_LOSSES

    @POLICY_LOSSES.register("my_loss")
    def my_loss(logprobs, old_logprobs, advantages, action_mask, **options): ...
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

__all__ = ["Registry", "UnknownNameError"]

F = TypeVar("F", bound=Callable)


class UnknownNameError(KeyError, ValueError):
    """A registry lookup for a name that was never registered."""

    def __str__(self) -> str:  # KeyError would wrap the message in quotes
        return str(self.args[0]) if self.args else ""


class Registry(dict):
    """A name -> callable mapping with a duplicate guard and helpful misses.

    Args:
      kind: what the entries are ("advantage estimator", "policy loss"), used in errors.
    """

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def register(
        self, name: str, fn: F | None = None, *, aliases: Iterable[str] = (), override: bool = False
    ) -> Callable[[F], F] | F:
        """Register `fn` under `name` (and `aliases`); usable as a decorator or a call."""

        def add(func: F) -> F:
            for key in (name, *aliases):
                if not isinstance(key, str) or not key:
                    raise TypeError(f"{self.kind} names must be non-empty strings, got {key!r}")
                if key in self and not override:
                    raise ValueError(
                        f"{self.kind} {key!r} is already registered (to "
                        f"{getattr(self[key], '__qualname__', repr(self[key]))}); "
                        "pass override=True to replace it"
                    )
                self[key] = func
            return func

        return add if fn is None else add(fn)

    def __missing__(self, name: str):
        raise UnknownNameError(f"unknown {self.kind} {name!r}; known names: {', '.join(sorted(self))}")
