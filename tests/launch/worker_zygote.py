"""The tests' Ray workers forked from a process that has already imported what an actor imports.

Each actor of a run is a Ray worker: a fresh `python default_worker.py` that imports torch,
transformers and DeepSpeed before it runs a line of the actor (~4 of a learner's ~6 CPU-seconds in
a minimal run, every run of the suite again). A zygote is a process started with a test
environment that imports those modules once and forks one worker per request: `worker_zygote`
makes one per environment a launcher environment (`launching.launcher_env`) is made from, and
the first run that may use it starts it. A run reaches it through Ray's own
seams: its driver's environment names `runtime_env_hook` in RAY_RUNTIME_ENV_HOOK, which sets the
job's `py_executable` to `worker_shim.py`; whichever raylet starts the job's workers (the shared
Ray's, a run's own local one) starts the shim where it would start Python, and the shim hands its
command line, environment, folder and standard streams to the zygote. The forked child takes them
and runs `default_worker.py` as `__main__`: what it runs is Ray's worker; what it skips is the
import.

A zygote forks workers whose Python and environment are its own but for Ray's variables (Ray is
not preloaded: see `PRELOAD`) and `PER_WORKER`'s; any other worker falls back to `python
default_worker.py` (the reasons in `fallbacks.log` next to the socket). A forked worker is the
child of a keeper whose title is the worker's command line, so the helpers that find a Ray's
processes by its temp folder find it; it dies with its keeper, and its keeper kills it when the
shim (the process the raylet started and signals) dies. RL_TESTS_FORKED_WORKERS=0 turns it off.

    python -m tests.launch.worker_zygote <socket>    the zygote itself, until its stdin closes
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import pathlib
import runpy
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile

from tests.launch.driver_zygote import close_stdin_and_wait, run_as_a_fresh_process, threads_unsafe_to_fork

SHIM = pathlib.Path(__file__).with_name("worker_shim.py")

# What an actor of a run imports before its first step (read from PYTHONPROFILEIMPORTTIME in a
# learner's and an engine's log): the actors' module, torch, transformers' auto classes, DeepSpeed
# with its optimizers. Not Ray: its core library reads its settings from the environment once, at
# import (the worker's job id among them), so each worker imports Ray itself (`serve` refuses to
# start with it imported).
PRELOAD = (
    "rl_launch.actors",
    "torch",
    "transformers",
    "transformers.models.auto.modeling_auto",
    "transformers.models.auto.tokenization_auto",
    "transformers.models.auto.auto_factory",
    "transformers.modeling_layers",
    "transformers.generation",
    "deepspeed",
    "deepspeed.runtime.zero.muon.muon_optimizer",
)

# Variables a worker's environment may set apart from its zygote's: Ray's (the raylet's per worker,
# a run's token; Ray is not preloaded), setproctitle's (Ray's import sets SPT_NOENV in the process
# that starts a cluster), this module's own, pytest's current test.
PER_WORKER = frozenset({"SPT_NOENV", "RL_TESTS_WORKER_ZYGOTE", "PYTEST_CURRENT_TEST"})
PER_WORKER_PREFIX = "RAY_"

STARTING = "starting"  # in a zygote's folder from its start: shims wait for its socket
FAILED = "failed"  # written by a zygote that will not serve

_ZYGOTE_FDS: list[int] = []  # the listening socket and the answers' pipe, closed in every child
_SET_BY_IMPORTS: dict[str, str] = {}  # variables the preloaded modules set in os.environ
_FORKED_LOG: list[str] = []  # the file the keepers write their workers' pids to


def env_key(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """What a worker's environment must equal, in the zygote's, for the zygote to fork it."""
    return tuple(
        sorted(
            (name, value)
            for name, value in env.items()
            if name not in PER_WORKER and not name.startswith(PER_WORKER_PREFIX)
        )
    )


def runtime_env_hook(runtime_env: dict | None) -> dict | None:
    """RAY_RUNTIME_ENV_HOOK: the job's workers start through the shim of the zygote named by
    RL_TESTS_WORKER_ZYGOTE (a socket path), unless the job names a Python of its own."""
    path = os.environ.get("RL_TESTS_WORKER_ZYGOTE")
    if not path or (runtime_env and "py_executable" in runtime_env):
        return runtime_env
    return {**(runtime_env or {}), "py_executable": f"{sys.executable} -I -S {SHIM} {path}"}


# The zygote process -----------------------------------------------------------------------------


def _receive(connection: socket.socket) -> tuple[dict, list[int]]:
    """A shim's request and its three standard streams."""
    data, fds, _, _ = socket.recv_fds(connection, 1 << 16, 3)
    size = int.from_bytes(data[:8], "big")
    data = data[8:]
    while len(data) < size:
        chunk = connection.recv(size - len(data))
        if not chunk:
            raise ConnectionError("the shim hung up mid-request")
        data += chunk
    return json.loads(data), fds


