"""Preemption notices: SIGTERM becomes a flag that long loops read between units of work.

Loops taking `should_stop` raise `Stopped` between units (with several hosts, only where all
agreed); the job saves and raises `Preempted` (exit 75: rerun the same command). A watchdog exits
with 75 whatever the process does, `Notice.watchdog_s` after the notice. The notice also comes
through `signal.set_wakeup_fd`, since a Python handler cannot run during a blocking native call.
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
# Seconds a process that stopped and saved after a notice waits for every host to leave
# jax.distributed (they stopped in the same round, so they arrive within moments) before it
# exits all the same: the watchdog ends with the job, this bounds the exit after it.
LEAVE_S = 5.0


class Stopped(Exception):
    """A loop stopped between two units of work because of a preemption notice."""


class Preempted(Exception):
    """SIGTERM arrived; the job saved what it could resume from and stops."""

    exit_code = EXIT_CODE


class Notice:
    """Set by SIGTERM (`handle`); `notice()` says whether it came. With `grace_s`, the process
    exits with `EXIT_CODE` `watchdog_s` seconds after the signal (or `stop_agreed`) unless
    `cancel` ran first."""

    def __init__(self, grace_s: float | None = None) -> None:
        self.grace_s = grace_s
        self.raised = False
        self.since: float | None = None  # time.monotonic() of the signal
        self.unit_s = 0.0  # the longest unit of work measured between two stop checks
        self._watchdog: threading.Timer | None = None
        self._lock = threading.Lock()

    def __call__(self) -> bool:
        return self.raised

    @property
    def watchdog_s(self) -> float | None:
        """Seconds from the notice to the watchdog's exit: `grace_s`, or twice the longest
        measured unit of work where longer; None without `grace_s`."""
        return None if self.grace_s is None else max(self.grace_s, 2 * self.unit_s)

    def measured(self, seconds: float) -> None:
        """Records a unit of work of `seconds` between two stop checks (sizes the watchdog)."""
        self.unit_s = max(self.unit_s, seconds)

    def handle(self, signum=None, frame=None) -> None:
        """The notice came (the signal; idempotent, from any thread)."""
        with self._lock:
            if self.raised:
                return
            self.raised, self.since = True, time.monotonic()
        logging.warning("SIGTERM: stopping after the current unit of work%s",
                        "" if self.grace_s is None else
                        f", exiting within {self.watchdog_s:g} s")
        self._arm()

    def stop_agreed(self) -> None:
        """Another host's notice stops this one too: arms the watchdog (idempotent)."""
        self._arm()

    def _arm(self) -> None:
        with self._lock:
            if self.grace_s is None or self._watchdog is not None:
                return
            if 2 * self.unit_s > self.grace_s:
                logging.warning("a unit of work took %.1f s: the preemption watchdog waits %g s, "
                                "past preemption_grace_s (%g s)", self.unit_s, self.watchdog_s,
                                self.grace_s)
            self._watchdog = threading.Timer(self.watchdog_s, self._expired, [self.watchdog_s])
            self._watchdog.daemon = True
            self._watchdog.start()

    def _expired(self, delay_s: float) -> None:
        logging.error("the preemption grace period (%g s) ran out before the job stopped; "
                      "exiting with %d: a rerun resumes from the newest committed checkpoint",
                      delay_s, EXIT_CODE)
        for handler in logging.getLogger().handlers:
            handler.flush()
        sys.stderr.flush()
        os._exit(EXIT_CODE)

    def cancel(self) -> None:
        """Stops the watchdog (the job is over)."""
        with self._lock:
            if self._watchdog is not None:
                self._watchdog.cancel()


def _watch_wakeup_fd(read_fd: int, notice: Notice, forward_fd: int) -> None:
    """Until `read_fd` closes: a SIGTERM byte sets `notice`; every byte goes on to `forward_fd`
    (the wakeup fd installed before ours, if any)."""
    while data := os.read(read_fd, 512):
        if signal.SIGTERM in data:
            notice.handle()
        if forward_fd >= 0:
            with contextlib.suppress(OSError):
                os.write(forward_fd, data)


@contextlib.contextmanager
def catch_sigterm(grace_s: float | None = None) -> Iterator[Notice]:
    """Turns SIGTERM into a `Notice` while the block runs, then restores the previous handler and
    wakeup fd. Outside the main thread no handler can be installed: the notice never comes."""
    notice = Notice(grace_s)
    try:
        previous = signal.signal(signal.SIGTERM, notice.handle)
    except ValueError:
        yield notice
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    forward_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    watcher = threading.Thread(target=_watch_wakeup_fd, args=(read_fd, notice, forward_fd),
                               name="sigterm-watcher", daemon=True)
    watcher.start()
    try:
        yield notice
    finally:
        notice.cancel()
        signal.set_wakeup_fd(forward_fd)
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
        os.close(write_fd)  # the watcher reads end of file and returns
        watcher.join()
        os.close(read_fd)
