"""Preemption: SIGTERM to a training process -> final checkpoint, clean exit with code 75; sent
mid-rollout or mid-update (between two micro-batches) of a step that takes over 60 s, the run
still exits within the grace period, and resumed it ends as an uninterrupted run."""
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from mars_jax.rl.trainer import PREEMPTED_EXIT_CODE
from tests.fault import harness
from tests.rl.test_resume import STREAM


def test_sigterm_saves_a_final_checkpoint_and_exits_75(tmp_path):
    workdir = tmp_path / "run"
    # Checkpoints every 4 steps: the one written at SIGTERM (after step 2) is the final save,
    # at the end of the step it came in or, stopped mid-step, numbered by the step to redo.
    process = subprocess.Popen(harness.command(workdir, "--config.checkpoint.every_steps=4"),
                               env=harness.env(), stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
    harness.wait_for_step(process, workdir, 2)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=600)
    assert process.returncode == PREEMPTED_EXIT_CODE, stderr[-3000:]
    assert "Preempted: SIGTERM" in stderr and "Traceback" not in stderr

    rows = harness.metrics(workdir)
    assert {"rollouts/context_cuts", "rollouts/context_drops"} <= rows[-1].keys()  # counted
    last = rows[-1]["step"]
    assert last in (2, 3)
    saved = f"SIGTERM at step {last}; checkpoint saved" in stderr
    assert saved or f"SIGTERM in step {last + 1}; checkpoint {last + 1} saved" in stderr
    step, _, version = harness.latest_checkpoint(workdir)
    assert sorted(int(p.name) for p in (workdir / "checkpoints").iterdir()) == [step]
    assert (step, version) == (last if saved else last + 1, rows[-1]["policy_version"])


SLOW_RUN = Path(__file__).with_name("slow_step_run.py")
# 3 steps of the streaming scheduler, 8 optimizer updates a step (2 mini-batches, 4 epochs).
SLOW_OVERRIDES = (*STREAM, "--config.total_steps=3", "--config.learner.mini_batches=2",
                  "--config.learner.ppo_epochs=4", "--config.checkpoint.every_steps=1")
# Counted per collect: a collect restored mid-way, or redone from its groups put back, counts
# only what it decoded itself.
PER_COLLECT = ("stream/problems_admitted", "stream/occupancy", "stream/deferred_seconds")


def _preempt(workdir: Path, marker: str, overrides=SLOW_OVERRIDES, **slow: str) -> str:
    """Runs the slow script with `overrides` on `workdir` until `marker` appears, sends SIGTERM,
    and returns its stderr after asserting the exit code 75 within the default grace period
    (25 s). Its stderr goes to a file beside `workdir` (nothing reads a pipe meanwhile)."""
    log = workdir.with_name(f"{workdir.name}.{marker}.stderr")
    with open(log, "w") as stderr_file:
        process = subprocess.Popen(
            harness.command(workdir, *overrides, script=SLOW_RUN),
            env=harness.env(PYTHONPATH=str(harness.REPO), **slow), stdout=subprocess.DEVNULL,
            stderr=stderr_file)
    deadline = time.time() + 600
    while not (workdir / marker).exists():
        assert process.poll() is None, log.read_text()[-3000:]
        assert time.time() < deadline, f"no {marker} after 600 s"
        time.sleep(0.1)
    start = time.monotonic()
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=120)
    elapsed = time.monotonic() - start
    stderr = log.read_text()
    assert process.returncode == PREEMPTED_EXIT_CODE, stderr[-3000:]
    assert elapsed <= 25, f"exited {elapsed:.1f} s after SIGTERM"
    assert "ran out" not in stderr and "Traceback" not in stderr, stderr[-3000:]
    return stderr


def test_sigterm_mid_rollout_and_mid_update_exits_75_in_time_and_resumes_exactly(tmp_path):
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    subprocess.run(harness.command(straight, *SLOW_OVERRIDES, script=SLOW_RUN),
                   env=harness.env(PYTHONPATH=str(harness.REPO)), check=True,
                   capture_output=True, timeout=900)

    # Step 2's collect (policy version 1) decodes a round per 5 s for at least 60 s.
    stderr = _preempt(stopped, "slow_collect", SLOW_COLLECT="1")
    assert "SIGTERM in step 2; checkpoint 2 saved to redo the step from" in stderr
    assert [row["step"] for row in harness.metrics(stopped)] == [1]
    # Resumed, step 2's collect goes on from the requests in flight; each micro-batch of its 8
    # updates takes 8 s: stopped after the first micro-batch, the step is saved as it was
    # before its update.
    stderr = _preempt(stopped, "slow_update", SLOW_UPDATE="8")
    assert "SIGTERM in step 2; checkpoint 2 saved to redo the step from" in stderr
    assert [row["step"] for row in harness.metrics(stopped)] == [1]
    step, _, version = harness.latest_checkpoint(stopped)
    assert (step, version) == (2, 1)  # before step 2's update
    subprocess.run(harness.command(stopped, *SLOW_OVERRIDES, script=SLOW_RUN),
                   env=harness.env(PYTHONPATH=str(harness.REPO)), check=True,
                   capture_output=True, timeout=900)

    rows, resumed = harness.metrics(straight), harness.metrics(stopped)
    assert all(row["update/grad_norm"] > 0 for row in rows)  # the updates move the weights
    assert [row["step"] for row in resumed] == [1, 2, 3]
    for a, b in zip(rows, resumed, strict=True):
        assert a.keys() == b.keys()
        for key in a:
            if not key.startswith(PER_COLLECT) and a[key] is not None:
                np.testing.assert_allclose(b[key], a[key], rtol=1e-5, atol=1e-7, err_msg=key)
    _, params_a, _ = harness.latest_checkpoint(straight)
    _, params_b, _ = harness.latest_checkpoint(stopped)
    for a, b in zip(params_a, params_b, strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_sigterm_mid_update_of_the_per_step_scheduler_redoes_the_step_from_its_start(tmp_path):
    """Checkpoints every 2 steps: stopped in step 2's update, the run saves step 2's start (no
    checkpoint 1 holds it) and, resumed, ends as the uninterrupted run."""
    step_run = ("--config.total_steps=3", "--config.learner.mini_batches=2",
                "--config.learner.ppo_epochs=4", "--config.checkpoint.every_steps=2")
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    env = harness.env(PYTHONPATH=str(harness.REPO))
    subprocess.run(harness.command(straight, *step_run, script=SLOW_RUN), env=env, check=True,
                   capture_output=True, timeout=900)
    # In pipeline mode with two segments per output no group completes in step 1: step 2 makes
    # the run's first updates.
    stderr = _preempt(stopped, "slow_update", step_run, SLOW_UPDATE="0")
    assert "SIGTERM in step 2; checkpoint 2 saved to redo the step from" in stderr
    step, _, version = harness.latest_checkpoint(stopped)
    assert (step, version) == (2, 0)  # before step 2's update
    subprocess.run(harness.command(stopped, *step_run, script=SLOW_RUN), env=env, check=True,
                   capture_output=True, timeout=900)
    assert harness.metrics(stopped) == harness.metrics(straight)
