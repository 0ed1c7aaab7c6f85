"""Fault injection: SIGKILL a 12-step smoke run at 5 random points; after resuming, the final
parameters and metrics equal an uninterrupted run's, bitwise on CPU."""
import signal
import subprocess
import time

import numpy as np
import pytest

from tests.fault import harness

STEPS = 12


@pytest.mark.slow
def test_five_sigkills_then_resume_equal_the_uninterrupted_run(tmp_path):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    total = f"--config.total_steps={STEPS}"
    subprocess.run(harness.command(straight, total), env=harness.env(), check=True,
                   capture_output=True, timeout=1800)

    rng = np.random.default_rng(1234)
    # Kill once step k's metrics are written, after a random delay that lands mid-rollout,
    # mid-update or mid-checkpoint of the next step.
    points = sorted(rng.choice(np.arange(1, STEPS - 1), size=5, replace=False).tolist())
    delays = rng.uniform(0.0, 2.0, size=5).tolist()
    for step, delay in zip(points, delays):
        process = subprocess.Popen(harness.command(killed, total), env=harness.env(),
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        harness.wait_for_step(process, killed, step)
        time.sleep(delay)
        assert process.poll() is None, f"the run ended before the kill after step {step}"
        process.send_signal(signal.SIGKILL)
        process.wait()
    subprocess.run(harness.command(killed, total), env=harness.env(), check=True,
                   capture_output=True, timeout=1800)

    step_a, params_a, _ = harness.latest_checkpoint(straight)
    step_b, params_b, _ = harness.latest_checkpoint(killed)
    assert step_a == step_b == STEPS
    for a, b in zip(params_a, params_b, strict=True):
        np.testing.assert_array_equal(a, b)
    assert harness.metrics(straight) == harness.metrics(killed)
