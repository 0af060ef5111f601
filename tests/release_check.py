"""Release check: each package builds as a wheel and an sdist whose metadata is what we publish.

    python tests/release_check.py                    # build all five, check them
    python tests/release_check.py --install rl-algos # and install that wheel alone in a fresh venv

For every package under packages/ it builds the wheel and the sdist with hatchling (into a
temporary folder, or --out) and checks, reading the built files only (nothing is installed):

- the wheel's name and version (the version equals src/<import>/__about__.py, and CHANGELOG.md's
  newest entry is that version);
- the README as the long description (text/markdown);
- every requirement on a sibling package bounded on both sides (`rl-data>=0.2,<0.3`: under 1.0 a
  minor release may break) and satisfied by the sibling's own version in this workspace (the
  hatch workspace installs the members editable: pip refuses a range that excludes them);
- no upper pin on torch (the user's trainer picks its torch);
- the wheel holds its own import package and its .dist-info, nothing else;
- the license and classifiers the pyproject declares;
- the sdist holds pyproject.toml, README.md, CHANGELOG.md and the import package.

`--install DIST` then makes a fresh virtual environment (`python -m venv`, no site packages),
installs torch==2.13.0 and that wheel alone, and runs the first Python example of the package's
README there (rl-algos: the proof that it needs torch and nothing else). The slow release test then
adds TRL to that venv and runs rl-algos' "Coming from TRL" classes inside TRL's GRPOTrainer
(`install_trl_and_run_recipe`, tests/trl_recipe_driver.py).

Builder: hatchling in this interpreter if it has it, else `hatch build` (hatch on PATH: CI
installs it to run the suite).
"""

from __future__ import annotations

import argparse
import email.message
import email.parser
import importlib.util
import itertools
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from dataclasses import dataclass

import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = {"rl-algos": "rl_algos", "rl-data": "rl_data", "rl-rollout": "rl_rollout",
            "rl-learner": "rl_learner", "rl-launch": "rl_launch"}  # fmt: skip
TORCH_PIN = "torch==2.13.0"  # what every environment of this workspace installs (pyproject.toml)
_LOWER = {">=", ">", "==", "~=", "==="}
_UPPER = {"<", "<=", "==", "~=", "==="}


class ReleaseCheckError(RuntimeError):
    """A package that cannot be built or installed as released."""


@dataclass(frozen=True)
class Built:
    distribution: str
    wheel: pathlib.Path
    sdist: pathlib.Path


def package_dir(distribution: str) -> pathlib.Path:
    return ROOT / "packages" / distribution


def workspace_version(distribution: str) -> str:
    """The version in src/<import>/__about__.py (read as text: nothing imported)."""
    path = package_dir(distribution) / "src" / PACKAGES[distribution] / "__about__.py"
    match = re.search(r'^__version__\s*=\s*"([^"]+)"', path.read_text(), re.M)
    if match is None:
        raise ReleaseCheckError(f'{path}: no __version__ = "..." line')
    return match.group(1)


def _has_hatchling(python: str) -> bool:
    if python == sys.executable:
        return importlib.util.find_spec("hatchling") is not None
    probe = [python, "-c", "import hatchling"]
    return pathlib.Path(python).exists() and subprocess.run(probe, capture_output=True).returncode == 0


def builder_command() -> list[str]:
    """hatchling in this interpreter or in the one its virtual environment was made from (where
    `pip install hatch` put it), else `hatch build`."""
    base = str(pathlib.Path(sys.base_prefix) / "bin" / pathlib.Path(sys.executable).name)
    for python in (sys.executable, base):
        if _has_hatchling(python):
            return [python, "-m", "hatchling", "build", "-t", "wheel", "-t", "sdist", "-d"]
    hatch = shutil.which("hatch")
    if hatch is not None:
        return [hatch, "build", "-t", "wheel", "-t", "sdist"]
    raise ReleaseCheckError(
        "no builder: this Python has no hatchling and no `hatch` is on PATH "
        "(pip install hatchling, or hatch as CI does)"
    )


