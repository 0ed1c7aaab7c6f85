"""launch/restart.py: a command that exits 75 / 74 is rerun (bounded, with backoff and a log line
per restart); any other exit, or a signal to the supervisor, ends the loop."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESTART = ROOT / "launch" / "restart.py"


def _script(tmp_path: Path, codes: list[int]) -> list[str]:
    """A command that exits with codes[i] on its i-th run (the last code from then on), counting
    its runs in a file."""
    counter = tmp_path / "runs"
    source = (f"import pathlib, sys\np = pathlib.Path({str(counter)!r})\n"
              "n = int(p.read_text()) if p.exists() else 0\np.write_text(str(n + 1))\n"
              f"codes = {codes!r}\nsys.exit(codes[min(n, len(codes) - 1)])\n")
    (tmp_path / "fake.py").write_text(source)
    return [sys.executable, str(tmp_path / "fake.py")]


def _supervise(tmp_path, codes, *flags):
    done = subprocess.run([sys.executable, str(RESTART), "--backoff_s=0.01", *flags, "--",
                           *_script(tmp_path, codes)], capture_output=True, text=True, timeout=60)
    runs = int((tmp_path / "runs").read_text())
    restarts = [line for line in done.stderr.splitlines() if "restart " in line and "/" in line]
    return done.returncode, runs, restarts, done.stderr


def test_preempted_then_done_is_restarted_once(tmp_path):
    code, runs, restarts, _ = _supervise(tmp_path, [75, 0])
    assert (code, runs) == (0, 2)
    [line] = restarts
    assert "exit 75 (preempted): restart 1/10 in 0.01 s" in line and "fake.py" in line


def test_storage_error_is_restarted_and_other_errors_are_not(tmp_path):
    code, runs, restarts, _ = _supervise(tmp_path, [74, 1, 0])
    assert (code, runs) == (1, 2)  # 74 rerun; 1 ends the loop with its code
    assert ["exit 74 (storage unavailable)" in line for line in restarts] == [True]


def test_restarts_are_bounded_and_back_off(tmp_path):
    code, runs, restarts, stderr = _supervise(tmp_path, [75], "--max_restarts=3",
                                              "--max_backoff_s=0.03")
    assert (code, runs) == (75, 4)  # the first run and 3 restarts
    waits = [line.split(" in ")[1].split(" s:")[0] for line in restarts]
    assert waits == ["0.01", "0.02", "0.03"]  # doubling, capped at --max_backoff_s
    assert "3 restarts used, giving up" in stderr


def test_a_signal_to_the_supervisor_reaches_the_command_and_is_not_restarted(tmp_path):
    ready = tmp_path / "ready"
    child = tmp_path / "child.py"
    child.write_text(
        "import pathlib, signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: sys.exit(75))\n"  # as run.py: save, exit 75
        f"pathlib.Path({str(ready)!r}).write_text('x')\n"
        "time.sleep(60)\n")
    supervisor = subprocess.Popen([sys.executable, str(RESTART), "--backoff_s=0.01", "--",
                                   sys.executable, str(child)], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not ready.exists():
        assert time.monotonic() < deadline and supervisor.poll() is None
        time.sleep(0.05)
    os.kill(supervisor.pid, signal.SIGTERM)
    assert supervisor.wait(timeout=30) == 75
    assert "exit 75 after signal 15: not restarted" in supervisor.stderr.read()


@pytest.mark.parametrize("flags, message", [([], "pass the command after '--'"),
                                            (["--max_restarts=-1", "--", "true"], "must be >= 0")])
def test_usage_errors(flags, message):
    done = subprocess.run([sys.executable, str(RESTART), *flags], capture_output=True, text=True)
    assert done.returncode == 2 and message in done.stderr
