"""The preemption notice: SIGTERM sets it, and a process that does not stop within the grace
period is exited with code 75 by the watchdog, also while its main thread is blocked in a native
call; a job that ends first is not."""
import signal
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


_BLOCKED = """
import sys
import jax
from jax._src import distributed
from mars_jax.preemption import catch_sigterm
jax.distributed.initialize(sys.argv[1], 1, 0)
with catch_sigterm(grace_s=1.0):
    print("blocked", flush=True)
    distributed.global_state.client.blocking_key_value_get("never/set", 600_000)  # 10 min
print("returned")
"""


def test_the_watchdog_exits_75_while_the_main_thread_is_blocked_in_a_native_call():
    """A key-value get that no one answers never returns to the interpreter, so the Python
    signal handler never runs: the notice and its watchdog come through the wakeup fd."""
    from tests.cpu_env import cpu_env
    from tests.distributed.processes import free_port
    process = subprocess.Popen([sys.executable, "-c", _BLOCKED, f"localhost:{free_port()}"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=cpu_env())
    try:
        assert process.stdout.readline() == "blocked\n", process.stderr.read()
        time.sleep(0.5)  # into the native call
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == EXIT_CODE, stderr
    assert "grace period (1 s) ran out" in stderr


def test_the_watchdog_waits_for_two_of_the_longest_units_measured_when_longer_than_the_grace():
    from mars_jax.preemption import Notice
    notice = Notice(grace_s=25.0)
    notice.measured(3.0)
    assert notice.watchdog_s == 25.0  # the agreed stop reaches every host well within it
    notice.measured(20.0)
    notice.measured(4.0)
    assert notice.watchdog_s == 40.0  # a host's next check may be one unit of 20 s away
    assert Notice().watchdog_s is None
