"""Preemption: what a run does on SIGTERM or Ctrl-C (SIGINT), within a bound.

Clusters end jobs with SIGTERM and kill them a grace period later (SLURM's `--signal`/KillWait,
Kubernetes' terminationGracePeriodSeconds, 30 s by default); a person ends them with Ctrl-C. In
either case a run should keep what it has trained. `PreemptionGuard` holds the rules, the step
loops (`PPOTrainer.fit`, the supervised `run_task`) apply them:

- first signal: the loop finishes the step in flight, or abandons it while the step has not yet
  changed the learners (generation and the experience forwards: the guard's `abandonable()`
  region, where the signal raises `KeyboardInterrupt` at once). It then saves a checkpoint of the
  last finished step (unless that step is already saved), writes the summary, shuts the actors
  down and exits with 128 + the signal number (130 for SIGINT, 143 for SIGTERM);
- a second signal, or `ckpt.preemption_timeout_s` seconds after the first (25 s by default, so
  that the save ends inside Kubernetes' default 30 s grace): `KeyboardInterrupt`
  in the main thread, wherever it is: the run stops without saving (the previous checkpoint
  stays valid: checkpoints are written atomically), shuts down and exits with the same code;
- `_HARD_EXIT_GRACE_S` later still (shutdown stuck in a dead actor): `os._exit` with that code.

A resume (`--ckpt.load_checkpoint true`) continues from the saved step; async mode's
checkpoints keep the steps that were in flight, which are generated again.

The handlers run in the main thread between bytecodes; `ray.get` checks for signals while it
waits and turns a `KeyboardInterrupt` raised by a handler into its own.
"""

from __future__ import annotations

import _thread
import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["Preempted", "PreemptionGuard"]

_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_HARD_EXIT_GRACE_S = 30.0


STARTUP_STOP = "stopping the start-up now (no step has run since launch: nothing to save)"
"""What a signal before the first step says (`PreemptionGuard.abandonable(STARTUP_STOP)`)."""


class Preempted(Exception):
    """Raised by a step loop that stopped for a signal after saving what it could.

    Fields: `signal_name` ("SIGTERM"), `exit_code` (128 + signal number), `step` (the last
    finished step, 0 when none), `saved` (whether a checkpoint of `step` exists now).
    """

    def __init__(self, signal_name: str, exit_code: int, step: int, saved: bool) -> None:
        self.signal_name, self.exit_code, self.step, self.saved = signal_name, exit_code, step, saved
        if step == 0:
            what = "no step had finished, nothing to save"
        elif saved:
            what = f"checkpoint of step {step} saved; --ckpt.load_checkpoint true continues from it"
        else:
            what = f"step {step} was the last finished step; its checkpoint could not be saved"
        super().__init__(f"{signal_name}: stopped after step {step} ({what})")