def _work(request: dict, fds: list[int]) -> None:
    """The forked worker: the shim's streams, environment, folder and command line; Ray's worker."""
    try:
        os.setsid()
        _die_with_parent()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        sys.argv = list(request["argv"])
        sys.path[0] = os.path.dirname(sys.argv[0])  # as `python default_worker.py` has it
    except BaseException:
        import traceback

        traceback.print_exc()
        os._exit(1)
    env = {**_SET_BY_IMPORTS, **request["env"]}  # as if the worker had imported them itself
    run_as_a_fresh_process(env, request["cwd"], lambda: runpy.run_path(sys.argv[0], run_name="__main__"))


def _die_with_parent() -> None:
    """SIGKILL this process when its parent (the keeper) dies (prctl PR_SET_PDEATHSIG)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1


def _keep(connection: socket.socket, request: dict, fds: list[int]) -> None:
    """The forked keeper of one worker: fork it, tell the shim its pid, wait for it (SIGKILL it if
    the shim dies first: the raylet killed what it started), tell the shim how it ended."""
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        with contextlib.suppress(ImportError):  # a Ray's helpers find it by the worker's arguments
            import setproctitle

            setproctitle.setproctitle("worker-keeper " + " ".join(request["argv"]))
        pid = os.fork()
        if pid == 0:
            connection.close()
            _work(request, fds)
        for fd in fds:
            os.close(fd)
        with open(_FORKED_LOG[0], "a") as log:
            log.write(f"{pid}\n")
        connection.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        ended = os.pidfd_open(pid)
        while True:
            ready, _, _ = select.select([ended, connection], [], [])
            if ended in ready:
                break
            if not connection.recv(1):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                select.select([ended], [], [])
                break
        _, status = os.waitpid(pid, 0)
        with contextlib.suppress(OSError):
            connection.sendall(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
    finally:
        os._exit(0)


def _namespaces() -> dict[str, str]:
    """This process's Linux namespaces (network, mount, pid, ...): name -> identity."""
    return {name: os.readlink(f"/proc/self/ns/{name}") for name in os.listdir("/proc/self/ns")}


def _fallback_reason(request: dict, key: tuple, namespaces: dict[str, str]) -> str | None:
    """Why the zygote (its environment's `key`, its `namespaces`) cannot fork the worker of
    `request` (None: it can)."""
    if request["python"] != sys.executable:
        return f"Python {request['python']}"
    if request["namespaces"] != namespaces:
        return f"namespaces {sorted(set(request['namespaces'].items()) ^ set(namespaces.items()))}"
    if env_key(request["env"]) != key:
        return f"variables {sorted({name for name, _ in set(env_key(request['env'])) ^ set(key)})}"
    return None


def _serve_one(connection: socket.socket, key: tuple, namespaces: dict[str, str]) -> None:
    request, fds = _receive(connection)
    reason = _fallback_reason(request, key, namespaces)
    if reason is not None:
        for fd in fds:
            os.close(fd)
        connection.sendall(json.dumps({"fallback": reason}).encode() + b"\n")
        return
    if os.fork() == 0:
        for fd in _ZYGOTE_FDS:
            os.close(fd)
        fd = os.open(os.devnull, os.O_RDONLY)
        os.dup2(fd, 0)  # not the zygote's stdin
        os.close(fd)
        _keep(connection, request, fds)
    for fd in fds:
        os.close(fd)