def build(distribution: str, out: pathlib.Path) -> Built:
    """The wheel and the sdist of one package, built into out/<distribution>/."""
    target = out / distribution
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    command = [*builder_command(), str(target)]
    result = subprocess.run(command, cwd=package_dir(distribution), capture_output=True, text=True)
    if result.returncode != 0:
        raise ReleaseCheckError(
            f"{distribution}: {' '.join(command)} failed ({result.returncode}):\n{result.stdout}{result.stderr}"
        )
    wheels, sdists = sorted(target.glob("*.whl")), sorted(target.glob("*.tar.gz"))
    if len(wheels) != 1 or len(sdists) != 1:
        raise ReleaseCheckError(
            f"{distribution}: expected one wheel and one sdist in {target}, got {wheels + sdists}"
        )
    return Built(distribution, wheels[0], sdists[0])


def wheel_metadata(wheel: pathlib.Path) -> tuple[email.message.Message, list[str]]:
    """The wheel's METADATA and the names of its files."""
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        (metadata_name,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        text = archive.read(metadata_name).decode()
    return email.parser.Parser().parsestr(text), names


def _bounds(requirement: Requirement) -> tuple[bool, bool]:
    operators = {spec.operator for spec in requirement.specifier}
    return bool(operators & _LOWER), bool(operators & _UPPER)


def check_requirements(distribution: str, requires: list[str]) -> list[str]:
    """Siblings bounded on both sides and satisfied by the workspace; torch not capped."""
    problems = []
    for line in requires:
        requirement = Requirement(line)
        name = canonicalize_name(requirement.name)
        lower, upper = _bounds(requirement)
        if name in PACKAGES:
            if not (lower and upper):
                problems.append(
                    f"{distribution}: Requires-Dist {line!r}: a sibling needs a lower and an upper bound "
                    f"(e.g. {name}>=0.2,<0.3)"
                )
            version = workspace_version(name)
            if not requirement.specifier.contains(version, prereleases=True):
                problems.append(
                    f"{distribution}: Requires-Dist {line!r} excludes the workspace's {name} {version} "
                    f"(packages/{name}/src/{PACKAGES[name]}/__about__.py): pip refuses the editable install"
                )
        elif name == "torch" and upper:
            problems.append(f"{distribution}: Requires-Dist {line!r}: torch must have no upper pin")
    return problems


def check_changelog(distribution: str, version: str) -> list[str]:
    """CHANGELOG.md exists and its newest entry is this version."""
    path = package_dir(distribution) / "CHANGELOG.md"
    if not path.is_file():
        return [f"{distribution}: no CHANGELOG.md in {path.parent}"]
    entries = re.findall(r"^## \[([^\]]+)\]", path.read_text(), re.M)
    if not entries or entries[0] != version:
        return [f"{distribution}: CHANGELOG.md's newest entry is {entries[:1]}, the version is {version}"]
    if any(Version(a) <= Version(b) for a, b in itertools.pairwise(entries)):
        return [f"{distribution}: CHANGELOG.md's entries are not newest first: {entries}"]
    return []


def check_wheel(built: Built) -> list[str]:
    """The wheel's metadata and files."""
    distribution, import_name = built.distribution, PACKAGES[built.distribution]
    project = tomllib.loads((package_dir(distribution) / "pyproject.toml").read_text())["project"]
    meta, names = wheel_metadata(built.wheel)
    version = workspace_version(distribution)
    where = f"{distribution} ({built.wheel.name})"
    problems = []
    if canonicalize_name(meta["Name"]) != distribution:
        problems.append(f"{where}: Name {meta['Name']!r}, expected {distribution!r}")
    if meta["Version"] != version:
        problems.append(f"{where}: Version {meta['Version']!r}, __about__.py says {version!r}")
    readme = (package_dir(distribution) / "README.md").read_text()
    if (
        meta.get("Description-Content-Type") != "text/markdown"
        or meta.get_payload().strip() != readme.strip()
    ):
        problems.append(f"{where}: the long description is not README.md as text/markdown")
    problems += check_requirements(distribution, meta.get_all("Requires-Dist") or [])
    dist_info = f"{import_name}-{version}.dist-info/"
    strays = [n for n in names if not (n.startswith(f"{import_name}/") or n.startswith(dist_info))]
    if strays:
        problems.append(f"{where}: files outside {import_name}/ and {dist_info}: {strays[:10]}")
    if f"{import_name}/__init__.py" not in names:
        problems.append(f"{where}: no {import_name}/__init__.py")
    if "license" in project and (meta.get("License-Expression") or meta.get("License")) != project["license"]:
        problems.append(f"{where}: the license {project['license']!r} is not in the metadata")
    if sorted(meta.get_all("Classifier") or []) != sorted(project.get("classifiers", [])):
        problems.append(f"{where}: classifiers differ from pyproject.toml's")
    return problems


def check_sdist(built: Built) -> list[str]:
    """The sdist holds what a rebuild needs."""
    import_name, version = PACKAGES[built.distribution], workspace_version(built.distribution)
    with tarfile.open(built.sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    needed = {"pyproject.toml", "README.md", "CHANGELOG.md", "PKG-INFO", f"src/{import_name}/__init__.py"}
    problems = [f"{built.distribution} ({built.sdist.name}): no {name}" for name in sorted(needed - names)]
    if built.sdist.name != f"{import_name}-{version}.tar.gz":
        problems.append(
            f"{built.distribution}: sdist named {built.sdist.name}, expected {import_name}-{version}.tar.gz"
        )
    return problems


def check_all(
    out: pathlib.Path, distributions: list[str] | None = None
) -> tuple[dict[str, Built], list[str]]:
    """Build and check every package; the builds and every problem found."""
    built, problems = {}, []
    for distribution in distributions or list(PACKAGES):
        built[distribution] = build(distribution, out)
        problems += check_changelog(distribution, workspace_version(distribution))
        problems += check_wheel(built[distribution])
        problems += check_sdist(built[distribution])
    return built, problems


# The fresh-venv check: one wheel, torch, nothing else.

_EXAMPLE_DRIVER = r"""
import importlib.util, pathlib, sys
import torch
import {import_name}
others = [name for name in {others!r} if importlib.util.find_spec(name) is not None]
assert not others, f"the venv holds sibling packages: {{others}}"
inputs = {{}}
{setup}
namespace = dict(inputs)
exec(compile(pathlib.Path(sys.argv[1]).read_text(), "README.md (first python block)", "exec"), namespace)
{verify}
print("ok", {import_name}.__version__, {import_name}.__file__)
"""

# Per package: the names the README's first example reads, and what it must leave behind.
_EXAMPLE_INPUTS = {
    "rl-algos": (
        """
gen = torch.Generator().manual_seed(0)
mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
logits = torch.randn(4, 5, 11, generator=gen, requires_grad=True)
labels = torch.randint(0, 11, (4, 5), generator=gen)
inputs.update(
    rewards=torch.tensor([1.0, 0.0, 1.0, 0.0]), group_ids=torch.tensor([0, 0, 1, 1]), mask=mask,
    old_logprobs=torch.log_softmax(logits.detach(), -1).gather(-1, labels[..., None]).squeeze(-1),
    ref_logprobs=-torch.rand(4, 5, generator=gen), values=torch.randn(4, 5, generator=gen),
    logits=logits, labels=labels,
    global_token_count=rl_algos.loss_normalizer(mask, "token-mean"),
)
""",
        """
loss = namespace["loss"]
assert loss.dim() == 0 and torch.isfinite(loss), loss
loss.backward()
assert namespace["logits"].grad.abs().sum() > 0
""",
    ),
}


def first_python_block(distribution: str) -> str:
    text = (package_dir(distribution) / "README.md").read_text()
    match = re.search(r"```python\n(.+?)```", text, re.S)
    if match is None:
        raise ReleaseCheckError(f"packages/{distribution}/README.md has no ```python block")
    return match.group(1)


def install_alone(built: Built, folder: pathlib.Path) -> str:
    """A fresh venv in folder with torch and this wheel only; the README's first example run in
    it. Returns the example's output line."""
    if built.distribution not in _EXAMPLE_INPUTS:
        raise ReleaseCheckError(
            f"no README example inputs for {built.distribution}: {sorted(_EXAMPLE_INPUTS)}"
        )
    import_name = PACKAGES[built.distribution]
    setup, verify = _EXAMPLE_INPUTS[built.distribution]
    env = _clean_env()
    venv = folder / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], env, folder)
    python = str(venv / "bin" / "python")
    _run([python, "-m", "pip", "install", "-q", "--no-compile", TORCH_PIN, str(built.wheel)], env, folder)
    example = folder / "example.py"
    example.write_text(first_python_block(built.distribution))
    driver = folder / "driver.py"
    others = tuple(name for name in PACKAGES.values() if name != import_name)
    driver.write_text(
        _EXAMPLE_DRIVER.format(import_name=import_name, others=others, setup=setup, verify=verify)
    )
    return _run([python, str(driver), str(example)], env, folder).strip().splitlines()[-1]


