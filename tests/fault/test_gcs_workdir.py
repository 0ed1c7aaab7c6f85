"""A training run whose workdir is a `gs://` URL, on a local fake GCS server (`tests/fake_gcs.py`):
metrics, TensorBoard events, checkpoints (orbax through tensorstore's GCS driver), the run's
config.json and a profiler trace all land in the bucket; a run SIGKILLed mid-way and resumed from
the bucket ends with an uninterrupted run's metrics and parameters; two processes train one job
on one gs:// workdir and resume from it."""
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

from mars_jax import storage
from tests import fake_gcs
from tests.cpu_env import cpu_env
from tests.distributed.processes import finish, free_port
from tests.fault import harness

STEPS = 2
SLOW = harness.REPO / "tests/fault/slow_step_run.py"  # parity rewards; SLOW_COLLECT: a slow step


@pytest.fixture
def gcs(monkeypatch):
    with fake_gcs.bucket(monkeypatch) as root:
        yield root


def test_a_run_killed_and_resumed_on_gcs_ends_as_the_uninterrupted_run(gcs):
    straight, killed = f"{gcs}/straight", f"{gcs}/killed"
    total = f"--config.total_steps={STEPS}"
    subprocess.run(harness.command(straight, total, "--config.profile_steps=1,2", script=SLOW),
                   env=harness.env(PYTHONPATH=str(harness.REPO)), check=True,
                   capture_output=True, timeout=900)
    written = storage.files(straight)
    assert "metrics.jsonl" in written and "config.json" in written
    assert any(name.startswith("tensorboard/events.out.tfevents") for name in written)
    assert any(name.startswith("tensorboard/plugins/profile/") and name.endswith(".xplane.pb")
               for name in written), written
    assert {f"checkpoints/{step}/commit_success.txt" for step in (1, 2)} <= set(written)
    recorded = json.loads(storage.path(f"{straight}/config.json").read_text())
    assert recorded["total_steps"] == STEPS and recorded["profile_steps"] == [1, 2]

    # Step 2's collect (policy version 1) lasts >= 60 s: the kill lands in it, not after it.
    process = subprocess.Popen(harness.command(killed, total, script=SLOW),
                               env=harness.env(PYTHONPATH=str(harness.REPO), SLOW_COLLECT="1"),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    harness.wait_for_step(process, killed, 1)
    committed = storage.path(killed) / "checkpoints" / "1" / "commit_success.txt"
    while not committed.exists():  # killed in step 2, with checkpoint 1 to resume from
        assert process.poll() is None, "the run ended before checkpoint 1 was committed"
        time.sleep(0.2)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert len(harness.metrics(killed)) < STEPS
    resumed = subprocess.run(harness.command(killed, total, script=SLOW),
                             env=harness.env(PYTHONPATH=str(harness.REPO)),
                             capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from step" in resumed.stdout

    step_a, params_a, _ = harness.latest_checkpoint(straight)
    step_b, params_b, _ = harness.latest_checkpoint(killed)
    assert step_a == step_b == STEPS
    for a, b in zip(params_a, params_b, strict=True):
        np.testing.assert_array_equal(a, b)
    rows, resumed = harness.metrics(straight), harness.metrics(killed)
    assert [r["step"] for r in rows] == [r["step"] for r in resumed] == [1, 2]
    for a, b in zip(rows, resumed):
        assert a == b, {k: (a.get(k), b.get(k)) for k in a.keys() | b.keys() if a.get(k) != b.get(k)}


def _two_processes(workdir: str, total_steps: int) -> list[str]:
    port = free_port()
    runs = [subprocess.Popen(
        harness.command(workdir, f"--config.total_steps={total_steps}",
                        f"--coordinator_address=localhost:{port}", "--num_processes=2",
                        f"--process_id={pid}", "--config.mesh.data=1", "--config.mesh.fsdp=2",
                        "--config.mesh.dcn.data=2", "--config.learner.micro_batch_size=4"),
        env=cpu_env(devices=2, PYTHONPATH=str(harness.REPO)), cwd=harness.REPO,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for pid in range(2)]
    return finish(runs, timeout=900)


def test_two_processes_train_and_resume_on_one_gcs_workdir(gcs):
    workdir = f"{gcs}/two"
    _two_processes(workdir, total_steps=1)
    outputs = _two_processes(workdir, total_steps=2)
    assert all("resumed from step 1" in output for output in outputs)
    assert [row["step"] for row in harness.metrics(workdir)] == [1, 2]
    assert [row["step"] for row in harness.metrics(f"{workdir}/host1")] == [1, 2]
    written = storage.files(workdir)
    assert "config.json" in written and "checkpoints/2/commit_success.txt" in written
    step, _, version = harness.latest_checkpoint(workdir)
    assert step == 2 and version == 2


def test_checkpoints_on_gcs_drop_a_save_cut_short_and_set_a_damaged_step_aside(gcs):
    """In this process: orbax saves through tensorstore's GCS driver. On GCS orbax writes a step
    in place: one without its commit marker (a save cut short) is removed when the manager
    opens; a committed step missing a file is moved to `checkpoints.unreadable/` on restore and
    the step before it restored."""
    import jax.numpy as jnp
    from mars_jax.checkpoint import Checkpointer
    directory = f"{gcs}/run/checkpoints"
    checkpointer = Checkpointer(directory, async_save=False)
    for step in (1, 2, 3):
        checkpointer.save(step, {"w": jnp.arange(4.0) * step}, {"data": step})
    checkpointer.close()
    (storage.path(directory) / "3" / "commit_success.txt").unlink()
    (storage.path(directory) / "2" / "meta" / "metadata").unlink()
    checkpointer = Checkpointer(directory)
    try:
        step, state, meta, _ = checkpointer.restore_latest({"w": jnp.zeros(4)})
    finally:
        checkpointer.close()
    assert step == 1 and meta["data"] == 1
    np.testing.assert_array_equal(state["w"], np.arange(4.0))
    assert "2/_CHECKPOINT_METADATA" in storage.files(f"{gcs}/run/checkpoints.unreadable")
    assert {name.split("/")[0] for name in storage.files(directory)} == {"1"}


@pytest.mark.slow
def test_the_sft_job_writes_its_metrics_and_models_to_gcs(gcs):
    """The README's warm start as the `sft` job, two steps, on a `gs://` workdir: metrics,
    TensorBoard events, the probed step's and the final HF model, and the summary land in the
    bucket, and the final model loads back from there."""
    from mars_jax.models import from_pretrained
    workdir = f"{gcs}/sft"
    done = subprocess.run(
        [sys.executable, str(harness.RUN), "--config=" + str(harness.REPO / "experiments/configs/quickstart.py"),
         f"--workdir={workdir}", "--config.job=sft", "--config.sft.steps=2", "--config.sft.eval_every=1",
         "--config.sft.probe_every=2", f"--config.jax_cache_dir={os.environ['JAX_COMPILATION_CACHE_DIR']}"],
        env=harness.env(), cwd=harness.REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    written = storage.files(workdir)
    assert {"metrics.jsonl", "summary.json", "model/config.json", "model/model.safetensors",
            "model_step2/config.json", "model_step2/model.safetensors"} <= set(written), written
    assert any(name.startswith("tensorboard/events.out.tfevents") for name in written)
    assert [row["step"] for row in harness.metrics(workdir)] == [0, 1, 2]
    summary = json.loads(storage.path(f"{workdir}/summary.json").read_text())
    assert summary["loss"] == harness.metrics(workdir)[-1]["heldout/loss"]
    with tempfile.TemporaryDirectory() as local:
        storage.copy_tree(f"{workdir}/model", local)
        assert from_pretrained(local).config.num_hidden_layers == 2  # sft.arch 'mini'
