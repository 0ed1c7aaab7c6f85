"""The preemption notice: SIGTERM sets it, and a process that does not stop within the grace
period is exited with code 75 by the watchdog; a job that ends first is not."""
import subprocess
import sys
import time

from mars_jax.preemption import EXIT_CODE

_PROGRAM = """
import os, signal, sys, time
from mars_jax.preemption import catch_sigterm
with catch_sigterm(grace_s=1.0) as notice:
    os.kill(os.getpid(), signal.SIGTERM)
    assert notice()
    time.sleep(float(sys.argv[1]))  # a unit of work longer (or shorter) than the grace period
print("stopped in time")
time.sleep(2)  # after the job: no watchdog left
"""


def _run(work_s: float) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", _PROGRAM, str(work_s)], capture_output=True,
                          text=True, timeout=60)
    return done, time.monotonic() - start


def test_a_job_still_busy_when_the_grace_period_ends_exits_75():
    done, elapsed = _run(30)
    assert done.returncode == EXIT_CODE, done.stderr
    assert "grace period (1 s) ran out" in done.stderr and "stopped in time" not in done.stdout
    assert elapsed < 20


def test_a_job_that_stops_within_the_grace_period_ends_normally():
    done, _ = _run(0.1)
    assert done.returncode == 0, done.stderr
    assert "stopped in time" in done.stdout
