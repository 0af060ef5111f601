"""`rl-launch` drivers forked from a process that has already imported what a driver imports.

A launch test's driver is `python -m rl_launch.cli <command> ...`: a fresh interpreter importing
torch, transformers, datasets, Ray and rl-launch before it parses a flag (4.7 CPU-seconds of a
minimal run's ~15 that joins a running Ray, every run of the suite again; 0.8 forked). A zygote is a process
started with the run's environment that imports those modules once and then forks one driver per
run: the child takes the run's environment (`os.environ`, the C library's too), working folder,
command line, standard streams to files, a session of its own (`start_new_session`), and calls
`rl_launch.cli.console_main`, the console script's own function. What the child runs is what
`rl-launch` runs; what it skips is the import.

A zygote serves the runs of one environment (`env_key`: every variable but `PER_RUN`'s, the run's
Ray token and pytest's current test, which nothing reads at import). A module that reads a variable at import (huggingface_hub's
HF_HOME, Ray's constants) sees the run's value because the zygote was started with it. Another
environment gets a zygote of its own.

    python -m tests.launch.driver_zygote     the zygote itself: JSON requests on stdin, one a line
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

# What a `rl-launch ppo` driver imports by its end (read from `-X importtime` in a forked driver:
# what it still imported after the fork).
PRELOAD = (
    "rl_launch.cli",
    "rl_launch.ppo",
    "ray",
    "ray.dashboard.optional_deps",
    "ray.autoscaler.v2.utils",
    "ray.dag.compiled_dag_node",
    "ray._common.pydantic_compat",
    "ray._common.usage.usage_lib",
    "ray._private.runtime_env.uv_runtime_env_hook",
    "torch",
    "transformers",
    "transformers.models.auto.tokenization_auto",
    "transformers.models.auto.configuration_auto",
    "transformers.models.auto.auto_factory",
    "datasets",
    "matplotlib.pyplot",
)

# Threads a fork may leave behind: jemalloc's (pyarrow's allocator, started by `import datasets`)
# takes its locks around a fork (pthread_atfork) and starts again in the child when it needs it.
FORK_SAFE_THREADS = frozenset({"jemalloc_bg_thd"})

# Variables a run may set apart from its zygote's environment: none of the preloaded modules reads
# them at import (pytest names the current test in one).
PER_RUN = frozenset({"RAY_AUTH_TOKEN", "PYTEST_CURRENT_TEST"})

# Zygotes a test process keeps (~0.6 GB each): the least recently used one goes first.
MAX_ZYGOTES = 3


def env_key(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """What a zygote's environment must equal for it to serve a run of `env`."""
    return tuple(sorted((name, value) for name, value in env.items() if name not in PER_RUN))


# The zygote process -----------------------------------------------------------------------------


def _redirect(fd: int, path: str | None, flags: int) -> None:
    target = os.open(path or os.devnull, flags, 0o644)
    os.dup2(target, fd)
    os.close(target)


