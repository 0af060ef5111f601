"""tests/prepare_environment.py: the installed packages' bytecode, compiled once per set of
installed distributions (the environments install without it: pyproject.toml, PIP_NO_COMPILE)."""

from __future__ import annotations

import importlib.util
import pathlib

from tests.prepare_environment import compile_installed


def _bytecode(path: pathlib.Path) -> pathlib.Path:
    return pathlib.Path(importlib.util.cache_from_source(str(path)))


def test_installed_modules_are_compiled_once_per_set_of_distributions(tmp_path, capfd):
    site, marker = tmp_path / "site-packages", tmp_path / "marker"
    (site / "pkg").mkdir(parents=True)
    (site / "pkg-1.0.dist-info").mkdir()
    first = site / "pkg" / "first.py"
    first.write_text("VALUE = 1\n")
    (site / "pkg" / "old.py").write_text("if x is 'literal':\n    pass\n")  # a SyntaxWarning, silenced
    (site / "pkg" / "broken.py").write_text("def (:\n")  # fails where imported, not here

    assert compile_installed(site, marker)
    assert _bytecode(first).is_file()
    assert _bytecode(site / "pkg" / "old.py").is_file()
    assert not _bytecode(site / "pkg" / "broken.py").exists()
    assert capfd.readouterr() == ("", "")  # a console free of other projects' warnings and errors

    second = site / "pkg" / "second.py"
    second.write_text("VALUE = 2\n")
    assert not compile_installed(site, marker)  # the same distributions: nothing to do
    assert not _bytecode(second).exists()

    (site / "other-2.0.dist-info").mkdir()  # a distribution installed since
    assert compile_installed(site, marker)
    assert _bytecode(second).is_file()
