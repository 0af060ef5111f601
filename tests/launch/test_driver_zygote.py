"""The launch tests' forked drivers (tests/launch/driver_zygote.py) behave as `python -m
rl_launch.cli` does: the same output and exit codes, the run's own environment, folder, command
line and random seeds, and an exit code that says the signal which ended it."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from tests.launch.driver_zygote import ForkedDriver
from tests.launch.launching import launch, launcher_env, start_driver, stop_driver

pytestmark = pytest.mark.slow

PROBE = """
import os, random, sys
print("probe", os.getcwd(), os.environ["RAY_AUTH_TOKEN"], os.environ.get("PROBE"), sys.argv[1:], flush=True)
print("random", random.random(), flush=True)
if os.environ.get("PROBE") == "sleep":
    import time
    time.sleep(300)
"""


def _fresh(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rl_launch.cli", *args], env=env, capture_output=True, text=True, timeout=300
    )


def _probe(output: str, name: str) -> str:
    return next(line for line in output.splitlines() if line.startswith(name + " "))


def test_a_forked_driver_runs_as_python_dash_m_does(tmp_path, monkeypatch):
    monkeypatch.delenv("RL_TESTS_FORKED_DRIVERS", raising=False)
    (tmp_path / "probe.py").write_text(PROBE)
    monkeypatch.chdir(tmp_path)  # the plugin's path is relative: read from the run's folder
    first_env, second_env = launcher_env(), launcher_env()
    assert first_env["RAY_AUTH_TOKEN"] != second_env["RAY_AUTH_TOKEN"]
    args = ["--plugin", "probe.py"]
    fresh = _fresh(["components", *args], first_env)
    first = launch(args, first_env, command="components")
    second = launch(args, second_env, command="components")  # the same zygote, another run's token
    assert fresh.returncode == first.returncode == second.returncode == 0, fresh.stderr + first.stderr
    listing = lambda output: [line for line in output.splitlines() if not line.startswith("random ")]  # noqa: E731
    assert listing(first.stdout) == listing(fresh.stdout)
    assert first.stderr == fresh.stderr
    expected = f"probe {tmp_path} {{}} None ['components', '--plugin', 'probe.py']"
    assert _probe(first.stdout, "probe") == expected.format(first_env["RAY_AUTH_TOKEN"])
    assert _probe(second.stdout, "probe") == expected.format(second_env["RAY_AUTH_TOKEN"])
    assert _probe(first.stdout, "random") != _probe(second.stdout, "random")  # seeded afresh

    usage = ["ppo", "--train.max_step", "2"]
    fresh, forked = _fresh(usage, first_env), launch(usage[1:], first_env)
    assert fresh.returncode == forked.returncode == 2
    assert forked.stderr == fresh.stderr
    assert "train.max_step" in forked.stderr


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL])
def test_a_forked_driver_ended_by_a_signal_says_which(signum, tmp_path, monkeypatch):
    monkeypatch.delenv("RL_TESTS_FORKED_DRIVERS", raising=False)
    (tmp_path / "probe.py").write_text(PROBE)
    monkeypatch.chdir(tmp_path)
    process = start_driver("components", ["--plugin", "probe.py"], launcher_env(PROBE="sleep"))
    try:
        assert isinstance(process, ForkedDriver)
        deadline = time.monotonic() + 120
        while "random" not in (process.folder / "stdout").read_text():
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        process.send_signal(signum)
        assert process.wait(timeout=60) == -signum
    finally:
        stop_driver(process)
