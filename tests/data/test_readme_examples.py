"""The Python examples in packages/rl-data/README.md run as written, in order, in one namespace
(tests/data/readme_driver.py): here, and in a process that sees only what `pip install rl-data`
installs (rl-data alone, the way a team's own supervised loop uses it)."""

from __future__ import annotations

import pathlib
import sys

import pytest

from tests.data.readme_driver import run_examples

README = pathlib.Path(__file__).resolve().parents[2] / "packages" / "rl-data" / "README.md"
DRIVER = pathlib.Path(__file__).with_name("readme_driver.py")


def test_readme_examples_run_in_order(tmp_path):
    run_examples(README, tmp_path)


@pytest.mark.slow
def test_readme_examples_run_with_only_rl_datas_declared_dependencies(tmp_path):
    from tests.test_declared_dependencies import run_declared_only

    (tmp_path / "work").mkdir()
    result = run_declared_only(
        tmp_path, "rl-data", [sys.executable, str(DRIVER), str(README), str(tmp_path / "work")]
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.strip().endswith("ok"), result.stdout[-2000:]
