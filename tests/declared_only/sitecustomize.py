"""Started in every Python process whose PYTHONPATH begins with this folder (a test's subprocess
and, through the inherited environment, the Ray workers it starts): when RL_DECLARED_ONLY_FILE
names a guard file written by tests/test_declared_dependencies.py, the process sees only the
distributions in it, as if nothing else were installed.

Each finder on `sys.meta_path` (the builtin and frozen importers aside) is wrapped: a top-level
module that a distribution outside the set installed is not found (`import` raises
ModuleNotFoundError, `importlib.util.find_spec` returns None, as for a missing package), and
`importlib.metadata` does not list such a distribution (`version("accelerate")` raises
PackageNotFoundError, as transformers' dependency checks expect where it is missing). A module
is hidden by where it was found, not by its name: Ray puts its own copy of colorama on
`sys.path` (ray/thirdparty_files), which stays importable while the colorama distribution that
another package pulled in is hidden. Modules already imported by `site` (.pth files) stay.
"""

from __future__ import annotations

import json
import os
import re
import sys


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _found_at(spec) -> list[str]:
    """The files and folders a module spec was found at."""
    places = [] if spec.origin is None else [spec.origin]
    return places + list(spec.submodule_search_locations or ())


class _DeclaredOnly:
    """A meta-path finder that hides the top-level modules found where `refused` says an
    undeclared distribution installed them (module name -> paths), and undeclared distributions."""

    def __init__(self, inner, refused: dict[str, tuple[str, ...]], allowed: frozenset[str]) -> None:
        self.inner, self.refused, self.allowed = inner, refused, allowed

    def find_spec(self, name, path=None, target=None):
        find = getattr(self.inner, "find_spec", None)
        spec = None if find is None else find(name, path, target)
        # top-level names only: a hidden package's submodules cannot be reached without it
        hidden = self.refused.get(name)
        if (
            spec is not None
            and hidden is not None
            and any(place.startswith(hidden) for place in _found_at(spec))
        ):
            return None
        return spec

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
    refused = {module: tuple(paths) for module, paths in guard["refused_modules"].items()}
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
