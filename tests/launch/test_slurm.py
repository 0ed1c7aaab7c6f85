"""launch/slurm.sh and slurm.py: each task's experiments/run.py command from Slurm's environment
(a fake `srun` that starts the tasks as Slurm would set them up, in dry-run mode)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "launch"))
import slurm  # noqa: E402

FAKE_SRUN = """#!/usr/bin/env bash
# Starts the command once per node of SLURM_JOB_NODELIST's count (SLURM_NTASKS), as srun would.
for ((i = 0; i < SLURM_NTASKS; i++)); do
  args=(); for a in "$@"; do [[ "$a" == --ntasks-per-node=* ]] || args+=("$a"); done
  SLURM_PROCID=$i SLURM_STEP_NODELIST="$SLURM_JOB_NODELIST" "${args[@]}" || exit $?
done
"""


@pytest.mark.parametrize("nodelist, hosts", [
    ("node1", ["node1"]),
    ("gpu-[01-03,07],login1", ["gpu-01", "gpu-02", "gpu-03", "gpu-07", "login1"]),
    ("a[1-2]b[3-4]", ["a1b3", "a1b4", "a2b3", "a2b4"]),
    ("h[098-101]", ["h098", "h099", "h100", "h101"]),
])
def test_expand_nodelist(nodelist, hosts):
    assert slurm.expand_nodelist(nodelist) == hosts


def _sbatch(tmp_path, env):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "srun").chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", MARS_JAX_DRY_RUN="1",
               MARS_JAX_PYTHON=sys.executable, **env)
    return subprocess.run(["bash", "launch/slurm.sh", "--config=c.py", "--workdir=/shared/w"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


def test_each_task_gets_the_first_node_as_coordinator_and_its_own_id(tmp_path):
    done = _sbatch(tmp_path, {"SLURM_JOB_NODELIST": "gpu-[07-08]", "SLURM_NTASKS": "2"})
    assert done.returncode == 0, done.stderr
    run_py = ROOT / "experiments" / "run.py"
    assert done.stdout.splitlines() == [
        f"{sys.executable} {run_py} --coordinator_address=gpu-07:12355 --num_processes=2 "
        f"--process_id={i} --config=c.py --workdir=/shared/w" for i in (0, 1)]


def test_more_tasks_than_nodes_or_no_slurm_is_refused(tmp_path):
    done = _sbatch(tmp_path, {"SLURM_JOB_NODELIST": "gpu-07", "SLURM_NTASKS": "2"})
    assert done.returncode == 2 and "2 tasks on 1 nodes: run one task per node" in done.stderr
    with pytest.raises(ValueError, match="not inside a Slurm job step: SLURM_NTASKS, SLURM_PROCID"):
        slurm.run_command({}, 12355, [])
    with pytest.raises(ValueError, match="bad range 'x-2'"):
        slurm.expand_nodelist("n[x-2]")
