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
        # safetensors: a LoRA adapter version written as a peft folder (rl_data.adapters)
        {"torch", "msgspec", "numpy", "transformers", "tokenizers", "datasets", "PIL", "safetensors"},
        {"torch", "msgspec", "numpy", "transformers", "tokenizers", "datasets", "pillow", "safetensors"},
    ),
    "rl_rollout": (
        # fastapi / starlette / uvicorn / openai: the `agents` extra (the agent server); peft: the
        # `peft` extra (HFEngine serving a LoRA adapter, rl_rollout.adapters); reasoning_gym: the
        # `reasoning-gym` extra (rl_rollout.reasoning_gym); verifiers: the `verifiers` extra
        # (rl_rollout.verifiers_env, rl_rollout.verifiers_episode)
        {"torch", "msgspec", "numpy", "rl_data", "rl_algos", "transformers", "vllm", "peft"}
        | {"fastapi", "starlette", "uvicorn", "openai", "reasoning_gym", "verifiers"},
        {
            "torch",
            "msgspec",
            "rl-data",
            "rl-algos",
            "transformers",
            "vllm",
            "fastapi",
            "uvicorn",
            "openai",
            "peft",
            "reasoning-gym",
            "verifiers",
        },
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


def _module_names(package: str) -> dict[str, pathlib.Path]:
    """Dotted module name -> file, for every module of `package` (a package is its __init__)."""
    source = ROOT / "packages" / DISTRIBUTIONS[package] / "src"
    names = {}
    for path in sorted((source / package).rglob("*.py")):
        parts = list(path.relative_to(source).with_suffix("").parts)
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _type_checking_only(tree: ast.AST) -> set[int]:
    """The ids of the nodes under `if TYPE_CHECKING:` (never imported at run time)."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else getattr(test, "attr", None)
            if name == "TYPE_CHECKING":
                skipped |= {id(sub) for child in node.body for sub in ast.walk(child)}
    return skipped


def intra_package_imports(package: str) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports, at module level or inside a function.

    `from .x import name` counts as an import of `x.name` when that is a module, else of `x`.
    Importing `a.b.c` runs `a.b`'s __init__ first, so from a module outside `a.b` it is an
    import of `a.b` too (a module inside `a.b` is imported by that __init__, not the reverse)."""
    modules = _module_names(package)

    def known(name: str) -> str:
        while name not in modules:
            name = name.rsplit(".", 1)[0]
        return name

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        skipped = _type_checking_only(tree)
        here = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        targets: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.Import):
                targets |= {known(a.name) for a in node.names if a.name.split(".")[0] == package}
            elif isinstance(node, ast.ImportFrom):
                base = here.split(".")[: len(here.split(".")) - node.level + 1] if node.level else []
                module = ".".join([*base, *([node.module] if node.module else [])])
                if module.split(".")[0] == package:
                    targets |= {known(f"{module}.{a.name}") for a in node.names}
        for target in list(targets):
            parts = target.split(".")
            for cut in range(2, len(parts)):
                parent = ".".join(parts[:cut])
                if parent in modules and not (name == parent or name.startswith(parent + ".")):
                    targets.add(parent)
        graph[name] = targets - {name}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in sorted(graph.get(module, ())):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return cycles


def test_the_cycle_finder_finds_a_cycle_through_a_function_level_import():
    graph = {"p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a"}, "p.d": {"p.a"}}
    assert import_cycles(graph) == [["p.a", "p.b", "p.c"]]
    assert import_cycles({"p.a": {"p.b"}, "p.b": set()}) == []


@pytest.mark.parametrize("package", BUILT)
def test_no_import_cycle_inside_a_package(package):
    # Function-level imports included: a cycle hidden behind one still ties the modules into one
    # piece that cannot be read, tested or replaced alone (registries go in their own base modules).
    graph = intra_package_imports(package)
    assert len(graph) > 1
    cycles = import_cycles(graph)
    assert cycles == [], [
        {module: sorted(graph[module] & set(cycle)) for module in cycle} for cycle in cycles
    ]
