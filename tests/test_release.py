"""What we release is what we meant to release: tests/release_check.py on every package (the
wheels and sdists as built, their metadata, the CHANGELOGs), the public-API snapshots in
tests/api/, and rl-algos installed alone next to torch in a fresh venv (slow)."""

from __future__ import annotations

import pathlib
import re
import shutil
import subprocess
import sys
import time
import zipfile

import pytest

from tests import release_check
from tests.release_check import PACKAGES, check_requirements, check_wheel, workspace_version

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def released(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, list[str]]:
    """Every package built once for this module: (builds, problems found)."""
    return release_check.check_all(tmp_path_factory.mktemp("release"))


def test_every_package_builds_and_passes_the_release_check(released):
    built, problems = released
    assert sorted(built) == sorted(PACKAGES)
    assert problems == [], "\n".join(problems)


def test_the_script_runs_as_ci_would(tmp_path):
    result = subprocess.run(
        [sys.executable, "tests/release_check.py", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for distribution in PACKAGES:
        assert f"{distribution} {workspace_version(distribution)}:" in result.stdout


def test_sibling_requirements_need_both_bounds_and_the_workspace_version():
    data = workspace_version("rl-data")
    major, minor = (int(part) for part in data.split(".")[:2])
    bounded = f"rl-data>={major}.{minor},<{major}.{minor + 1}"
    assert check_requirements("rl-rollout", [bounded, "torch>=2.4", "msgspec>=0.19"]) == []
    (unbounded,) = check_requirements("rl-rollout", ["rl-data"])
    assert "'rl-data'" in unbounded
    assert "lower and an upper bound" in unbounded
    (no_upper,) = check_requirements("rl-rollout", [f"rl-data>={data}"])
    assert "lower and an upper bound" in no_upper
    (excluded,) = check_requirements("rl-rollout", [f"rl-data>={major}.{minor + 1},<{major}.{minor + 2}"])
    assert f"excludes the workspace's rl-data {data}" in excluded
    assert "__about__.py" in excluded


def test_torch_may_not_be_capped():
    (capped,) = check_requirements("rl-algos", ["torch>=2.4,<2.14"])
    assert "torch must have no upper pin" in capped


def test_a_wheel_with_a_stray_file_or_another_version_is_refused(released, tmp_path):
    built, _ = released
    good = built["rl-algos"]
    doctored = tmp_path / good.wheel.name
    with zipfile.ZipFile(good.wheel) as source, zipfile.ZipFile(doctored, "w") as target:
        for item in source.infolist():
            data = source.read(item)
            if item.filename.endswith("METADATA"):
                data = data.replace(f"Version: {workspace_version('rl-algos')}".encode(), b"Version: 9.9.9")
            target.writestr(item, data)
        target.writestr("tests/conftest.py", "")
    problems = check_wheel(release_check.Built("rl-algos", doctored, good.sdist))
    assert any("files outside rl_algos/" in p and "tests/conftest.py" in p for p in problems), problems
    assert any("Version '9.9.9'" in p for p in problems), problems


def test_the_changelog_names_the_version_being_released(tmp_path, monkeypatch):
    for distribution in PACKAGES:
        assert release_check.check_changelog(distribution, workspace_version(distribution)) == []
    (wrong,) = release_check.check_changelog("rl-algos", "9.9.9")
    assert "newest entry" in wrong
    assert "9.9.9" in wrong


def test_public_api_matches_the_committed_snapshots():
    # A fresh interpreter: tests in this process may have registered names in the registries.
    result = subprocess.run(
        [sys.executable, "tests/api/snapshot.py"], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, (
        "The public API changed (diff below, committed file first). If the change is meant, update "
        "the snapshot with `python tests/api/snapshot.py --write`, and bump the package's version "
        "with a CHANGELOG.md entry as its header says (0.x: a minor release for a break, a patch "
        "release never breaks).\n" + result.stdout + result.stderr
    )


def test_a_changed_signature_fails_the_snapshot_with_a_diff(tmp_path):
    committed = (ROOT / "tests" / "api" / "rl_algos.txt").read_text()
    line = next(line for line in committed.splitlines() if line.startswith("  def masked_sum("))
    (tmp_path / "rl_algos.txt").write_text(committed.replace(line, line.replace("dim:", "axis:"), 1))
    command = [sys.executable, "tests/api/snapshot.py", "--folder", str(tmp_path), "rl_algos"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"\n-{line.replace('dim:', 'axis:')}\n" in result.stdout
    assert f"\n+{line}\n" in result.stdout


@pytest.mark.slow
def test_rl_algos_installs_alone_next_to_torch_and_runs_its_readme_examples_then_inside_trl(
    released, tiny_checkpoint, tmp_path
):
    # The proof that rl-algos needs torch only: a fresh venv (no site packages) with torch and the
    # built wheel, nothing else; the README's first example runs there and trains. Then the same
    # venv gets TRL (a TRL user's environment): the README's "Coming from TRL" classes train a tiny
    # model inside TRL's GRPOTrainer, their loss and gradient equal to TRL's on every micro-batch
    # (tests/trl_recipe_driver.py).
    if shutil.which("pip") is None and not (pathlib.Path(sys.executable).parent / "pip").exists():
        pytest.skip("no pip next to this interpreter")
    built, _ = released
    start = time.monotonic()
    try:
        line = release_check.install_alone(built["rl-algos"], tmp_path)
        assert line.startswith(f"ok {workspace_version('rl-algos')} "), line
        assert str(tmp_path / "venv") in line  # imported from the venv, not from this checkout
        alone = time.monotonic()
        installed, lines = release_check.install_trl_and_run_recipe(tmp_path, tiny_checkpoint)
    finally:
        shutil.rmtree(tmp_path / "venv", ignore_errors=True)  # ~1 GB with torch
    assert [line.split(":")[0] for line in lines] == ["ok dapo/ppo", "ok cispo", "ok grpo+sequence/gspo"]
    print(f"rl-algos alone in a fresh venv: {alone - start:.1f} s; {release_check.TRL_PIN} installed "
          f"there: {installed:.1f} s; the recipe inside TRL: {time.monotonic() - alone - installed:.1f} s",
          *lines, sep="\n")  # fmt: skip


def test_the_top_readme_lists_the_versions_being_released():
    text = (ROOT / "README.md").read_text()
    section = text.split("## Versions and releases", 1)[1].split("\n## ", 1)[0]
    listed = dict(re.findall(r"^\| (rl-[a-z]+) \| (\d+\.\d+\.\d+) \|$", section, re.M))
    assert listed == {distribution: workspace_version(distribution) for distribution in PACKAGES}
