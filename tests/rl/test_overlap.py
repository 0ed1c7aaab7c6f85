"""Rollout on its own submesh, overlapped with the update (8 fake CPU devices, split 4:4): at
staleness bound 0 the run trains exactly what the shared-mesh run trains; at bound 1 it decodes
during updates and no trained sample lags more than one version. Rewards are the parity of each
rollout's index in its group (`tests/fault/parity_reward_run.py`), so every update moves the
parameters."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from tests.cpu_env import cpu_env

REPO = Path(__file__).resolve().parents[2]
OVERRIDES = [
    "--config.total_steps=3", "--config.rollout.group_size=2", "--config.rollout.prompts_per_step=1",
    "--config.rollout.max_new_tokens.solver=16", "--config.rollout.max_new_tokens.verifier=16",
    "--config.rollout.max_new_tokens.corrector=16", "--config.rollout.max_stages=3",
    "--config.rollout.decode_engine=engine", "--config.rollout.engine_slots=4",
    "--config.rollout.samples_per_update=4", "--config.learner.micro_batch_size=8",
]
# Timing, and occupancy: the shared mesh rounds the engine up to 8 slots, the 4-device one has 4.
SKIP = ("time/", "tokens_per_second", "stream/deferred_seconds", "sync/seconds",
        "stream/occupancy")


def _run(workdir, *extra):
    env = cpu_env(devices=8)
    subprocess.run([sys.executable, str(REPO / "tests/fault/parity_reward_run.py"),
                    "--config=" + str(REPO / "experiments/configs/smoke.py"),
                    f"--workdir={workdir}",
                    f"--config.jax_cache_dir={os.environ['JAX_COMPILATION_CACHE_DIR']}",
                    *OVERRIDES, *extra], env=env, check=True, capture_output=True, timeout=900)
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def test_split_mesh_at_staleness_0_trains_what_one_mesh_trains(tmp_path):
    shared = _run(tmp_path / "shared", "--config.rollout.staleness_bound=0")
    split = _run(tmp_path / "split", "--config.rollout.staleness_bound=0",
                 "--config.mesh.rollout.devices=4")
    assert [0 < r["sync/bytes_per_device"] < r["sync/bytes"] for r in split] == [True] * 3
    assert all(r["update/grad_norm"] > 0 for r in shared)  # every update moved the weights
    for a, b in zip(shared, split, strict=True):
        assert a.keys() | {"sync/bytes", "sync/bytes_per_device", "sync/seconds"} == b.keys()
        for key in a:
            if key.startswith(SKIP) or a[key] is None:  # None: a role absent from the step
                assert key.startswith(SKIP) or b[key] is None, key
                continue
            np.testing.assert_allclose(b[key], a[key], rtol=1e-5, atol=1e-7, err_msg=key)


def test_split_mesh_decodes_during_the_update_within_the_staleness_bound(tmp_path):
    rows = _run(tmp_path / "split", "--config.rollout.staleness_bound=1",
                "--config.mesh.rollout.devices=4")
    assert max(r["staleness/max"] for r in rows) == 1  # work decoded during an update
    assert all(r["policy_version"] == i + 1 for i, r in enumerate(rows))
