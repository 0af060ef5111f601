"""The dependency rules of the design card hold for every package that exists.

DESIGN.md: arrows only point down the package table; `rl_algos` imports torch and the standard
library only; `rl_rollout` and `rl_learner` never import each other; nothing imports `rl_launch`.
Each package's modules may import the standard library, its own package and the distributions
listed here; its pyproject may declare only those.
"""

from __future__ import annotations

import ast
import importlib.metadata
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# import name -> (allowed third-party / sibling imports, allowed declared distributions)
ALLOWED: dict[str, tuple[set[str], set[str]]] = {
    "rl_algos": ({"torch"}, {"torch"}),
    "rl_data": (
        # PIL / pillow: the `vision` extra (images of VL prompts, rl_data.vision)
        {"torch", "msgspec", "numpy", "transformers", "tokenizers", "datasets", "PIL"},
        {"torch", "msgspec", "numpy", "transformers", "tokenizers", "datasets", "pillow"},
    ),
    "rl_rollout": (
        # fastapi / starlette / uvicorn / openai: the `agents` extra (the agent server)
        {"torch", "msgspec", "numpy", "rl_data", "rl_algos", "transformers", "vllm"}
        | {"fastapi", "starlette", "uvicorn", "openai"},
        {"torch", "msgspec", "rl-data", "rl-algos", "transformers", "vllm", "fastapi", "uvicorn", "openai"},
    ),
    "rl_learner": (
        {
            "torch",
            "msgspec",
            "numpy",
            "rl_data",
            "rl_algos",
            "deepspeed",
            "transformers",
            "peft",
            "safetensors",
        },
        {"torch", "rl-data", "rl-algos", "deepspeed", "transformers", "accelerate", "peft"},
    ),
    "rl_launch": (
        {
            "torch",
            "msgspec",
            "numpy",
            "rl_data",
            "rl_algos",
            "rl_rollout",
            "rl_learner",
            "ray",
            "yaml",
            "tqdm",
            "matplotlib",
            "transformers",
            "huggingface_hub",
            "datasets",
            "tensorboard",
            "wandb",
            "PIL",
        },
        {
            "torch",
            "rl-data",
            "rl-algos",
            "rl-rollout",
            "rl-learner",
            "ray",
            "msgspec",
            "pyyaml",
            "tqdm",
            "matplotlib",
            "huggingface-hub",
            "datasets",
            "transformers",
            "tensorboard",
            "wandb",
            "pillow",
        },
    ),
}
# What `import <package>` may load beyond torch: heavy optional pieces load where they are used.
LIGHT_IMPORT: dict[str, set[str]] = {
    "rl_algos": set(),
    "rl_data": {"msgspec", "numpy"},
    "rl_rollout": {"msgspec", "numpy", "rl_data", "rl_algos"},
    "rl_learner": {"msgspec", "numpy", "rl_data", "rl_algos"},
    "rl_launch": set(),
}
DISTRIBUTIONS = {
    "rl_algos": "rl-algos",
    "rl_data": "rl-data",
    "rl_rollout": "rl-rollout",
    "rl_learner": "rl-learner",
    "rl_launch": "rl-launch",
}
BUILT = [name for name, dist in DISTRIBUTIONS.items() if (ROOT / "packages" / dist).is_dir()]


def imported_top_level_names(path: pathlib.Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name.split(".")[0] for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.append((node.module or "").split(".")[0])
    return names


@pytest.mark.parametrize("package", BUILT)
def test_modules_import_only_the_standard_library_themselves_and_allowed_packages(package):
    allowed = set(sys.stdlib_module_names) | {package, "__future__"} | ALLOWED[package][0]
    modules = sorted((ROOT / "packages" / DISTRIBUTIONS[package] / "src" / package).rglob("*.py"))
    assert modules
    offenders = [
        f"{path.relative_to(ROOT)}: {name}"
        for path in modules
        for name in imported_top_level_names(path)
        if name not in allowed
    ]
    assert offenders == []


@pytest.mark.parametrize("package", BUILT)
def test_declared_dependencies_are_the_allowed_ones(package):
    requirements = importlib.metadata.requires(DISTRIBUTIONS[package]) or []
    names = {re.split(r"[\s;\[<>=!~]", requirement, maxsplit=1)[0] for requirement in requirements}
    assert names <= ALLOWED[package][1], names - ALLOWED[package][1]
    assert "torch" in names


@pytest.mark.parametrize("package", BUILT)
def test_import_in_a_fresh_interpreter_stays_light(package):
    # A top-level module that `import <package>` loads beyond what `import torch` loads is a
    # hidden cost (transformers and datasets take seconds): they must load where they are used.
    probe = (
        "import sys; import torch; before = {m.split('.')[0] for m in sys.modules}; "
        f"import {package}; after = {{m.split('.')[0] for m in sys.modules}}; "
        f"print(sorted(after - before - {{{package!r}}}))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    extra = set(ast.literal_eval(out.stdout.strip())) - set(sys.stdlib_module_names)
    assert extra <= LIGHT_IMPORT[package], extra
