"""A preemption notice on one host of a two-process streaming run stops both: SIGTERM to process 1
alone, in the middle of a collect whose rounds take 5 s, or of an update whose micro-batches take
8 s each (`tests/fault/slow_step_run.py`), and both processes exit 75 within the grace period at
the same round or micro-batch (the stop flag travels with the round's exchange, or the update's
check before each micro-batch); restarted, the run ends with the metrics of an uninterrupted
one."""
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from mars_jax.preemption import EXIT_CODE
from tests.cpu_env import cpu_env
from tests.distributed.processes import finish, free_port
from tests.distributed.test_stream_hosts import OVERRIDES, ROOT, TIMING
from tests.fault import harness

SCRIPT = ROOT / "tests/fault/slow_step_run.py"
PIPELINE = ("--config.rollout.mode=pipeline", "--config.total_steps=3")
TWO_MICRO_BATCHES = "--config.learner.min_micro_batches=2"  # a check between them
PER_COLLECT = ("stream/problems_admitted", "stream/occupancy", "stream/deferred_seconds")


def _start(workdir: Path, logs: bool = False, **env: str) -> list[subprocess.Popen]:
    """Both processes on `workdir`; with `logs` their output goes to `workdir`.log{pid} beside
    it (nothing reads a pipe while the test waits), else to a pipe (`finish`)."""
    hosts = [f"--coordinator_address=localhost:{free_port()}", "--num_processes=2"]
    command = [sys.executable, str(SCRIPT), "--config=experiments/configs/smoke.py",
               f"--workdir={workdir}",
               f"--config.jax_cache_dir={os.environ['JAX_COMPILATION_CACHE_DIR']}", *OVERRIDES,
               *PIPELINE, TWO_MICRO_BATCHES, *hosts]
    runs = []
    for pid in range(2):
        with open(f"{workdir}.log{pid}", "w") if logs else contextlib.nullcontext() as log:
            runs.append(subprocess.Popen(
                [*command, f"--process_id={pid}"], cwd=ROOT, text=True,
                stdout=log if logs else subprocess.PIPE, stderr=subprocess.STDOUT,
                env=cpu_env(devices=4, PYTHONPATH=str(ROOT), **env)))
    return runs


def _wait(runs: list[subprocess.Popen], workdir: Path, timeout: float) -> list[str]:
    """Each process's exit code asserted to be 75 within `timeout` seconds; their outputs."""
    try:
        for run in runs:
            run.wait(timeout=timeout)
    finally:
        for run in runs:
            run.kill()
    outputs = [Path(f"{workdir}.log{pid}").read_text() for pid in range(2)]
    for pid, (run, output) in enumerate(zip(runs, outputs)):
        assert run.returncode == EXIT_CODE, f"process {pid}:\n{output[-3000:]}"
    return outputs


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    """The uninterrupted run's workdir."""
    workdir = tmp_path_factory.mktemp("hosts") / "straight"
    finish(_start(workdir), 900)
    return workdir


@pytest.mark.slow
@pytest.mark.parametrize("marker, slow", [("slow_collect", {"SLOW_COLLECT": "1"}),
                                          ("slow_update", {"SLOW_UPDATE": "1"})])
def test_sigterm_to_one_host_stops_both_in_time_and_the_run_resumes_exactly(
        tmp_path, straight, marker, slow):
    stopped = tmp_path / "stopped"
    # Step 2's collect, or the first micro-batch of step 2's update (the run's second).
    runs = _start(stopped, logs=True, **slow)
    deadline = time.time() + 600
    while not (stopped / marker).exists():
        assert all(run.poll() is None for run in runs) and time.time() < deadline
        time.sleep(0.1)
    start = time.monotonic()
    runs[1].send_signal(signal.SIGTERM)
    outputs = _wait(runs, stopped, 120)
    elapsed = time.monotonic() - start
    assert elapsed <= 25, f"exited {elapsed:.1f} s after SIGTERM"
    for output in outputs:
        assert "SIGTERM in step 2; checkpoint 2 saved" in output, output[-3000:]
        assert "ran out" not in output, output[-3000:]

    finish(_start(stopped), 900)
    for sub in ("", "host1"):
        rows, resumed = harness.metrics(straight / sub), harness.metrics(stopped / sub)
        assert [row["step"] for row in resumed] == [1, 2, 3]
        for a, b in zip(rows, resumed, strict=True):
            for key in a:
                if not key.startswith(TIMING + PER_COLLECT) and a[key] is not None:
                    np.testing.assert_allclose(b[key], a[key], rtol=1e-5, atol=1e-7,
                                               err_msg=f"{sub or 'host0'} {key}")
