"""Preemption notices: SIGTERM becomes a flag that long loops read between units of work.

`catch_sigterm` installs the handler for the length of a job and yields its `Notice`; calling the
notice says whether SIGTERM came. Loops that take a `should_stop` callable (decode rounds of
`rl.streaming`, generator calls of the per-step scheduler, mini-batches of `rl.learner`, rounds of
the V-C loop in `agents.system`) ask it between units and raise `Stopped` where they stopped; with
several hosts they ask at points every host reaches in the same order and stop only where all
agreed, so every host stops at the same unit. The job then saves what it can resume from and
raises `Preempted` (exit code 75: rerun the same command).

From the signal on, the process has `grace_s` seconds: a watchdog thread exits it with code 75
when they run out, whatever it is doing (a long compile, one long mini-batch, a save still
writing). A checkpoint not committed by then is abandoned: orbax commits a step atomically, so
the newest committed one is what the rerun resumes from.
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator

EXIT_CODE = 75  # EX_TEMPFAIL: rerun the same command to resume


class Stopped(Exception):
    """A loop stopped between two units of work because of a preemption notice."""


class Preempted(Exception):
    """SIGTERM arrived; the job saved what it could resume from and stops."""

    exit_code = EXIT_CODE


class Notice:
    """Set by SIGTERM (`handle`); `notice()` says whether it came. With `grace_s`, the process
    exits with `EXIT_CODE` that many seconds after the signal unless `cancel` ran first."""

    def __init__(self, grace_s: float | None = None) -> None:
        self.grace_s = grace_s
        self.raised = False
        self.since: float | None = None  # time.monotonic() of the signal
        self._watchdog: threading.Timer | None = None

    def __call__(self) -> bool:
        return self.raised

    def handle(self, signum=None, frame=None) -> None:
        if self.raised:
            return
        self.raised, self.since = True, time.monotonic()
        logging.warning("SIGTERM: stopping after the current unit of work%s",
                        "" if self.grace_s is None else f", exiting within {self.grace_s:g} s")
        if self.grace_s is not None:
            self._watchdog = threading.Timer(self.grace_s, self._expired)
            self._watchdog.daemon = True
            self._watchdog.start()

    def _expired(self) -> None:
        logging.error("the preemption grace period (%g s) ran out before the job stopped; "
                      "exiting with %d: a rerun resumes from the newest committed checkpoint",
                      self.grace_s, EXIT_CODE)
        for handler in logging.getLogger().handlers:
            handler.flush()
        sys.stderr.flush()
        os._exit(EXIT_CODE)

    def cancel(self) -> None:
        """Stops the watchdog (the job is over)."""
        if self._watchdog is not None:
            self._watchdog.cancel()


@contextlib.contextmanager
def catch_sigterm(grace_s: float | None = None) -> Iterator[Notice]:
    """Turns SIGTERM into a `Notice` while the block runs; restores the previous handler and
    stops the watchdog afterwards. Outside the main thread (e.g. a notebook worker) no handler
    can be installed: the notice then never comes."""
    notice, installed = Notice(grace_s), True
    try:
        previous = signal.signal(signal.SIGTERM, notice.handle)
    except ValueError:
        installed = False
    try:
        yield notice
    finally:
        notice.cancel()
        if installed:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
