"""User code off the event loop: calls that are abandoned at their deadline, never joined.

Environments, agents, tools and rewards are user code; a sync `step` that sleeps, or an async one
that calls `requests.post` / `time.sleep`, freezes whatever event loop runs it, and
`asyncio.wait_for` can only cancel at an `await`. So user code never runs on the caller's loop:

- `UserThreads.call(function, *args, timeout_s=...)` runs one call on a daemon thread of its own
  (an async function on a fresh event loop in that thread). At most `max_workers` calls run at a
  time (the wait for a free slot counts against the call's deadline); a call past its deadline
  raises `CallTimeout` at once, naming where the thread is stuck
  (file, line, function) and for how long, and its slot is freed: six stuck calls never starve the
  next ones. The stuck thread runs on in the background (a daemon: it never delays the exit) and
  is counted in `abandoned_running`; when more than `max_abandoned` are still running, new calls
  are refused (`CallTimeout` naming the count) rather than leaking threads without end.
- `UserLoop` is one episode's own event loop on a daemon thread: an environment's factory,
  `reset` and `step` (sync or async, sharing that loop, so a client opened in `reset` works in
  `step`) run there, and the caller's loop awaits them with a deadline. A step that blocks blocks
  only its own episode; `close()` stops the loop without waiting for a stuck call.
- `call_with_deadline(function, *args, timeout_s=...)` is the same for synchronous callers (a
  reward function called from an executor): a daemon thread, waited for `timeout_s`, abandoned.
- `LoopWatchdog` notices that a loop has not ticked for `threshold_s` and logs once per stall the
  file, function and seconds of the frame that blocks it (the loop thread's stack): code that
  must run on the caller's loop (an agent file's own `execute`) is named when it blocks.

No `loop.run_in_executor(None, ...)` / `asyncio.to_thread` here: the loop's default executor is
joined by `asyncio.run` at shutdown, which waits forever for a stuck call.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = [
    "CallTimeout",
    "LoopWatchdog",
    "UserLoop",
    "UserThreads",
    "call_with_deadline",
    "user_code_at",
    "where_stuck",
]

logger = logging.getLogger(__name__)

_OWN_FILES = (str(Path(__file__).resolve().parent), str(Path(asyncio.__file__).resolve().parent))
_OWN_MODULES = ("threading", "concurrent", "selectors", "contextlib")


class CallTimeout(TimeoutError):
    """A call to user code ran past its deadline and was abandoned (its thread runs on)."""


def _user_frame(frame: Any) -> Any:
    """The innermost frame of `frame`'s stack outside asyncio, threading and this package (the
    frame itself when every frame is ours)."""
    innermost = frame
    while frame is not None:
        if not _is_ours(frame):
            return frame
        frame = frame.f_back
    return innermost


def _is_ours(frame: Any) -> bool:
    filename = str(frame.f_code.co_filename)
    module = str(frame.f_globals.get("__name__", ""))
    return filename.startswith(_OWN_FILES) or module.split(".")[0] in _OWN_MODULES


def user_code_at(thread_id: int | None) -> str | None:
    """`file:line in function` of the innermost user frame the thread `thread_id` is running, or
    None when it runs none (an event loop waiting for work, a thread that has ended)."""
    frame = sys._current_frames().get(thread_id) if thread_id is not None else None
    user = _user_frame(frame) if frame is not None else None
    if user is None or _is_ours(user):
        return None
    return f"{user.f_code.co_filename}:{user.f_lineno} in {user.f_code.co_name}"


def where_stuck(thread_id: int | None) -> str:
    """`file:line in function` of the innermost user frame the thread `thread_id` is running
    ("unknown" when the thread is gone); frames of asyncio, threading and rl_rollout are skipped."""
    frame = sys._current_frames().get(thread_id) if thread_id is not None else None
    if frame is None:
        return "unknown (the thread has ended)"
    frame = _user_frame(frame)
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"


def _describe_call(function: Callable[..., Any]) -> str:
    name = getattr(function, "__qualname__", None) or type(function).__qualname__
    return f"{name.rsplit('<locals>.', 1)[-1]}()"  # a nested function by its own name


async def _await_if_needed(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


def call_with_deadline(function: Callable[..., Any], *args: Any, timeout_s: float, **kwargs: Any) -> Any:
    """`function(*args, **kwargs)` from synchronous code, on a daemon thread waited for `timeout_s`
    seconds: its result, what it raised, or `CallTimeout` naming where it is stuck (the thread is
    abandoned, never joined)."""
    outcome: list[Any] = []
    done = threading.Event()

    def target() -> None:
        try:
            outcome.append((True, function(*args, **kwargs)))
        except BaseException as raised:  # handed to the caller, whatever it is
            outcome.append((False, raised))
        done.set()

    thread = threading.Thread(target=target, name=f"rl-deadline-{_describe_call(function)}", daemon=True)
    started = time.monotonic()
    thread.start()
    if not done.wait(timeout_s):
        raise CallTimeout(
            f"{_describe_call(function)} did not return within {timeout_s:g} s; abandoned after "
            f"{time.monotonic() - started:.1f} s, stuck at {where_stuck(thread.ident)}"
        )
    returned, value = outcome[0]
    if not returned:
        raise value
    return value


class UserThreads:
    """Runs user calls on daemon threads, `max_workers` at a time, each abandoned at its deadline.

    Args:
      max_workers: calls running at once (a stuck call that was abandoned does not hold its slot).
      max_abandoned: abandoned calls that may still be running before new calls are refused.
      name: thread name prefix and how errors name the owner.
    """

    def __init__(
        self, max_workers: int = 16, *, max_abandoned: int = 256, name: str = "rl-user-call"
    ) -> None:
        if not (isinstance(max_workers, int) and max_workers >= 1):
            raise ValueError(f"max_workers: {max_workers!r} is not allowed; expected an integer >= 1")
        self.max_workers, self.max_abandoned, self.name = max_workers, max_abandoned, name
        self._slots = threading.BoundedSemaphore(max_workers)  # shared by every loop that calls
        self._lock = threading.Lock()
        self._abandoned: set[threading.Thread] = set()
        self.abandoned_total = 0

    @property
    def abandoned_running(self) -> int:
        """Abandoned calls whose thread is still running."""
        with self._lock:
            self._abandoned = {thread for thread in self._abandoned if thread.is_alive()}
            return len(self._abandoned)

    async def _take_slot(self) -> None:
        while not self._slots.acquire(blocking=False):  # threads of several loops share the bound
            await asyncio.sleep(0.01)

    async def call(
        self, function: Callable[..., Any], *args: Any, timeout_s: float | None = None, **kwargs: Any
    ) -> Any:
        """`function(*args, **kwargs)` on a thread of its own (awaited there when it returns an
        awaitable); raises what it raised, or `CallTimeout` after `timeout_s` seconds."""
        if self.abandoned_running >= self.max_abandoned:
            raise CallTimeout(
                f"{self.name}: {self.abandoned_running} abandoned calls are still running "
                f"(max_abandoned={self.max_abandoned}); refusing {_describe_call(function)}"
            )
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        try:  # the deadline covers the wait for a slot too: a call never takes longer than timeout_s
            await asyncio.wait_for(self._take_slot(), timeout_s)
        except (asyncio.TimeoutError, TimeoutError):
            raise CallTimeout(
                f"{_describe_call(function)} found none of the {self.max_workers} slots of {self.name} "
                f"free within {timeout_s:g} s"
            ) from None
        remaining = None if timeout_s is None else max(0.0, timeout_s - (time.monotonic() - started))
        future: asyncio.Future = loop.create_future()
        released = threading.Event()

        def release() -> None:  # once: when the call ends, or when it is abandoned
            if not released.is_set():
                released.set()
                self._slots.release()

        def settle(result: Any, error: BaseException | None) -> None:
            if future.done():
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)

        def target() -> None:
            result, error = None, None
            try:
                result = function(*args, **kwargs)
                if inspect.isawaitable(result):
                    result = asyncio.run(_await_if_needed(result))
            except BaseException as raised:  # handed to the caller, whatever it is
                error = raised
            with self._lock:
                release()
            with contextlib.suppress(RuntimeError):  # the caller's loop is closed: nobody waits
                loop.call_soon_threadsafe(settle, result, error)

        thread = threading.Thread(target=target, name=f"{self.name}-{_describe_call(function)}", daemon=True)
        try:
            thread.start()
        except BaseException:
            release()
            raise
        try:
            return await asyncio.wait_for(asyncio.shield(future), remaining)
        except (asyncio.TimeoutError, TimeoutError):
            if future.done():
                return future.result()
            self._abandon(thread, release)
            raise CallTimeout(
                f"{_describe_call(function)} did not return within {timeout_s:g} s; abandoned after "
                f"{time.monotonic() - started:.1f} s, stuck at {where_stuck(thread.ident)}"
            ) from None
        except asyncio.CancelledError:
            self._abandon(thread, release)
            raise

    def _abandon(self, thread: threading.Thread, release: Callable[[], None]) -> None:
        """Free the call's slot now; count its thread while it runs on."""
        with self._lock:
            release()
            if thread.is_alive():
                self._abandoned.add(thread)
                self.abandoned_total += 1


