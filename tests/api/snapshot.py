"""The public API of each package as text, one committed file per package (tests/api/<import>.txt).

The public names are the `__all__` of the package and of each public submodule (no path part
starting with `_`); each is listed with its signature (`inspect.signature`), a class with its
constructor and its public methods and properties, a name registry (a dict with string keys, a
tuple or frozenset of strings) with its entries. tests/test_release.py regenerates the text and
fails with a diff when it changed: a reviewer then sees what moved, updates the file

    python tests/api/snapshot.py --write

and bumps the version as the package's CHANGELOG.md says (0.x: a minor for a break, a patch
never breaks).
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import inspect
import pathlib
import pkgutil
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
FOLDER = pathlib.Path(__file__).resolve().parent
PACKAGES = {"rl-algos": "rl_algos", "rl-data": "rl_data", "rl-rollout": "rl_rollout",
            "rl-learner": "rl_learner", "rl-launch": "rl_launch"}  # fmt: skip
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def public_modules(package: str) -> list[str]:
    """The package and every submodule with no path part starting with `_`, sorted."""
    root = importlib.import_module(package)
    names = [package]
    for info in pkgutil.walk_packages(root.__path__, prefix=f"{package}."):
        if not any(part.startswith("_") for part in info.name.split(".")[1:]):
            names.append(info.name)
    return sorted(names)


def _signature(obj: object) -> str:
    try:
        text = str(inspect.signature(obj))
    except (TypeError, ValueError):
        return "(...)"
    return _ADDRESS.sub("", text)


def _members(cls: type) -> list[str]:
    """A class's own public methods and properties (and those of its bases in this project)."""
    lines = []
    for name in sorted(dir(cls)):
        if name.startswith("_"):
            continue
        owner = next((base for base in cls.__mro__ if name in vars(base)), None)
        if owner is None or not owner.__module__.startswith("rl_"):
            continue
        value = inspect.getattr_static(cls, name)
        if isinstance(value, property):
            lines.append(f"    .{name}: property")
        elif isinstance(value, (staticmethod, classmethod)):
            lines.append(f"    .{name}{_signature(getattr(cls, name))}  [{type(value).__name__}]")
        elif inspect.isfunction(value):
            lines.append(f"    .{name}{_signature(value)}")
    return lines


def _entries(value: object) -> str | None:
    """A registry's names: a dict with string keys, or a tuple / frozenset / set of strings."""
    if isinstance(value, dict) and value and all(isinstance(k, str) for k in value):
        return ", ".join(sorted(value))
    if isinstance(value, (tuple, frozenset, set)) and value and all(isinstance(v, str) for v in value):
        return ", ".join(sorted(value) if not isinstance(value, tuple) else value)
    return None


def describe(name: str, value: object) -> list[str]:
    """The lines of one public name."""
    if inspect.isclass(value):
        return [f"  class {name}{_signature(value)}", *_members(value)]
    if inspect.ismodule(value):
        return [f"  module {name}"]
    if callable(value):
        return [f"  def {name}{_signature(value)}"]
    entries = _entries(value)
    if entries is not None:
        return [f"  {name}: {type(value).__name__} [{entries}]"]
    return [f"  {name}: {type(value).__name__}"]


def snapshot(package: str) -> str:
    """The API text of one import package."""
    lines = [
        f"# Public API of {package}: regenerate with `python tests/api/snapshot.py --write`;",
        "# a change here is a change of the API: bump the version as CHANGELOG.md says.",
    ]
    for module_name in public_modules(package):
        module = importlib.import_module(module_name)
        exported = getattr(module, "__all__", None)
        if exported is None:
            lines.append(f"\n{module_name} (no __all__)")
            continue
        lines.append(f"\n{module_name}")
        for name in sorted(exported):
            if name == "__version__":
                continue  # the version moves with every release; CHANGELOG.md records it
            lines += describe(name, getattr(module, name))
    return "\n".join(lines) + "\n"


def snapshot_path(package: str, folder: pathlib.Path = FOLDER) -> pathlib.Path:
    return folder / f"{package}.txt"


def diff(package: str, folder: pathlib.Path = FOLDER) -> str:
    """A unified diff from the committed file to the API as it is now ('' when equal)."""
    path = snapshot_path(package, folder)
    old = path.read_text() if path.exists() else ""
    new = snapshot(package)
    label = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    return "".join(
        difflib.unified_diff(
            old.splitlines(keepends=True),
            new.splitlines(keepends=True),
            f"{label} (committed)",
            f"{label} (now)",
        )
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite the committed files")
    parser.add_argument("--folder", type=pathlib.Path, default=FOLDER, help="where the files are (tests/api)")
    parser.add_argument("packages", nargs="*", default=list(PACKAGES.values()), help="import names")
    args = parser.parse_args(argv)
    changed = 0
    for package in args.packages:
        if args.write:
            snapshot_path(package, args.folder).write_text(snapshot(package))
            print(f"wrote {snapshot_path(package, args.folder)}")
            continue
        text = diff(package, args.folder)
        if text:
            changed += 1
            sys.stdout.write(text)
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