def _drive(request: dict, ready: int) -> None:
    """The forked driver: take the run's session and streams (then close `ready`), environment and
    folder, run the CLI."""
    try:
        os.setsid()
        _redirect(0, None, os.O_RDONLY)
        _redirect(1, request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        _redirect(2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.close(ready)
        from rl_launch import cli

        sys.argv = [cli.__file__, *request["argv"]]
    except BaseException:
        import traceback

        traceback.print_exc()
        os._exit(1)
    run_as_a_fresh_process(request["env"], request["cwd"], cli.console_main)


def run_as_a_fresh_process(env: dict[str, str], cwd: str, main) -> None:
    """In a forked child whose descriptors 0-2 are already its own: take `env` (os.environ and the
    C library's) and `cwd`, fresh random seeds and standard streams, call `main`, and exit as an
    interpreter running it would (SystemExit's code, or its message printed and 1; 1 after an
    exception's traceback; the atexit handlers run first). Never returns."""
    code = 1
    try:
        sys.stdin = sys.__stdin__ = open(0, closefd=False)  # noqa: SIM115
        sys.stdout = sys.__stdout__ = open(1, "w", closefd=False)  # noqa: SIM115
        sys.stderr = sys.__stderr__ = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        import random

        random.seed()  # a fresh process's own seeds, not copies of the zygote's
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        main()
        code = 0
    except SystemExit as stop:  # --help, a usage error: as the interpreter ends on SystemExit
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        import atexit

        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _handle(request: dict, report: int) -> None:
    """The forked keeper of one run: fork its driver, say the driver's pid on `report` once it
    leads a session of its own and its streams are the run's, wait for it, write its exit code
    (negative: the signal that ended it) and CPU-seconds to the request's status file."""
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        wait_for, ready = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(report)
            os.close(wait_for)
            _drive(request, ready)
        os.close(ready)
        os.read(wait_for, 1)  # end of file once the driver leads its session (or has died)
        os.write(report, f"{pid}\n".encode())
        os.close(report)
        _, status, usage = os.wait4(pid, 0)
        partial = request["status"] + ".part"
        code, cpu_s = os.waitstatus_to_exitcode(status), usage.ru_utime + usage.ru_stime
        pathlib.Path(partial).write_text(json.dumps({"returncode": code, "cpu_s": cpu_s}))
        os.replace(partial, request["status"])
    finally:
        os._exit(0)


def threads_unsafe_to_fork() -> list[str]:
    """The threads besides this one that a fork would leave behind with their locks held in the
    child (a fork keeps only the forking thread): native ones by name but `FORK_SAFE_THREADS`,
    and Python's."""
    names = [(task / "comm").read_text().strip() for task in pathlib.Path("/proc/self/task").iterdir()]
    native = sorted(set(names) - {pathlib.Path(sys.executable).name[:15]} - FORK_SAFE_THREADS)
    python = [thread.name for thread in threading.enumerate() if thread is not threading.current_thread()]
    return native + python


def serve() -> None:
    answers = os.fdopen(os.dup(1), "w")  # the test process reads its answers here
    os.dup2(2, 1)  # and what the imports print goes to the zygote's stderr
    for name in PRELOAD:
        with contextlib.suppress(ImportError):  # the driver's own import of it fails alike
            importlib.import_module(name)
    others = threads_unsafe_to_fork()
    if others:
        print(json.dumps({"error": f"threads {others} after importing {PRELOAD}"}), file=answers, flush=True)
        return
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the keepers are reaped as they end
    print(json.dumps({"ready": os.getpid()}), file=answers, flush=True)
    for line in sys.stdin:
        read, write = os.pipe()
        if os.fork() == 0:
            answers.close()  # the test's readline must not wait on a driver holding it
            os.close(read)
            _handle(json.loads(line), write)
        os.close(write)
        with os.fdopen(read) as answer:
            print(json.dumps({"pid": int(answer.readline())}), file=answers, flush=True)


# The test side ------------------------------------------------------------------------------------


class ForkedDriver:
    """A forked driver, with the part of `subprocess.Popen` the launch tests use: `pid`, `args`,
    `returncode`, `poll`, `wait`, `send_signal`, `kill`, `communicate` (its streams' text; None for
    a stream not captured)."""

    def __init__(self, args: list[str], pid: int, folder: pathlib.Path, capture: bool) -> None:
        self.args, self.pid, self.folder, self.capture = args, pid, folder, capture
        self.returncode: int | None = None
        self.cpu_s: float | None = None  # the driver's own CPU-seconds, once it has exited

    def poll(self) -> int | None:
        if self.returncode is None:
            with contextlib.suppress(FileNotFoundError):
                status = json.loads((self.folder / "status").read_text())
                self.returncode, self.cpu_s = status["returncode"], status["cpu_s"]
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str | None, str | None]:
        self.wait(timeout)
        if not self.capture:
            return None, None
        read = lambda name: (self.folder / name).read_text(errors="replace")  # noqa: E731
        return read("stdout"), read("stderr")


class DriverZygote:
    """A zygote process for the runs of one environment (`env_key(env)`)."""

    def __init__(self, env: dict[str, str]) -> None:
        self.folder = pathlib.Path(tempfile.mkdtemp(prefix="rl-zygote-"))  # the runs' streams
        errors = self.folder / "zygote.err"
        with errors.open("w") as stderr:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "tests.launch.driver_zygote"],
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
            )
        answer = json.loads(self.process.stdout.readline() or '{"error": "it exited"}')
        if "ready" not in answer:
            printed = errors.read_text()[-3000:]
            self.close()
            raise RuntimeError(f"the driver zygote did not start: {answer['error']}\n{printed}")

    def start(self, argv: list[str], env: dict[str, str], *, capture: bool = True) -> ForkedDriver:
        """Fork a driver running `rl-launch <argv>` in `env` from the current folder."""
        folder = pathlib.Path(tempfile.mkdtemp(dir=self.folder))
        request = {
            "argv": argv,
            "env": env,
            "cwd": os.getcwd(),
            "stdout": str(folder / "stdout") if capture else None,
            "stderr": str(folder / "stderr") if capture else None,
            "status": str(folder / "status"),
        }
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        pid = json.loads(self.process.stdout.readline())["pid"]
        return ForkedDriver([sys.executable, "-m", "rl_launch.cli", *argv], pid, folder, capture)

    def close(self) -> None:
        close_stdin_and_wait(self.process, 30)
        shutil.rmtree(self.folder, ignore_errors=True)


def close_stdin_and_wait(process: subprocess.Popen, timeout_s: float) -> None:
    """End a process that runs until its stdin closes: close it, wait `timeout_s`, then kill it."""
    with contextlib.suppress(OSError):
        process.stdin.close()
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


_ZYGOTES: dict[tuple[tuple[str, str], ...], DriverZygote] = {}


def forked_driver(argv: list[str], env: dict[str, str], *, capture: bool = True) -> ForkedDriver:
    """`rl-launch <argv>` in `env`, forked from this process's zygote for that environment (started
    at its first run)."""
    key = env_key(env)
    zygote = _ZYGOTES.pop(key, None)
    if zygote is None:
        if len(_ZYGOTES) == MAX_ZYGOTES:
            _ZYGOTES.pop(next(iter(_ZYGOTES))).close()
        zygote = DriverZygote(env)
    _ZYGOTES[key] = zygote  # the most recently used last
    return zygote.start(argv, env, capture=capture)


def close_zygotes() -> None:
    """Stop this process's zygotes (the drivers they forked run on)."""
    while _ZYGOTES:
        _ZYGOTES.popitem()[1].close()


if __name__ == "__main__":
    serve()