class UserLoop:
    """One episode's own event loop on a daemon thread; `await loop.call(fn, *args)` runs `fn` there.

    A sync `fn` runs on that loop's thread, an async one (or a sync one returning an awaitable)
    is awaited on that loop, so objects an environment makes in one call (a client, a lock) work
    in the next. The caller's loop only waits on a future: `asyncio.wait_for` around `call`
    fires on time however the user code blocks. `close()` stops the loop and never waits.
    """

    def __init__(self, name: str = "rl-episode-loop") -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self.busy_since: float | None = None
        self.thread.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            with contextlib.suppress(Exception):
                for task in asyncio.all_tasks(self.loop):
                    task.cancel()
                self.loop.run_until_complete(asyncio.sleep(0))
            self.loop.close()

    async def _run(self, function: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        self.busy_since = time.monotonic()
        try:
            return await _await_if_needed(function(*args, **kwargs))
        finally:
            self.busy_since = None

    async def call(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`function(*args, **kwargs)` on this loop; cancelling the caller abandons it."""
        future = asyncio.run_coroutine_threadsafe(self._run(function, args, kwargs), self.loop)
        return await asyncio.wrap_future(future)

    def stuck(self) -> str:
        """Where the loop's thread is, and for how long it has been in the current call."""
        seconds = "" if self.busy_since is None else f" for {time.monotonic() - self.busy_since:.1f} s"
        return f"{where_stuck(self.thread.ident)}{seconds}"

    def close(self) -> None:
        """Stop the loop (now, or when a stuck call returns); never waits for the thread."""
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.loop.stop)


class LoopWatchdog:
    """Names the code that blocks an event loop: when `loop` has not run its ticker for
    `threshold_s` seconds, one warning per stall with the file, function and seconds of the
    loop thread's innermost user frame. `blocked` counts stalls, `blocked_s` their longest.

    Use as an async context manager inside the loop it watches:
        async with LoopWatchdog(threshold_s=5.0, name="MultiTurnExecutor"): ...
    """

    def __init__(self, threshold_s: float = 5.0, *, name: str = "event loop") -> None:
        self.threshold_s, self.name = float(threshold_s), name
        self.blocked, self.blocked_s, self.last_block = 0, 0.0, ""
        self._tick = time.monotonic()
        self._stop = threading.Event()

    async def _ticker(self) -> None:
        while True:
            self._tick = time.monotonic()
            await asyncio.sleep(min(0.25, self.threshold_s / 4))

    def _watch(self, thread_id: int) -> None:
        stalled = False
        while not self._stop.wait(min(0.25, self.threshold_s / 4)):
            seconds = time.monotonic() - self._tick
            if seconds < self.threshold_s:
                stalled = False
                continue
            self.blocked_s = max(self.blocked_s, seconds)
            if not stalled:
                stalled = True
                self.blocked += 1
                self.last_block = (
                    f"{where_stuck(thread_id)} blocked the {self.name} event loop for {seconds:.1f} s"
                )
                logger.warning(
                    "%s (async code must await instead of blocking: use asyncio.sleep, an async client, "
                    "or a sync function that runs off the loop)",
                    self.last_block,
                )

    async def __aenter__(self) -> LoopWatchdog:
        self._tick = time.monotonic()
        self._ticker_task = asyncio.ensure_future(self._ticker())
        self._thread = threading.Thread(
            target=self._watch, args=(threading.get_ident(),), name=f"rl-watchdog-{self.name}", daemon=True
        )
        self._thread.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self._stop.set()
        self._ticker_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._ticker_task
