"""A sandbox for code the policy wrote: one Python program in a subprocess with hard limits.

    result = run_python("print(sum(range(10)))", limits=SandboxLimits(timeout_s=5))
    result.stdout == "45\\n";  result.ok

What it does, every run:
- a fresh temporary folder is the program's working directory, HOME and TMPDIR, and is deleted
  afterwards (files the program writes with relative paths land there, and go with it);
- the environment is rebuilt from nothing (PATH, HOME, TMPDIR, LANG): no variable of the caller
  (API keys, tokens) reaches the program; Python runs isolated (`-I`: no PYTHON* variables, no
  user site, the working folder is not on sys.path);
- resource limits (`setrlimit`): address space (`memory_mb`), CPU seconds, size of a written
  file, no core files, and processes (`max_processes`, RLIMIT_NPROC);
- a wall-clock deadline (`timeout_s`): past it the program's whole process group is killed
  (SIGKILL), and with the namespaces below every process it started, however detached;
- stdout and stderr are read as they come and kept up to `max_output_bytes` each (the rest is
  read and dropped, `output_truncated`);
- never a shell: the program is a file run by a fixed launcher, arguments are a list.

Network (`network`): "isolated" (the default) runs the program in new user, network and PID
namespaces (`unshare(CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWPID)`): no interface but a loopback
that is down, so no connection leaves it, and when the sandbox ends every process in it dies.
Where the kernel refuses unprivileged namespaces the run is refused (`SandboxError` says so)
unless `network="allow"`, which runs without namespaces (network reachable; processes that
leave the process group with setsid may outlive the deadline).

What it does not isolate: the file system is readable as the caller's user can read it (and
writable outside the folder where that user can write); it is not a container. RLIMIT_NPROC does
not bind root: run as root, a fork bomb is bounded by the deadline and the memory limit only.
Code and its tests run in one interpreter (`run_tests`): a policy that inspects its process could
forge the result; the sandbox contains damage, it does not prevent reward hacking.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence

import msgspec

__all__ = ["NETWORK_MODES", "SandboxError", "SandboxLimits", "SandboxResult", "run_python"]

NETWORK_MODES = ("isolated", "allow")
"""`SandboxLimits.network`: "isolated" (namespaces, refused where the OS cannot) or "allow"."""

_UNSHARE_FAILED = 97  # the launcher's exit status when the namespaces could not be made
_READER_GRACE_S = 2.0  # how long output readers may lag the process's death before they are dropped

# The launcher: fixed code, run as `python -I -c LAUNCHER <limits...>` in the sandbox folder. It
# makes the namespaces, sets the limits and runs main.py; in a new PID namespace it forks first
# (the child is the namespace's init: when it dies, the kernel kills every process in it).
_LAUNCHER = r"""
import ctypes, os, resource, signal, sys
memory, cpu, processes, file_bytes, isolate = (int(v) for v in sys.argv[1:6])
if isolate:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(0x10000000 | 0x40000000 | 0x20000000) != 0:  # NEWUSER | NEWNET | NEWPID
        sys.stderr.write("rl-sandbox: unshare failed: " + os.strerror(ctypes.get_errno()) + "\n")
        os._exit(97)
    child = os.fork()
    if child:
        while True:
            try:
                _, status = os.waitpid(child, 0)
                break
            except InterruptedError:
                continue
        os._exit(os.waitstatus_to_exitcode(status) % 256 if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: the launcher's death is this one's
for limit, value in (
    (resource.RLIMIT_AS, memory),
    (resource.RLIMIT_CPU, cpu),
    (resource.RLIMIT_FSIZE, file_bytes),
    (resource.RLIMIT_CORE, 0),
    (resource.RLIMIT_NPROC, processes),
):
    hard = resource.getrlimit(limit)[1]
    value = value if hard == resource.RLIM_INFINITY else min(value, hard)
    resource.setrlimit(limit, (value, value))
del ctypes, resource, memory, cpu, processes, file_bytes, isolate
sys.argv = ["main.py"]
with open("main.py", encoding="utf-8") as source:
    code = compile(source.read(), "main.py", "exec")
exec(code, {"__name__": "__main__", "__file__": "main.py", "__builtins__": __builtins__})
"""


class SandboxError(RuntimeError):
    """The sandbox could not run the program (not: the program failed, see `SandboxResult`)."""


class SandboxLimits(msgspec.Struct, frozen=True, kw_only=True):
    """Limits of one run.

    timeout_s: wall-clock deadline (> 0). memory_mb: address space of each process (MiB).
    cpu_s: CPU seconds (default: the deadline rounded up, plus 1). max_output_bytes: kept of
    stdout and of stderr, each. max_file_bytes: the largest file the program may write.
    max_processes: RLIMIT_NPROC (processes of the program's user; with network="isolated" the
    count starts afresh in its namespace on kernels that count per namespace). network:
    "isolated" or "allow" (`NETWORK_MODES`; see the module docstring).
    """

    timeout_s: float = 10.0
    memory_mb: int = 512
    cpu_s: int | None = None
    max_output_bytes: int = 65_536
    max_file_bytes: int = 16 << 20
    max_processes: int = 64
    network: str = "isolated"

    def __post_init__(self) -> None:
        if not (isinstance(self.timeout_s, (int, float)) and 0 < self.timeout_s < math.inf):
            raise ValueError(f"timeout_s: {self.timeout_s!r} is not allowed; expected a number > 0")
        for field in ("memory_mb", "max_output_bytes", "max_file_bytes", "max_processes"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{field}: {value!r} is not allowed; expected an integer >= 1")
        if self.cpu_s is not None and (
            isinstance(self.cpu_s, bool) or not isinstance(self.cpu_s, int) or self.cpu_s < 1
        ):
            raise ValueError(f"cpu_s: {self.cpu_s!r} is not allowed; expected an integer >= 1 or None")
        if self.network not in NETWORK_MODES:
            raise ValueError(f"network: {self.network!r} is not allowed; expected one of {NETWORK_MODES}")


class SandboxResult(msgspec.Struct, frozen=True, kw_only=True):
    """What one run gave: its output (decoded as UTF-8, bad bytes replaced), its exit code
    (negative: killed by that signal; None: killed at the deadline), whether the deadline ended
    it, whether output was dropped past the cap, its wall time, and the files asked for by name
    (`collect`) that it left in its folder (at most max_output_bytes each)."""

    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool
    output_truncated: bool
    seconds: float
    files: dict[str, bytes] = msgspec.field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """The program ran to its end with exit code 0."""
        return self.exit_code == 0 and not self.timed_out


class _Capped:
    """Reads a pipe to its end on a daemon thread, keeping the first `limit` bytes."""

    def __init__(self, pipe, limit: int) -> None:
        self.pipe, self.limit, self.kept, self.dropped = pipe, limit, bytearray(), False
        self.thread = threading.Thread(target=self._read, name="rl-sandbox-output", daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            while chunk := self.pipe.read1(65_536):
                room = self.limit - len(self.kept)
                self.kept += chunk[: max(room, 0)]
                self.dropped = self.dropped or len(chunk) > room
        except (OSError, ValueError):
            pass

    def text(self) -> str:
        self.thread.join(_READER_GRACE_S)  # a detached grandchild may hold the pipe: do not wait on it
        return bytes(self.kept).decode("utf-8", errors="replace")


def _environment(folder: str) -> dict[str, str]:
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": folder,
        "TMPDIR": folder,
        "LANG": "C.UTF-8",
        "PYTHONIOENCODING": "utf-8",
        "PYTHONDONTWRITEBYTECODE": "1",
    }


def _kill_group(process: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)


def _collected(folder: str, names: Sequence[str], limit: int) -> dict[str, bytes]:
    files = {}
    for name in names:
        path = os.path.realpath(os.path.join(folder, name))
        if os.path.dirname(path) != os.path.realpath(folder) or not os.path.isfile(path):
            continue  # only plain files directly in the folder, never a link out of it
        with open(path, "rb") as handle:
            files[name] = handle.read(limit)
    return files


def run_python(
    code: str,
    *,
    limits: SandboxLimits | None = None,
    stdin: str = "",
    files: Mapping[str, str] | None = None,
    collect: Sequence[str] = (),
    python: str | None = None,
) -> SandboxResult:
    """Run `code` as a Python program in the sandbox (see the module docstring); never raises for
    what the program does, only `SandboxError` when the sandbox cannot be made.

    Args:
      code: the program (main.py in its folder).
      limits: `SandboxLimits` (defaults: 10 s, 512 MiB, 64 KiB of output, network isolated).
      stdin: the program's standard input.
      files: name -> text of files put in the folder first (names without folders).
      collect: names of files to read back from the folder after the run (`SandboxResult.files`).
      python: the interpreter (default: this process's).
    """
    limits = SandboxLimits() if limits is None else limits
    if not isinstance(code, str):
        raise TypeError(f"code: expected a string, got {type(code).__name__}")
    folder = tempfile.mkdtemp(prefix="rl-sandbox-")
    try:
        for name, text in {**(files or {}), "main.py": code}.items():
            if os.path.basename(name) != name or name in ("", ".", ".."):
                raise ValueError(f"files: {name!r} is not a plain file name")
            with open(os.path.join(folder, name), "w", encoding="utf-8") as handle:
                handle.write(text)
        with open(os.path.join(folder, ".stdin"), "w", encoding="utf-8") as handle:
            handle.write(stdin)
        cpu = limits.cpu_s or math.ceil(limits.timeout_s) + 1
        arguments = [
            str(limits.memory_mb << 20),
            str(cpu),
            str(limits.max_processes),
            str(limits.max_file_bytes),
            "1" if limits.network == "isolated" else "0",
        ]
        started = time.monotonic()
        with open(os.path.join(folder, ".stdin"), "rb") as stdin_file:
            process = subprocess.Popen(
                [python or sys.executable, "-I", "-c", _LAUNCHER, *arguments],
                cwd=folder,
                env=_environment(folder),
                stdin=stdin_file,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                close_fds=True,
            )
        out = _Capped(process.stdout, limits.max_output_bytes)
        err = _Capped(process.stderr, limits.max_output_bytes)
        timed_out = False
        try:
            process.wait(timeout=limits.timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            _kill_group(process)  # at the deadline, and whatever it left running after its end
            process.wait()
        stdout, stderr = out.text(), err.text()
        seconds = time.monotonic() - started
        if process.returncode == _UNSHARE_FAILED and stderr.startswith("rl-sandbox: unshare failed"):
            raise SandboxError(
                f"network='isolated' needs user, network and PID namespaces, which this machine refuses "
                f"({stderr.strip()}); allow unprivileged user namespaces, or pass "
                "SandboxLimits(network='allow') to run without network isolation"
            )
        return SandboxResult(
            stdout=stdout,
            stderr=stderr,
            exit_code=None if timed_out else process.returncode,
            timed_out=timed_out,
            output_truncated=out.dropped or err.dropped,
            seconds=seconds,
            files=_collected(folder, collect, limits.max_output_bytes),
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