def serve(path: str, preload: tuple[str, ...] = PRELOAD) -> None:
    answers = os.fdopen(os.dup(1), "w")  # the test process reads "ready" here
    os.dup2(2, 1)  # what the imports print goes to the zygote's stderr
    started_with = dict(os.environ)
    for name in preload:
        with contextlib.suppress(ImportError):  # the worker's own import of it fails alike
            importlib.import_module(name)
    _SET_BY_IMPORTS.update(
        {name: value for name, value in os.environ.items() if started_with.get(name) != value}
    )
    others = threads_unsafe_to_fork()
    if others or "ray" in sys.modules:
        error = f"threads {others}, ray imported: {'ray' in sys.modules}, after importing {preload}"
        print(json.dumps({"error": error}), file=answers, flush=True)
        pathlib.Path(path).with_name(FAILED).touch()  # the shims waiting for it go on without it
        return
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the keepers are reaped as they end
    key, namespaces = env_key(started_with), _namespaces()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    os.chmod(path, 0o600)
    listener.listen(64)
    _FORKED_LOG.append(os.path.join(os.path.dirname(path), "forked.log"))
    _ZYGOTE_FDS.extend([listener.fileno(), answers.fileno()])
    print(json.dumps({"ready": os.getpid()}), file=answers, flush=True)
    while True:
        ready, _, _ = select.select([listener, sys.stdin], [], [])
        if sys.stdin in ready and not sys.stdin.read(1):
            break  # the test session closed it
        if listener in ready:
            connection, _ = listener.accept()
            with connection, contextlib.suppress(OSError, ValueError):
                _serve_one(connection, key, namespaces)


# The test side ------------------------------------------------------------------------------------

HOOK = "tests.launch.worker_zygote.runtime_env_hook"


class WorkerZygote:
    """A zygote started with `env` (preloading `preload`, `PRELOAD` when empty), its socket and
    logs in a folder of its own; `env_vars` are what a driver's environment needs to have its job's
    workers forked."""

    def __init__(self, env: dict[str, str], preload: tuple[str, ...] = ()) -> None:
        self.env, self.preload = env, preload
        self.folder = tempfile.mkdtemp(prefix="rlw-", dir="/tmp")  # unix socket paths must stay short
        self.path = os.path.join(self.folder, "socket")
        self.env_vars = {"RAY_RUNTIME_ENV_HOOK": HOOK, "RL_TESTS_WORKER_ZYGOTE": self.path}
        self.process: subprocess.Popen | None = None  # until `start`
        self.pid: int | None = None  # once it said it serves

    def start(self) -> WorkerZygote:
        """Start the zygote process (once); shims that ask meanwhile wait for it (`STARTING`)."""
        if self.process is None:
            pathlib.Path(self.folder, STARTING).touch()
            with open(os.path.join(self.folder, "zygote.err"), "w") as errors:
                self.process = subprocess.Popen(
                    [sys.executable, "-m", "tests.launch.worker_zygote", self.path, *self.preload],
                    env=self.env,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=errors,
                    text=True,
                )
        return self

    def ready(self, timeout_s: float = 120) -> int:
        """Wait until the zygote serves (its pid), or raise RuntimeError with what it printed
        (workers asking before then fall back)."""
        if self.pid is not None:
            return self.pid
        self.start()
        ready, _, _ = select.select([self.process.stdout], [], [], timeout_s)
        answer = json.loads((ready and self.process.stdout.readline()) or '{"error": "no answer"}')
        if "ready" not in answer:
            printed = pathlib.Path(self.folder, "zygote.err").read_text()[-3000:]
            raise RuntimeError(f"the worker zygote does not serve: {answer['error']}\n{printed}")
        self.pid = answer["ready"]
        return self.pid

    def forked(self) -> list[int]:
        """The pids of the workers it forked, oldest first."""
        with contextlib.suppress(FileNotFoundError):
            return [int(pid) for pid in pathlib.Path(self.folder, "forked.log").read_text().split()]
        return []

    def workers(self, ray_temp_dir: str | None = None) -> dict[int, str]:
        """pid -> title of the live workers forked for a Ray whose temp folder is `ray_temp_dir`
        (its keeper's title names it), for any Ray when None."""
        import psutil

        found = {}
        if self.process is None:
            return found
        with contextlib.suppress(psutil.Error):
            for keeper in psutil.Process(self.process.pid).children():
                with contextlib.suppress(psutil.Error):
                    if ray_temp_dir is None or ray_temp_dir in " ".join(keeper.cmdline()):
                        found.update({worker.pid: " ".join(worker.cmdline()) for worker in keeper.children()})
        return found

    def fallbacks(self) -> list[str]:
        """The lines of `fallbacks.log`: a worker each that was not forked, and why."""
        with contextlib.suppress(FileNotFoundError):
            return pathlib.Path(self.folder, "fallbacks.log").read_text().splitlines()
        return []

    def close(self) -> None:
        if self.process is not None:
            close_stdin_and_wait(self.process, 30)
        if os.environ.get("RL_TESTS_WORKER_ZYGOTE_REPORT"):  # how many it served, for the curious
            with open(os.environ["RL_TESTS_WORKER_ZYGOTE_REPORT"], "a") as report:
                reasons = sorted({line.split(": ", 1)[-1] for line in self.fallbacks()})
                report.write(
                    f"{self.folder}: {len(self.forked())} forked, {len(self.fallbacks())} not: {reasons}\n"
                )
        shutil.rmtree(self.folder, ignore_errors=True)


