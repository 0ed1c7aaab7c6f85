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


@pytest.mark.slow
def test_sigkill_resume_with_routing_replay_equals_the_uninterrupted_run(tmp_path):
    """Partial rollouts keep the expert ids recorded by their earlier segments across the kill
    (checkpointed as arrays), so the resumed updates replay the same routing. The kill comes after
    step 3, so the run resumes from step 2 or 3, whose partial segments were decoded one version
    before the resumed step's: a re-prefill would route some of their positions differently.
    Rewards alternate within each group (`parity_reward_run.py`), so every update moves the
    parameters."""
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    flags = ("--config.total_steps=4", "--config.learner.routing_replay=True",
             "--config.optimizer.learning_rate=1e-2")
    command = lambda workdir: harness.command(  # noqa: E731
        workdir, *flags, script=harness.REPO / "tests/fault/parity_reward_run.py")
    subprocess.run(command(straight), env=harness.env(), check=True, capture_output=True,
                   timeout=900)
    process = subprocess.Popen(command(killed), env=harness.env(),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    harness.wait_for_step(process, killed, 3)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert len(harness.metrics(killed)) < 4
    subprocess.run(command(killed), env=harness.env(), check=True, capture_output=True,
                   timeout=900)

    step_a, params_a, _ = harness.latest_checkpoint(straight)
    step_b, params_b, _ = harness.latest_checkpoint(killed)
    assert step_a == step_b == 4
    for a, b in zip(params_a, params_b, strict=True):
        np.testing.assert_array_equal(a, b)
    assert harness.metrics(straight) == harness.metrics(killed)
    # Every output takes both of its 8-token segments (a random model does not stop), one update
    # a step from step 2 on: step 2 trains the Solver group of step 1 at version 0, steps 3 and 4
    # train groups one version after their first segment (at step 4, 1-0's Verifier groups too).
    rows = harness.metrics(straight)
    assert [(r["policy_version"], r["staleness/max"]) for r in rows] == [(0, 0), (1, 0), (2, 1),
                                                                          (3, 1)]
    assert [r["samples/verifier"] for r in rows] == [0, 0, 0, 4]
    assert all(r["update/grad_norm"] > 0 for r in rows[1:])  # the updates moved the parameters
