"""Registries, and the promise that rl-algos needs torch and the standard library only."""

from __future__ import annotations

import ast
import importlib.metadata
import pathlib
import subprocess
import sys

import pytest

import rl_algos
from rl_algos import Registry, UnknownNameError

PACKAGE_DIR = pathlib.Path(rl_algos.__file__).parent


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


def test_package_metadata_requires_torch_only():
    requirements = importlib.metadata.requires("rl-algos") or []
    names = {
        req.split(";")[0].split("[")[0].split("<")[0].split(">")[0].split("=")[0].strip()
        for req in requirements
    }
    assert names == {"torch"}


def test_no_module_imports_anything_but_stdlib_torch_and_itself():
    allowed = set(sys.stdlib_module_names) | {"torch", "rl_algos", "__future__"}
    offenders = []
    modules = sorted(PACKAGE_DIR.rglob("*.py"))
    assert len(modules) >= 10
    for path in modules:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            offenders += [f"{path.name}: {name}" for name in names if name.split(".")[0] not in allowed]
    assert offenders == []


def test_import_in_a_fresh_interpreter_pulls_no_third_party_package_beyond_torch():
    # Any top-level module loaded by `import rl_algos` that `import torch` alone does not load
    # would be a hidden dependency.
    probe = (
        "import sys; import torch; before = {m.split('.')[0] for m in sys.modules}; "
        "import rl_algos; after = {m.split('.')[0] for m in sys.modules}; "
        "print(sorted(after - before - {'rl_algos'}))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    extra = ast.literal_eval(out.stdout.strip())
    assert set(extra) <= set(sys.stdlib_module_names), extra
