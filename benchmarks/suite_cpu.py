"""Where the test suite's CPU goes: every test run one after the other, the machine's busy CPU-seconds
counted around each (its subprocesses, Ray actors and engines included), summed per file.

    python benchmarks/suite_cpu.py [--out FILE.tsv] [--top N] [-- PYTEST ARGS]     (e.g. -- -m slow)
    python benchmarks/suite_cpu.py --parse FILE.tsv [--top N]

The suite runs on 2 cores with `-n 2` and both cores busy nearly all of it, so its wall time is
about its CPU-seconds over two: a file's CPU-seconds here are what cutting it would save, which
pytest's --durations under `-n 2` do not say (a test's time there is mostly the other worker's
load). Counted from /proc/stat (Linux), so run nothing else meanwhile: a full serial run takes
~25 minutes. Run it in the test environment (`hatch run hatch-test.py3.11:python benchmarks/...`
or the environment's python), from the repository root.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def busy_seconds() -> float:
    """CPU-seconds the whole machine has spent busy since boot (user, nice, system, irq, softirq)."""
    with open("/proc/stat") as stat:
        ticks = [int(value) for value in stat.readline().split()[1:8]]
    user, nice, system, _idle, _iowait, irq, softirq = ticks
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


class CpuPerTest:
    """A pytest plugin: one line "<busy CPU-s>\\t<wall s>\\t<test id>" per test into `path`."""

    def __init__(self, path: Path) -> None:
        self.out = path.open("a")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        busy, began = busy_seconds(), time.monotonic()
        yield
        self.out.write(f"{busy_seconds() - busy:.2f}\t{time.monotonic() - began:.2f}\t{item.nodeid}\n")
        self.out.flush()


def per_file(path: Path) -> list[tuple[float, float, str]]:
    """(CPU-s, wall s, file) per test file of a result file, the costliest first."""
    cpu: dict[str, float] = collections.defaultdict(float)
    wall: dict[str, float] = collections.defaultdict(float)
    for line in path.read_text().splitlines():
        seconds, took, test = line.split("\t")
        name = test.split("::")[0]
        cpu[name] += float(seconds)
        wall[name] += float(took)
    return sorted(((cpu[name], wall[name], name) for name in cpu), reverse=True)


def report(path: Path, top: int) -> None:
    rows = per_file(path)
    print(f"{'CPU-s':>8} {'wall s':>8}  file ({path})")
    for cpu, wall, name in rows[:top]:
        print(f"{cpu:8.1f} {wall:8.1f}  {name}")
    print(f"{sum(r[0] for r in rows):8.1f} {sum(r[1] for r in rows):8.1f}  all {len(rows)} files")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="the per-test result file (default: a new temporary one)")
    parser.add_argument("--parse", type=Path, metavar="TSV", help="report a result file; run nothing")
    parser.add_argument("--top", type=int, default=40, help="files to list (default 40)")
    parser.add_argument("pytest_args", nargs="*", help="after --: pytest's arguments (e.g. -m slow)")
    args = parser.parse_args()
    if args.parse is not None:
        report(args.parse, args.top)
        return 0
    out = args.out or Path(tempfile.mkdtemp(prefix="suite-cpu-")) / "tests.tsv"
    out.unlink(missing_ok=True)
    # -n 0: one test at a time, so that the machine's busy time around a test is that test's
    code = pytest.main(["-n", "0", "-p", "no:randomly", "-q", *args.pytest_args], plugins=[CpuPerTest(out)])
    report(out, args.top)
    return int(code)


if __name__ == "__main__":
    sys.exit(main())
