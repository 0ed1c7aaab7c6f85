"""Two CPU processes run `experiments/run.py` as one job: a global mesh across them (its data axis
across the hosts, `mesh.dcn`), each host decoding its own problems on its own engine, one update
on the joined batch, checkpoints from both hosts, and a resume that continues from the saved step
on each host (one step, then a resume for one more). Runs with the slow tests."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cpu_env import cpu_env
from tests.distributed.processes import finish, free_port


ROOT = Path(__file__).resolve().parents[2]


def _run_job(workdir: Path, total_steps: int) -> list[str]:
    """Both processes of the smoke job to `total_steps`; returns their outputs."""
    port = free_port()
    env = cpu_env(devices=2, PYTHONPATH=str(ROOT))
    runs = [subprocess.Popen(
        [sys.executable, "experiments/run.py", "--config=experiments/configs/smoke.py",
         f"--workdir={workdir}", f"--coordinator_address=localhost:{port}", "--num_processes=2",
         f"--process_id={pid}", f"--config.total_steps={total_steps}",
         f"--config.jax_cache_dir={os.environ['JAX_COMPILATION_CACHE_DIR']}",
         "--config.mesh.data=1", "--config.mesh.fsdp=2", "--config.mesh.dcn.data=2",
         "--config.rollout.prompts_per_step=1", "--config.rollout.drop_zero_variance=False",
         "--config.checkpoint.every_steps=1"],
        env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for pid in range(2)]
    return finish(runs, timeout=1200)


def _steps(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_two_processes_train_checkpoint_and_resume(tmp_path):
    _run_job(tmp_path, total_steps=1)
    assert _steps(tmp_path / "metrics.jsonl") == [1]
    assert _steps(tmp_path / "host1" / "metrics.jsonl") == [1]
    [first] = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert first["samples/solver"] == 4  # each host decoded its own problem (group of 4)
    assert first["policy_version"] == 1 and first["update/finite"] == 1
    meta = json.loads((tmp_path / "checkpoints" / "1" / "meta" / "metadata").read_text())
    data = [process["data"] for process in meta["processes"]]  # each host's own problem shard
    assert [(d["shard_index"], d["shard_count"]) for d in data] == [(0, 2), (1, 2)]
    # Pipeline mode admits problems ahead of the update: each host's iterator stands after the
    # problems its scheduler took (saved with its queue).
    taken = [process["stream"]["state"]["problems_admitted"] for process in meta["processes"]]
    assert [d["next_index"] for d in data] == taken and min(taken) >= 1
    outputs = _run_job(tmp_path, total_steps=2)
    assert all("resumed from step 1" in output for output in outputs)
    assert _steps(tmp_path / "metrics.jsonl") == [1, 2]
    assert _steps(tmp_path / "host1" / "metrics.jsonl") == [1, 2]
    last = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["policy_version"] == 2 and last["update/finite"] == 1
    assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())[-1] == 2
