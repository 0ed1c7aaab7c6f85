"""A two-process job exchanging through `distributed.HostGroup` (`exchange_worker.py`) when one
host is lost: SIGKILLed, the other exits non-zero within 2 minutes naming it (heartbeats of 10 s
here; 60 s by default); alive but silent, the other exits 1 after the exchange timeout
naming it."""
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cpu_env import cpu_env
from tests.distributed.processes import free_port

WORKER = Path(__file__).with_name("exchange_worker.py")
ROOT = Path(__file__).resolve().parents[2]


def _start(tmp_path: Path, *extra: str) -> list[subprocess.Popen]:
    """Both processes, each writing its output to `tmp_path`/log{pid}."""
    hosts = [f"--coordinator=localhost:{free_port()}", "--num_processes=2"]
    return [subprocess.Popen(
        [sys.executable, str(WORKER), *hosts, f"--process_id={pid}", *extra], cwd=ROOT,
        stdout=open(tmp_path / f"log{pid}", "w"), stderr=subprocess.STDOUT,
        env=cpu_env(PYTHONPATH=str(ROOT))) for pid in range(2)]


def _wait_for_round(tmp_path: Path, runs: list[subprocess.Popen], round_: int) -> None:
    deadline = time.monotonic() + 120
    while f"round {round_}\n" not in (tmp_path / "log1").read_text():
        assert all(run.poll() is None for run in runs), "a process ended before the loss"
        assert time.monotonic() < deadline, "no exchange round within 120 s"
        time.sleep(0.1)


def _exit_of(run: subprocess.Popen, since: float) -> float:
    """Seconds from `since` until `run` exits (killed after 120 s)."""
    try:
        run.wait(timeout=120)
    except subprocess.TimeoutExpired:
        pass
    return time.monotonic() - since


@pytest.mark.parametrize("lost", [1, 0])
def test_a_killed_host_ends_the_other_naming_it(tmp_path, lost):
    runs = _start(tmp_path, "--heartbeat_timeout_s=10")
    try:
        _wait_for_round(tmp_path, runs, 5)
        runs[lost].send_signal(signal.SIGKILL)
        seconds = _exit_of(runs[1 - lost], time.monotonic())
    finally:
        for run in runs:
            run.kill()
    output = (tmp_path / f"log{1 - lost}").read_text()
    assert runs[1 - lost].returncode not in (0, None), output[-3000:]
    assert seconds < 120, output[-3000:]
    if lost == 1:  # the coordinator's host names it; so does its exchange, while it waits
        assert "stopped sending heartbeats):\n1\n" in output, output[-3000:]
        assert "waiting" in output and "for hosts [1]" in output, output[-3000:]
    else:  # the coordinator runs on process 0: losing it ends the others at once
        assert "the leader task was preempted/died" in output, output[-3000:]


def test_a_silent_host_ends_the_run_with_exit_1_naming_it(tmp_path):
    runs = _start(tmp_path, "--exchange_timeout_s=3", "--silent_from=5")
    try:
        seconds = _exit_of(runs[0], time.monotonic())
    finally:
        for run in runs:
            run.kill()
    output = (tmp_path / "log0").read_text()
    assert runs[0].returncode == 1, output[-3000:]
    assert seconds < 120, output[-3000:]
    assert "round 4\n" in output and "round 5\n" not in output, output[-3000:]
    assert ("host exchange 'stream' round 5 (process 0): hosts [1] did not answer within 3 s"
            in output), output[-3000:]
