"""Two processes restore the step process 0 lists, whatever process 1's own (stale) view of the
checkpoint directory says; a step process 1 cannot see stops both with the same error (exit 74)
and sets nothing aside (`tests/distributed/restore_worker.py`)."""
import json
import subprocess
import sys
from pathlib import Path

from mars_jax.checkpoint import CheckpointUnavailable
from tests.cpu_env import cpu_env
from tests.distributed.processes import free_port

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("restore_worker.py")


def test_every_process_restores_the_step_process_0_lists(tmp_path):
    port = free_port()
    runs = [subprocess.Popen(
        [sys.executable, str(WORKER), f"--out={tmp_path}", f"--coordinator=localhost:{port}",
         f"--process_id={pid}"], cwd=ROOT, env=cpu_env(PYTHONPATH=str(ROOT)),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for pid in range(2)]
    try:
        outputs = [run.communicate(timeout=300)[0] for run in runs]
    finally:
        for run in runs:
            run.kill()
    reports = []
    for pid, (run, output) in enumerate(zip(runs, outputs)):
        assert run.returncode == CheckpointUnavailable.exit_code, f"{pid}:\n{output[-3000:]}"
        reports.append(json.loads((tmp_path / f"process{pid}.json").read_text()))
    for pid, report in enumerate(reports):  # step 2, each process its own row of it
        assert report["restored"] == [2, 2, [[20 + pid] * 4]], report
    assert reports[0]["error"] == reports[1]["error"]
    assert ("checkpoint 2 in" in reports[0]["error"]
            and "process 1: its directory has no commit marker" in reports[0]["error"])
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["1", "2"]
    assert not (tmp_path / "checkpoints.unreadable").exists()
