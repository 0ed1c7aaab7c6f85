"""Entry point of one grader worker process (`python -m mars_jax.rewards.grader_worker`).

One JSON object per line: requests `{"id", "pred", "gold", "soft"}` in; `{"ready": true}`, then
`{"id", "value", "status"}` out ("ok", "timeout" or "error"). The soft limit is a SIGALRM raising a
BaseException, which `except Exception` cannot swallow; code stuck in C is killed by the parent.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import signal
import sys

MEMORY_LIMIT_BYTES = 4 << 30


class SoftTimeout(BaseException):
    """Raised by SIGALRM inside a request."""


_in_request = False


def _on_alarm(signum: int, frame: object) -> None:
    if _in_request:
        raise SoftTimeout


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when the parent dies (best effort)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _answer(equivalent, request: dict) -> dict:
    global _in_request
    signal.setitimer(signal.ITIMER_REAL, float(request["soft"]))
    _in_request = True
    try:
        value, status = bool(equivalent(request["pred"], request["gold"])), "ok"
    except SoftTimeout:
        value, status = False, "timeout"
    except Exception:  # noqa: BLE001 - any failure on model text means "not equivalent"
        value, status = False, "error"
    finally:
        _in_request = False
        signal.setitimer(signal.ITIMER_REAL, 0)
    return {"id": request["id"], "value": value, "status": status}


def main() -> None:
    """Serve requests until stdin closes."""
    _die_with_parent()
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT_BYTES, MEMORY_LIMIT_BYTES))
    channel = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1, encoding="utf-8")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # stray prints must not corrupt the channel
    signal.signal(signal.SIGALRM, _on_alarm)

    from mars_jax.rewards.equivalence import equivalent, warm_up

    warm_up()
    channel.write('{"ready": true}\n')
    for line in sys.stdin:
        request = json.loads(line)
        try:
            reply = _answer(equivalent, request)
        except SoftTimeout:  # the alarm fired between the computation and its cancellation
            reply = {"id": request["id"], "value": False, "status": "timeout"}
        channel.write(json.dumps(reply) + "\n")


if __name__ == "__main__":
    main()
