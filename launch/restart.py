r"""Run a command, and run it again while it exits 75 (preempted) or 74 (storage unavailable).

  python launch/restart.py [--max_restarts=10] [--backoff_s=10] [--max_backoff_s=600] \
      -- python experiments/run.py --config=... --workdir=...

`experiments/run.py` exits 75 after saving what a rerun resumes from, and 74 when checkpoints
could not be written or read; both are worth a rerun of the same command on the same workdir.
Any other exit code ends the loop with that code. Restart n (1, 2, ...) waits
`min(backoff_s * 2**(n-1), max_backoff_s)` seconds and logs one line to stderr; after
`max_restarts` restarts the last exit code is returned. A SIGTERM or SIGINT sent to this process
is passed on to the command, and the loop then ends with the command's exit code (no restart):
whoever stopped the supervisor wants it stopped. One supervisor runs on each host (launch/
README.md): hosts that stop together on an agreed preemption all rerun.
"""
from __future__ import annotations

import argparse
import datetime
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

RESTART_CODES = {75: "preempted", 74: "storage unavailable"}


def backoff(restart: int, base_s: float, max_s: float) -> float:
    """Seconds to wait before restart number `restart` (1-based): doubling, capped."""
    return min(base_s * 2 ** (restart - 1), max_s)


def _log(message: str) -> None:
    stamp = datetime.datetime.now().isoformat(sep=" ", timespec="seconds")
    print(f"[restart {stamp} {socket.gethostname()}] {message}", file=sys.stderr, flush=True)


def run_with_restarts(command: Sequence[str], max_restarts: int, backoff_s: float,
                      max_backoff_s: float, sleep: Callable[[float], None] = time.sleep,
                      log: Callable[[str], None] = _log) -> int:
    """Runs `command` until it exits with a code outside RESTART_CODES, is stopped by a signal
    sent to this process, or has been restarted `max_restarts` times; returns its last exit code."""
    stopping: list[int] = []
    child: subprocess.Popen | None = None

    def forward(signum, frame):
        del frame
        stopping.append(signum)
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        restart = 0
        while True:
            child = subprocess.Popen(list(command))
            code = child.wait()
            if stopping:
                log(f"exit {code} after signal {stopping[0]}: not restarted")
                return code
            if code not in RESTART_CODES:
                return code
            if restart == max_restarts:
                log(f"exit {code} ({RESTART_CODES[code]}): {max_restarts} restarts used, giving up")
                return code
            restart += 1
            wait = backoff(restart, backoff_s, max_backoff_s)
            log(f"exit {code} ({RESTART_CODES[code]}): restart {restart}/{max_restarts} in "
                f"{wait:g} s: {shlex.join(command)}")
            sleep(wait)
            if stopping:
                log(f"signal {stopping[0]} while waiting: not restarted")
                return code
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="launch/restart.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--max_restarts", type=int, default=10)
    parser.add_argument("--backoff_s", type=float, default=10.0)
    parser.add_argument("--max_backoff_s", type=float, default=600.0)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("pass the command after '--'")
    if args.max_restarts < 0 or args.backoff_s < 0 or args.max_backoff_s < 0:
        parser.error("--max_restarts, --backoff_s and --max_backoff_s must be >= 0")
    return run_with_restarts(command, args.max_restarts, args.backoff_s, args.max_backoff_s)


if __name__ == "__main__":
    sys.exit(main())