# rl-algos' README "Coming from TRL" classes inside TRL: the venv of `install_alone` plus TRL and
# the transformers of this environment; tests/trl_recipe_driver.py trains a tiny local model there.
TRL_PIN = "trl==1.16.0"


def install_trl_and_run_recipe(folder: pathlib.Path, checkpoint: pathlib.Path) -> tuple[float, list[str]]:
    """Into the venv `install_alone` left in folder: TRL_PIN and this environment's transformers;
    then the README's TRL classes trained inside TRL on the checkpoint (offline). Returns the
    seconds the install took and the driver's `ok ...` lines."""
    from importlib.metadata import version

    env = _clean_env()
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HOME=str(folder / "hf"))
    python = str(folder / "venv" / "bin" / "python")
    pins = [TORCH_PIN, TRL_PIN, f"transformers=={version('transformers')}"]
    start = time.monotonic()
    _run([python, "-m", "pip", "install", "-q", "--no-compile", *pins], env, folder)
    installed = time.monotonic() - start
    driver = ROOT / "tests" / "trl_recipe_driver.py"
    readme = package_dir("rl-algos") / "README.md"
    command = [python, str(driver), str(readme), str(checkpoint), str(folder / "trl-out")]
    output = _run(command, env, folder)
    return installed, [line for line in output.splitlines() if line.startswith("ok ")]