class PreemptionGuard:
    """SIGTERM / SIGINT handlers of one run: a request to stop, then a forced stop.

    Args:
        command: the console prefix ("rl-launch ppo").
        timeout_s: seconds from the first signal to the forced stop (`ckpt.preemption_timeout_s`).
        write: where the guard's lines go (default: stderr, written with `os.write`, safe in a
            handler).
        hard_exit: called with the exit code `_HARD_EXIT_GRACE_S` after the forced stop if the
            process is still alive (default `os._exit`); tests pass their own.

    State: `signum` (the first signal, None before), `forced` (a second signal or the timeout),
    `exit_code` (128 + `signum`).
    """

    def __init__(
        self,
        command: str,
        timeout_s: float,
        *,
        write: Callable[[str], None] | None = None,
        hard_exit: Callable[[int], None] = os._exit,
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"PreemptionGuard: timeout_s must be > 0 seconds, got {timeout_s!r}")
        self.command, self.timeout_s = command, float(timeout_s)
        self.write = write or (lambda text: os.write(sys.stderr.fileno(), text.encode()))
        self.hard_exit = hard_exit
        self.signum: int | None = None
        self.forced = False
        self.timed_out = False
        self.finished = False
        self._abandonable = 0
        self._stopping: str | None = None
        self._previous: dict[int, Any] = {}
        self._timers: list[threading.Timer] = []

    # -- state ------------------------------------------------------------------------------------

    @property
    def requested(self) -> bool:
        """A signal arrived: the loop stops at the next step boundary."""
        return self.signum is not None

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else "no signal"

    @property
    def exit_code(self) -> int:
        """128 + the signal number (130 for SIGINT, 143 for SIGTERM), the shells' convention."""
        return 128 + (self.signum if self.signum is not None else signal.SIGINT)

    def preempted(self, step: int, saved: bool) -> Preempted:
        """The exception a loop raises once it stopped after `step` (saved or not)."""
        return Preempted(self.signal_name, self.exit_code, step, saved)

    # -- handlers ---------------------------------------------------------------------------------

    def install(self) -> PreemptionGuard:
        """Take over SIGTERM and SIGINT (main thread only; after `ray.init`, which sets its own)."""
        for signum in _SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def restore(self) -> None:
        """Give the signals back to their previous handlers (the timers keep running: a stuck
        shutdown still ends at the bound)."""
        for signum, handler in self._previous.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}

    def finish(self) -> None:
        """The run is over: stop the timers, give the signals back."""
        self.finished = True
        for timer in self._timers:
            timer.cancel()
        self.restore()

    def __enter__(self) -> PreemptionGuard:
        return self.install()

    def __exit__(self, *exc_info: object) -> None:
        self.finish()

    @contextlib.contextmanager
    def abandonable(self, stopping: str | None = None) -> Iterator[None]:
        """A region the first signal may interrupt at once (it raises `KeyboardInterrupt` there):
        work that changes no learner state, so the last finished step can still be saved.
        `stopping`: what the signal's console line says instead of the step loop's rule (the
        start-up: "stopping the start-up now; no step has run, nothing to save")."""
        if self.requested:
            raise KeyboardInterrupt
        self._abandonable += 1
        outer, self._stopping = self._stopping, stopping or self._stopping
        try:
            yield
        finally:
            self._abandonable -= 1
            self._stopping = outer

    def _say(self, text: str) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.write(f"{self.command}: {text}\n")

    def _handle(self, signum: int, frame: Any) -> None:
        if self.timed_out and not self.forced:  # the timer's interrupt_main, delivered as SIGINT
            self.forced = True
            raise KeyboardInterrupt
        name = signal.Signals(signum).name
        if self.signum is None:
            self.signum = signum
            if self._abandonable and self._stopping:
                self._say(f"{name}: {self._stopping}")
            else:
                self._say(
                    f"{name}: stopping after the step in flight, then saving a checkpoint of the last "
                    f"finished step (at most {self.timeout_s:g} s, ckpt.preemption_timeout_s; a second "
                    "signal stops at once without saving)"
                )
            self._start_timer(self.timeout_s, self._time_out)
            if self._abandonable:
                raise KeyboardInterrupt
            return
        self.forced = True
        self._say(f"{name} again: stopping now, without saving")
        raise KeyboardInterrupt

    def _start_timer(self, seconds: float, action: Callable[[], None]) -> None:
        timer = threading.Timer(seconds, action)
        timer.daemon = True
        self._timers.append(timer)
        timer.start()

    def _time_out(self) -> None:
        if self.finished:
            return
        self.timed_out = True
        self._say(
            f"the step in flight and the checkpoint did not finish within ckpt.preemption_timeout_s = "
            f"{self.timeout_s:g} s: stopping now, without saving"
        )
        self._start_timer(_HARD_EXIT_GRACE_S, self._exit_hard)
        _thread.interrupt_main(signal.SIGINT)  # runs `_handle` in the main thread

    def _exit_hard(self) -> None:
        if self.finished:
            return
        self._say(f"shutdown did not finish within {_HARD_EXIT_GRACE_S:g} s more: exiting")
        time.sleep(0.1)
        self.hard_exit(self.exit_code)
