"""When an actor dies or fails: which one, where its log is, and why, in a few console lines.

Ray reports a dead actor (`RayActorError`: killed, OOM, segfault, its node gone) or a task that
raised in an actor (`RayTaskError`: e.g. vLLM's `EngineDeadError` when its engine core died) with
the actor's id, and puts the traceback where the actor's output goes, which with
`log.actor_output file` is `<output_dir>/logs/<role>-<rank>.log`, not the console. The driver
knows each actor's id and name (`Roles.actor_names`), so `describe_actor_failure` can say:

    policy-0 died: The actor died unexpectedly ... pid: 4321 ip: 10.0.0.5 ... End of file.
      its log: /runs/ppo/logs/policy-0.log, last lines:
        ...

and `death_cause` says why it died. Ray cannot tell a SIGKILL from another abrupt end (the
worker's connection just closes), so it reads the actor's log: Ray's workers enable
`faulthandler`, which writes "Fatal Python error: Segmentation fault" (or Aborted, Bus error)
there on a crash, and an uncaught exception leaves its traceback there.

`is_actor_failure` tells such errors apart without importing Ray (the in-process fakes of the
tests replace it).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "death_cause",
    "death_first",
    "describe_actor_failure",
    "describe_build_locks",
    "extension_build_locks",
    "failed_actor_name",
    "is_actor_failure",
    "log_tail",
]

_SKIPPED_LINES = ("actor_id:", "namespace:", "class_name:", "name:")
# Ray's guesses after "Worker unexpectedly exits": `death_cause` says what the log shows instead
_RAY_GUESSES = " Some common causes include:"
_FATAL = "Fatal Python error:"
# What vLLM's engine core writes when its KV cache cannot hold one sequence of max_model_len tokens
# (`vllm.v1.core.kv_cache_utils`); the driver only sees "Engine core initialization failed".
_KV_CACHE_TOO_SMALL = (
    "KV cache is needed, which is larger than the available",
    "No available memory for the cache",
)
_KV_CACHE_ADVICE = (
    "the engine's KV cache cannot hold one sequence of its max_model_len (data.prompt_max_len + "
    "rollout.generate_max_len) tokens (vLLM: {said}): raise rollout.gpu_memory_utilization or "
    "rollout.tensor_parallel_size, give rollout.engine_options.kv_cache_memory_bytes, or lower "
    "data.prompt_max_len / rollout.generate_max_len"
)


def is_actor_failure(error: BaseException) -> bool:
    """Whether `error` is Ray's report of an actor that died or raised (a `ray.exceptions.RayError`)."""
    exceptions = getattr(sys.modules.get("ray"), "exceptions", None)
    base = getattr(exceptions, "RayError", None)
    return isinstance(base, type) and isinstance(error, base)


def log_tail(path: Path, lines: int = 15) -> list[str]:
    """The last `lines` non-empty lines of `path` (empty when it cannot be read)."""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, 2)
            size = handle.tell()
            handle.seek(max(0, size - 64 * 1024))
            text = handle.read().decode(errors="replace")
    except OSError:
        return []
    return [line.rstrip() for line in text.splitlines() if line.strip()][-lines:]


def _reason(error: BaseException) -> str:
    """Ray's words on why: the exit detail of a dead actor, the exception a task raised."""
    cause = getattr(error, "cause", None)
    if isinstance(cause, BaseException) and not hasattr(error, "error_msg"):
        return f"{type(cause).__name__}: {str(cause).strip().splitlines()[0] if str(cause).strip() else ''}"
    message = getattr(error, "error_msg", None) or str(error)
    kept = [
        line.strip()
        for line in message.splitlines()
        if line.strip() and not line.strip().startswith(_SKIPPED_LINES)
    ]
    return " ".join(kept).split(_RAY_GUESSES)[0]


def _died(error: BaseException) -> bool:
    return "RayActorError" in {cls.__name__ for cls in type(error).__mro__}


def death_first(error: BaseException, futures: Sequence[Any], *, wait_s: float = 10.0) -> BaseException:
    """The error to diagnose after `ray.get(futures)` raised `error`: a dead actor's among the
    call's futures when one of them died, else `error` itself.

    When one rank of a world dies, the others' collectives fail too (gloo: "Connection reset by
    peer"), and `ray.get` raises whichever error comes first in the list: often a survivor's. The
    death is the cause; this waits up to `wait_s` for the call's other results to find it.
    """
    import ray

    if _died(error):
        return error
    ready, _ = ray.wait(list(futures), num_returns=len(futures), timeout=wait_s)
    for future in ready:
        try:
            ray.get(future)
        except ray.exceptions.RayError as other:
            if _died(other):
                return other
    return error


def failed_actor_name(error: BaseException, names: Mapping[str, str]) -> str | None:
    """The name ("engine-0", "policy-1") of the actor `error` reports, None when not one of `names`
    (actor id in hex -> name, `Roles.actor_names`)."""
    actor_id = getattr(error, "actor_id", None)
    return names.get(actor_id) if isinstance(actor_id, str) else None