# What this process's environment must not pass to a fresh venv's processes: its interpreter's
# paths, and torch.distributed's rendezvous variables (a learner test in the same pytest worker
# leaves LOCAL_RANK=0 set, and accelerate, under TRL's GRPOConfig, then starts a process group).
_NOT_PASSED = (
    "PYTHONPATH",
    "VIRTUAL_ENV",
    "PYTHONHOME",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
)
_NOT_PASSED += ("GROUP_RANK", "ROLE_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def _clean_env() -> dict[str, str]:
    """os.environ without `_NOT_PASSED` and accelerate's own ACCELERATE_* settings."""
    return {k: v for k, v in os.environ.items() if k not in _NOT_PASSED and not k.startswith("ACCELERATE_")}


def _run(command: list[str], env: dict[str, str], cwd: pathlib.Path, timeout: float = 900) -> str:
    try:
        result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as error:
        raise ReleaseCheckError(f"{' '.join(command)} did not finish in {timeout} s") from error
    if result.returncode != 0:
        raise ReleaseCheckError(
            f"{' '.join(command)} failed ({result.returncode}):\n{result.stdout}{result.stderr}"
        )
    return result.stdout


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build every package and check what would be released.")
    parser.add_argument("--out", type=pathlib.Path, help="keep the builds here (default: a temporary folder)")
    parser.add_argument("--install", choices=sorted(_EXAMPLE_INPUTS), action="append", default=[],
                        help="also install this wheel alone in a fresh venv and run its README example")  # fmt: skip
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="release-check-") as tmp:
        out = args.out or pathlib.Path(tmp)
        built, problems = check_all(out)
        for distribution, files in built.items():
            print(f"{distribution} {workspace_version(distribution)}: {files.wheel.name}, {files.sdist.name}")
        for distribution in args.install:
            folder = out / f"venv-{distribution}"
            folder.mkdir(exist_ok=True)
            print(f"{distribution} alone in a fresh venv: {install_alone(built[distribution], folder)}")
    for problem in problems:
        print(f"PROBLEM {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
