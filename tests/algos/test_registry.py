"""Registries by name (the dependency rules are checked for every package in tests/test_dependencies.py)."""

from __future__ import annotations

import pytest

from rl_algos import Registry, UnknownNameError


def test_registry_register_as_decorator_and_call_with_aliases():
    registry = Registry("widget")

    @registry.register("a", aliases=("alpha",))
    def a():
        return 1

    registry.register("b", lambda: 2)
    assert registry["alpha"] is a
    assert registry["b"]() == 2


def test_registry_refuses_duplicate_names_unless_overridden():
    registry = Registry("widget")
    registry.register("a", lambda: 1)
    with pytest.raises(ValueError, match=r"widget 'a' is already registered .* override=True"):
        registry.register("a", lambda: 2)
    registry.register("a", lambda: 3, override=True)
    assert registry["a"]() == 3


def test_registry_miss_lists_known_names_and_is_a_key_error():
    registry = Registry("widget")
    registry.register("b", lambda: 1)
    registry.register("a", lambda: 1)
    with pytest.raises(UnknownNameError, match=r"^unknown widget 'c'; known names: a, b$"):
        registry["c"]
    assert issubclass(UnknownNameError, KeyError)
    assert registry.get("c") is None