# Zygotes a test process keeps (~0.7 GB each) besides those its shared Rays hold: the least
# recently used one goes first. The test environment changes as a session goes (an in-process
# learner leaves LOCAL_RANK=0 in it).
MAX_ZYGOTES = 2

_ZYGOTES: dict[tuple[tuple[str, str], ...], WorkerZygote] = {}
_PINNED: dict[tuple[tuple[str, str], ...], WorkerZygote] = {}


def worker_zygote(env: dict[str, str] | None = None, *, pin: bool = False) -> WorkerZygote | None:
    """The zygote for the workers of `env` (this process's environment when None), made at the
    first call for that environment and started by the first run that may use it
    (`start_worker_zygote`); `pin`: kept until the session ends (a shared Ray's, whose workers
    keep the environment it started with). None with RL_TESTS_FORKED_WORKERS=0, and on a machine
    with an NVIDIA GPU (DeepSpeed's import asks CUDA for its devices, after which a forked child
    cannot use CUDA; the GPU tests are few and their machine is not short of CPU)."""
    if os.environ.get("RL_TESTS_FORKED_WORKERS", "1") == "0" or os.path.exists("/dev/nvidiactl"):
        return None
    env = dict(os.environ) if env is None else env
    key = env_key(env)
    if key in _PINNED:
        return _PINNED[key]
    zygote = _ZYGOTES.pop(key, None) or WorkerZygote(env)
    if pin:
        _PINNED[key] = zygote
        return zygote
    if len(_ZYGOTES) == MAX_ZYGOTES:
        _ZYGOTES.pop(next(iter(_ZYGOTES))).close()
    _ZYGOTES[key] = zygote  # the most recently used last
    return zygote


def start_worker_zygote(env: dict[str, str]) -> None:
    """Start the zygote that `env` (a run's environment from `launching.launcher_env`) names, if
    this process made it."""
    path = env.get("RL_TESTS_WORKER_ZYGOTE")
    for zygote in [*_ZYGOTES.values(), *_PINNED.values()]:
        if zygote.path == path:
            zygote.start()


def close_worker_zygotes() -> None:
    """Stop this process's zygotes (the workers they forked run on until their Ray ends them)."""
    for zygotes in (_ZYGOTES, _PINNED):
        while zygotes:
            zygotes.popitem()[1].close()


if __name__ == "__main__":
    serve(sys.argv[1], tuple(sys.argv[2:]) or PRELOAD)
