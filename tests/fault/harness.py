"""Tiny smoke training runs in subprocesses (one CPU device, the shared compilation cache)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np

from mars_jax import storage
from mars_jax.checkpoint import Checkpointer
from tests.cpu_env import cpu_env
from tests.rl.test_resume import OVERRIDES  # the same shapes, so compiled programs are shared

REPO = Path(__file__).resolve().parents[2]
RUN = REPO / "experiments/run.py"
TIMING_KEYS = ("time/", "tokens_per_second", "stream/deferred_seconds", "stream/sync_seconds")


def command(workdir: Path | str, *overrides: str, script: Path = RUN) -> list[str]:
    """`script` (run.py or a wrapper of it) on the smoke config with the tiny-run overrides."""
    return [sys.executable, str(script),
            "--config=" + str(REPO / "experiments/configs/smoke.py"), f"--workdir={workdir}",
            f"--config.jax_cache_dir={os.environ['JAX_COMPILATION_CACHE_DIR']}",
            *OVERRIDES, *overrides]


def env(**extra: str) -> dict[str, str]:
    return cpu_env(**extra)  # one CPU device


def metrics(workdir: Path | str) -> list[dict]:
    """metrics.jsonl rows without timings (a local or gs:// workdir); a torn last line is
    ignored."""
    path = storage.path(workdir) / "metrics.jsonl"
    rows = []
    for line in (path.read_text().splitlines() if path.exists() else []):
        try:
            rows.append(json.loads(line))
        except ValueError:
            break
    return [{k: v for k, v in row.items() if not k.startswith(TIMING_KEYS)} for row in rows]


def wait_for_step(process: subprocess.Popen, workdir: Path | str, step: int,
                  timeout: float = 600) -> None:
    """Blocks until metrics.jsonl has a row for `step` (asserting the run is still going)."""
    deadline = time.time() + timeout
    while not any(row["step"] >= step for row in metrics(workdir)):
        assert process.poll() is None, f"run exited with {process.returncode} before step {step}"
        assert time.time() < deadline, f"no step {step} after {timeout}s"
        time.sleep(0.1)


def latest_checkpoint(workdir: Path | str) -> tuple[int, list[np.ndarray], int]:
    """(step, parameter leaves, policy version) of the newest intact checkpoint."""
    from mars_jax.models import create_model, get_preset
    from mars_jax.optimizer import make_optimizer
    from mars_jax.rl.update import init_train_state
    abstract = init_train_state(create_model(get_preset("tiny")), make_optimizer(1e-4))
    checkpointer = Checkpointer(storage.path(workdir) / "checkpoints")
    try:
        step, state, meta, _ = checkpointer.restore_latest(abstract)
    finally:
        checkpointer.close()
    version = meta["processes"][0]["policy_version"]
    return step, jax.tree.leaves(jax.tree.map(np.asarray, state.params)), version
