"""When an actor dies or fails: which one, where its log is, and why, in a few console lines.

Ray reports a dead actor (`RayActorError`: killed, OOM, segfault, its node gone) or a task that
raised in an actor (`RayTaskError`: e.g. vLLM's `EngineDeadError` when its engine core died) with
the actor's id, and puts the traceback where the actor's output goes, which with
`log.actor_output file` is `<output_dir>/logs/<role>-<rank>.log`, not the console. The driver
knows each actor's id and name (`Roles.actor_names`), so `describe_actor_failure` can say:

    engine-0 died (pid 4321, 10.0.0.5): The actor died unexpectedly ... killed by SIGKILL
      its log: /runs/ppo/logs/engine-0.log, last lines:
        ...

`is_actor_failure` tells such errors apart without importing Ray (the in-process fakes of the
tests replace it).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path

__all__ = ["describe_actor_failure", "is_actor_failure", "log_tail"]

_SKIPPED_LINES = ("actor_id:", "namespace:", "class_name:", "name:")


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
    return " ".join(kept)


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
    actor_id = getattr(error, "actor_id", None)
    name = names.get(actor_id) if isinstance(actor_id, str) else None
    died = "RayActorError" in {cls.__name__ for cls in type(error).__mro__}
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
