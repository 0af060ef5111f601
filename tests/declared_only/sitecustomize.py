"""Started in every Python process whose PYTHONPATH begins with this folder (a test's subprocess
and, through the inherited environment, the Ray workers it starts): when RL_DECLARED_ONLY_FILE
names a guard file written by tests/test_declared_dependencies.py, the process sees only the
distributions in it, as if nothing else were installed.

Each finder on `sys.meta_path` (the builtin and frozen importers aside) is wrapped: a top-level
module of a distribution outside the set is not found (`import` raises ModuleNotFoundError,
`importlib.util.find_spec` returns None, as for a missing package), and `importlib.metadata`
does not list such a distribution (`version("accelerate")` raises PackageNotFoundError, as
transformers' dependency checks expect where it is missing). Modules already imported by `site`
(.pth files) stay.
"""

from __future__ import annotations

import json
import os
import re
import sys


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


class _DeclaredOnly:
    """A meta-path finder that hides `refused` top-level modules and undeclared distributions."""

    def __init__(self, inner, refused: frozenset[str], allowed: frozenset[str]) -> None:
        self.inner, self.refused, self.allowed = inner, refused, allowed

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in self.refused:
            return None
        find = getattr(self.inner, "find_spec", None)
        return None if find is None else find(name, path, target)

    def find_distributions(self, *args, **kwargs):
        find = getattr(self.inner, "find_distributions", None)
        for distribution in () if find is None else find(*args, **kwargs):
            name = distribution.metadata["Name"]
            if name is not None and _normalize(name) in self.allowed:
                yield distribution

    def invalidate_caches(self):
        invalidate = getattr(self.inner, "invalidate_caches", None)
        if invalidate is not None:
            invalidate()


def _install(path: str) -> None:
    with open(path) as file:
        guard = json.load(file)
    refused = frozenset(guard["refused_modules"])
    allowed = frozenset(guard["allowed_distributions"])
    wrapped = []
    for finder in sys.meta_path:
        name = getattr(finder, "__name__", type(finder).__name__)
        if name in ("BuiltinImporter", "FrozenImporter"):
            wrapped.append(finder)
        else:
            wrapped.append(_DeclaredOnly(finder, refused, allowed))
    sys.meta_path[:] = wrapped


if os.environ.get("RL_DECLARED_ONLY_FILE"):
    _install(os.environ["RL_DECLARED_ONLY_FILE"])
