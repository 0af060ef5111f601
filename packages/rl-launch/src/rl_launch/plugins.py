"""Plugins: user modules that register components with `rl_algos`' registries, in every process.

A plugin is a module whose import registers an advantage estimator, a policy loss (or anything
else kept in a registry) as a side effect::

    # my_plugin.py
    from rl_algos import POLICY_LOSSES

    @POLICY_LOSSES.register("my_loss")
    def my_loss(logprobs, old_logprobs, advantages, action_mask, *, epsilon: float = 0.2): ...

`rl-launch ppo --plugin my_plugin --algo.policy.loss my_loss` names it by module or by file
(`--plugin path/to/my_plugin.py`). The name must then resolve in the driver, which checks the
configuration and computes advantages, and in every Ray actor, which looks the loss up in its own
process. So the driver resolves each plugin once (`resolve_plugins`) to a `PluginRef` that
names the same module in any process whatever its working directory or `sys.path`, and every
process imports the refs (`import_plugins`), each at most once: importing a module twice would
register its names twice, which the registries refuse.

- A module name (`my_pkg.my_plugin`) is looked up on `sys.path`, then in the working directory.
  The ref keeps the folder it was found under, which an actor adds to its `sys.path` if it
  cannot import the name otherwise (an actor need not share the driver's working directory).
- A file (`path/to/my_plugin.py`: a spec ending in `.py` or holding a `/`) is imported from its
  absolute path as the module `rl_launch_plugin_<stem>` in every process. It should be
  self-contained: its folder is not added to `sys.path` (make it a module on `PYTHONPATH` to
  import siblings). On a multi-node cluster the file must be at the same path on every node.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys
import traceback
from collections.abc import Iterable, Sequence
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType

import msgspec

__all__ = ["FILE_MODULE_PREFIX", "PluginError", "PluginRef", "import_plugins", "resolve_plugins"]

FILE_MODULE_PREFIX = "rl_launch_plugin_"
"""A plugin given as a file is imported as the module `FILE_MODULE_PREFIX + <file stem>`."""


class PluginError(ValueError):
    """A plugin that cannot be found or imported; the message starts with `plugins[<i>]: <spec>:`."""


class PluginRef(msgspec.Struct, frozen=True, kw_only=True):
    """One resolved plugin: what any process needs to import it (travels in the actors' specs)."""

    spec: str
    """The plugin as the user gave it (a module name or a file path), for messages."""
    module: str
    """The name it is imported under, the same in every process."""
    path: str | None = None
    """Absolute path of its source file; None for a module without one (built-in, namespace)."""
    search_path: str | None = None
    """For a module name: the folder under which `module` is importable; None: already on `sys.path`."""
    from_file: bool = False
    """True: import `path` as `module`; False: import `module` by name."""


def resolve_plugins(specs: Iterable[str]) -> tuple[PluginRef, ...]:
    """Resolve the `plugins` of a configuration, in the driver; nothing is imported but parent packages.

    Args:
      specs: module names (`my_pkg.my_plugin`) or paths of `.py` files, relative to the working
        directory or absolute.

    Returns:
      One `PluginRef` per spec, in order; pass them to `import_plugins` in every process.

    Raises:
      PluginError: `plugins[<i>]: <spec>: ...` for a module that is not found (with where it was
        looked for), a file that does not exist, a parent package whose import raised, or two
        plugins that would be imported under one name or one file under two names.
    """
    importlib.invalidate_caches()  # a plugin file written since this process started is seen
    refs: list[PluginRef] = []
    for index, spec in enumerate(specs):
        if not isinstance(spec, str) or not spec.strip():
            raise PluginError(
                f"plugins[{index}]: {spec!r}: expected a module name (my_pkg.my_plugin) or a .py file path"
            )
        ref = _resolve_file(index, spec) if _is_path(spec) else _resolve_module(index, spec)
        _check_unique(index, ref, refs)
        refs.append(ref)
    return tuple(refs)


def import_plugins(refs: Sequence[PluginRef]) -> list[ModuleType]:
    """Import every plugin in this process (at most once each); their registrations happen here.

    A module already imported under `ref.module` is returned as it is, so calling this again with
    the same refs (or in the driver after `resolve_plugins`) registers nothing twice.

    Returns:
      The plugin modules, in the order of `refs`.

    Raises:
      PluginError: `plugins[<i>]: <spec>: ...` for a module or file not found in this process, or
        an import that raised (its exception type, message and line).
    """
    modules = []
    for index, ref in enumerate(refs):
        module = sys.modules.get(ref.module)
        if module is None:
            module = _load_file(index, ref) if ref.from_file else _import_by_name(index, ref)
        elif ref.from_file and ref.path is not None and _same_file(module, ref.path) is False:
            raise _error(
                index,
                ref.spec,
                f"the module name {ref.module} is already taken in this process by {module.__file__}; "
                "rename one of the two files",
            )
        modules.append(module)
    return modules


# ----------------------------------------------------------------------------- resolving


def _is_path(spec: str) -> bool:
    separators = {"/", os.sep} | ({os.altsep} if os.altsep else set())
    return spec.endswith(".py") or any(sep in spec for sep in separators)


def _error(index: int, spec: str, problem: str) -> PluginError:
    return PluginError(f"plugins[{index}]: {spec}: {problem}")


def _resolve_file(index: int, spec: str) -> PluginRef:
    path = Path(spec).expanduser()
    if not path.is_absolute():
        path = Path.cwd() / path
    if path.suffix != ".py":
        raise _error(index, spec, f"a plugin file must be a .py file, got {path}")
    if not path.is_file():
        raise _error(
            index,
            spec,
            f"no such file {path} (read as a file path because it ends in .py or holds a '/'; "
            f"a relative path starts at the working directory {Path.cwd()})",
        )
    path = path.resolve()
    module = FILE_MODULE_PREFIX + re.sub(r"\W", "_", path.stem)
    return PluginRef(spec=spec, module=module, path=str(path), from_file=True)


def _resolve_module(index: int, spec: str) -> PluginRef:
    if not all(part.isidentifier() for part in spec.split(".")):
        raise _error(
            index,
            spec,
            "is neither a module name (dotted Python identifiers, e.g. my_pkg.my_plugin) "
            "nor a path to a .py file",
        )
    found = _find(index, spec)
    cwd = os.getcwd()
    if found is None and cwd not in _search_folders():
        # A console script's sys.path holds its own folder, not the working directory.
        sys.path.append(cwd)
        try:
            found = _find(index, spec)
        finally:
            sys.path.remove(cwd)
    if found is None:
        raise _error(
            index,
            spec,
            f"no module named {spec!r} (tried as a module name: a module must be importable from "
            f"the working directory {cwd} or PYTHONPATH; give a path ending in .py to import a file)",
        )
    path = found.origin if found.has_location else None
    return PluginRef(spec=spec, module=spec, path=path, search_path=_search_path(spec, found))


def _find(index: int, name: str) -> ModuleSpec | None:
    """`find_spec(name)`: None if it or a parent package is missing; PluginError if a parent raises."""
    try:
        return importlib.util.find_spec(name)
    except ModuleNotFoundError as error:
        if error.name is not None and (name == error.name or name.startswith(error.name + ".")):
            return None
        raise _import_failed(index, name, error, None) from error
    except Exception as error:  # a parent package's __init__ raised
        raise _import_failed(index, name, error, None) from error


def _search_folders() -> set[str]:
    return {os.path.abspath(entry or os.curdir) for entry in sys.path if isinstance(entry, str)}


def _search_path(name: str, found: ModuleSpec) -> str | None:
    """The folder F such that F/a/b/c.py (or F/a/b/c/__init__.py) is module a.b.c; None if unknown."""
    if not found.has_location or found.origin is None:
        return None
    folder = Path(found.origin).parent
    if found.submodule_search_locations is not None:  # a package: origin is a/b/c/__init__.py
        folder = folder.parent
    for part in reversed(name.split(".")[:-1]):
        if folder.name != part:  # a custom finder maps the name elsewhere: nothing to add
            return None
        folder = folder.parent
    return str(folder)


def _check_unique(index: int, ref: PluginRef, earlier: Sequence[PluginRef]) -> None:
    for other_index, other in enumerate(earlier):
        if other.module == ref.module and other.path != ref.path:
            raise _error(
                index,
                ref.spec,
                f"would be imported as {ref.module}, the name of plugins[{other_index}] ({other.path}); "
                "rename one of the two files",
            )
        if ref.path is not None and other.path == ref.path and other.module != ref.module:
            raise _error(
                index,
                ref.spec,
                f"is the file of plugins[{other_index}] ({other.spec}) under another name, so its "
                "registrations would run twice; give it once",
            )


# ----------------------------------------------------------------------------- importing


def _import_by_name(index: int, ref: PluginRef) -> ModuleType:
    found = _find(index, ref.module)
    if found is None and ref.search_path is not None and ref.search_path not in _search_folders():
        sys.path.append(ref.search_path)
        found = _find(index, ref.module)
    if found is None:
        where = f" or under {ref.search_path}" if ref.search_path is not None else ""
        raise _error(
            index,
            ref.spec,
            f"no module named {ref.module!r} in this process (pid {os.getpid()}, working directory "
            f"{os.getcwd()}): not on its sys.path{where}; a module must be importable from the "
            "working directory or PYTHONPATH",
        )
    try:
        return importlib.import_module(ref.module)
    except Exception as error:
        raise _import_failed(index, ref.spec, error, found.origin) from error


def _load_file(index: int, ref: PluginRef) -> ModuleType:
    path = Path(ref.path or "")
    if not path.is_file():
        raise _error(
            index,
            ref.spec,
            f"no such file {path} in this process (pid {os.getpid()}); on a cluster a plugin file "
            "must be at the same path on every node",
        )
    spec = importlib.util.spec_from_file_location(ref.module, path)
    if spec is None or spec.loader is None:
        raise _error(index, ref.spec, f"cannot be imported from {path}")
    module = importlib.util.module_from_spec(spec)
    # In sys.modules before it runs, as `import` does: pickle and dataclasses look the module up.
    sys.modules[ref.module] = module
    try:
        spec.loader.exec_module(module)
    except BaseException as error:
        del sys.modules[ref.module]
        if isinstance(error, Exception):
            raise _import_failed(index, ref.spec, error, str(path)) from error
        raise
    return module


def _import_failed(index: int, spec: str, error: BaseException, origin: str | None) -> PluginError:
    where = ""
    if origin is not None:
        lines = [frame for frame in traceback.extract_tb(error.__traceback__) if frame.filename == origin]
        if lines:
            where = f" (at {origin}:{lines[-1].lineno})"
    return _error(index, spec, f"importing it raised {type(error).__name__}: {error}{where}")


def _same_file(module: ModuleType, path: str) -> bool | None:
    """Whether `module` was loaded from `path`; None when it has no file to compare."""
    file = getattr(module, "__file__", None)
    if file is None:
        return None
    return os.path.realpath(file) == os.path.realpath(path)
