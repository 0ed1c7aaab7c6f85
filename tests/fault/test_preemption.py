"""Preemption: SIGTERM to a training process -> final checkpoint, clean exit with code 75."""
import signal
import subprocess

from mars_jax.rl.trainer import PREEMPTED_EXIT_CODE
from tests.fault import harness


def test_sigterm_saves_a_final_checkpoint_and_exits_75(tmp_path):
    workdir = tmp_path / "run"
    # Checkpoints every 4 steps: a checkpoint at the SIGTERM step (2 or 3) is the final save.
    process = subprocess.Popen(harness.command(workdir, "--config.checkpoint.every_steps=4"),
                               env=harness.env(), stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
    harness.wait_for_step(process, workdir, 2)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=600)
    assert process.returncode == PREEMPTED_EXIT_CODE, stderr[-3000:]
    assert "Preempted: SIGTERM at step" in stderr and "Traceback" not in stderr

    rows = harness.metrics(workdir)
    assert {"rollouts/context_cuts", "rollouts/context_drops"} <= rows[-1].keys()  # counted
    last = rows[-1]["step"]
    assert last in (2, 3)
    assert sorted(int(p.name) for p in (workdir / "checkpoints").iterdir())[-1] == last
    step, _, version = harness.latest_checkpoint(workdir)
    assert (step, version) == (last, rows[-1]["policy_version"])