def death_cause(error: BaseException, names: Mapping[str, str], log_dir: str | Path | None) -> str | None:
    """Why a dead actor's process ended, from the last lines of its log: a crash that
    `faulthandler` wrote ("Fatal Python error: Segmentation fault"), a vLLM engine whose KV cache
    cannot hold one sequence (what to change, in rl-launch's options), an uncaught exception (a
    traceback), or else an end with no word in the log, as a SIGKILL gives (the OOM killer).
    None when `error` is not a dead actor's (`RayActorError`) or its log is not known."""
    name = failed_actor_name(error, names)
    if not _died(error) or name is None or log_dir is None:
        return None
    log_lines = log_tail(Path(log_dir) / f"{name}.log", 400)
    fatal = [line.strip() for line in log_lines if line.strip().startswith(_FATAL)]
    if fatal:
        return f"it crashed ({fatal[-1]}; the stack is in its log)"
    too_small = [line.strip() for line in log_lines if any(words in line for words in _KV_CACHE_TOO_SMALL)]
    if too_small:
        said = too_small[-1].split(" Try increasing")[0].split(" See https")[0].removeprefix("ValueError: ")
        return _KV_CACHE_ADVICE.format(said=said.rstrip("."))
    if any(line.startswith("Traceback (most recent call last)") for line in log_lines):
        return "an uncaught exception ended its process (the traceback is in its log)"
    return (
        "its process ended with no error in its log, as SIGKILL ends one (the kernel's OOM killer, "
        "kill -9); `dmesg | grep -i oom` tells an OOM kill apart"
    )


def describe_actor_failure(
    error: BaseException, names: Mapping[str, str], log_dir: str | Path | None, *, tail: int = 15
) -> tuple[str | None, str]:
    """(the failed actor's name or None, a diagnosis of a few lines) for a Ray actor error.

    Args:
        error: what `ray.get` raised (`RayActorError` or `RayTaskError`).
        names: actor id (hex) -> name ("engine-0", "policy-1"), from `Roles.actor_names`.
        log_dir: the actors' log folder (`<output_dir>/logs`), None when they log to the console.
        tail: how many of the log's last lines to show.
    """
    name = failed_actor_name(error, names)
    died = _died(error)
    where = ", ".join(
        str(part)
        for part in (
            f"pid {error.pid}" if getattr(error, "pid", None) else None,
            getattr(error, "ip", None),
        )
        if part
    )
    who = name or "a Ray actor"
    verb = "died" if died else "failed"
    lines = [f"{who} {verb}{f' ({where})' if where else ''}: {_reason(error)}"]
    if name is not None and log_dir is not None:
        path = Path(log_dir).resolve() / f"{name}.log"
        last = log_tail(path, tail)
        lines.append(f"  its log: {path}" + (", last lines:" if last else " (empty)"))
        lines += [f"    {line}" for line in last]
    elif log_dir is None:
        lines.append("  its output went to this console (log.actor_output console)")
    return name, "\n".join(lines)


def extension_build_locks(root: str | None = None) -> list[tuple[str, float]]:
    """torch's JIT-extension build locks under `root` that no live process holds, oldest first:
    [(path, age in seconds)].

    DeepSpeed builds its ops (FusedAdam, the CPU Adam of optimizer offload, ...) through
    `torch.utils.cpp_extension.load`, which holds `<root>[/py<ver>_<cuda|cpu>]/<op>/lock` open
    while it compiles and waits, printing nothing, for as long as another holder's lock file
    exists. A build killed midway leaves the file behind, and every later start that loads the op
    then waits forever. A lock that a live process on this machine holds open is a build still
    running, and is left out (`_held_open`); where that cannot be seen (no /proc), every lock is
    listed. `root`: TORCH_EXTENSIONS_DIR, else torch's default (~/.cache/torch_extensions).
    """
    import os
    import time

    if root is None:
        root = os.environ.get("TORCH_EXTENSIONS_DIR")
        if root is None:
            from torch.utils.cpp_extension import get_default_build_root

            root = get_default_build_root()
    base = Path(root)
    now = time.time()
    locks = []
    for path in [*base.glob("*/lock"), *base.glob("*/*/lock")]:
        try:
            locks.append((str(path), now - path.stat().st_mtime))
        except OSError:  # released meanwhile
            continue
    if locks:
        held = _held_open({os.path.realpath(path) for path, _ in locks})
        locks = [(path, age) for path, age in locks if os.path.realpath(path) not in held]
    return sorted(locks, key=lambda lock: -lock[1])


def _held_open(paths: set[str]) -> set[str]:
    """Those of `paths` (real paths) that a live process of this machine has open, from
    /proc/<pid>/fd (Linux; processes of other users are not seen; empty where /proc is absent).
    torch's build lock (`torch.utils.file_baton.FileBaton`) keeps its file open until it releases
    it, so its holder shows there for as long as it lives."""
    import os

    held: set[str] = set()
    try:
        pids = [entry.name for entry in os.scandir("/proc") if entry.name.isdigit()]
    except OSError:
        return held
    for pid in pids:
        try:
            descriptors = list(os.scandir(f"/proc/{pid}/fd"))
        except OSError:  # ended meanwhile, or not ours
            continue
        for descriptor in descriptors:
            try:
                target = os.readlink(descriptor.path)
            except OSError:
                continue
            if target in paths:
                held.add(target)
    return held


def describe_build_locks(locks: list[tuple[str, float]]) -> str:
    """One sentence naming the build locks and what to do about a stale one ("" when none)."""
    if not locks:
        return ""
    import os

    named = ", ".join(f"{path} ({age:.0f} s old)" for path, age in locks)
    if os.path.isdir("/proc/self/fd"):  # extension_build_locks left out the locks of live builds
        holder, action = ", held by no live process", "delete the file"
    else:
        holder, action = "", "if no compiler is running (ps -ef | grep -E 'ninja|c\\+\\+'), delete the file"
    return (
        f"torch extension build lock{'s' if len(locks) > 1 else ''} {named}{holder}: a DeepSpeed op build "
        "holds one while it compiles, and a build killed midway leaves it, after which every start "
        f"that loads the op waits on it without a word; {action}"
    )
