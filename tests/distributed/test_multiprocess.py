"""Two CPU processes (gloo collectives, one global mesh) train like one process.

Both runs see the same global batch: every process builds it from a fixed seed and contributes the
rows its devices hold (`distributed.global_train_batch`); the single process holds all rows on a
mesh of the same shape (4 devices). Two update steps must then give the same parameters, and the
two-process run must save an orbax checkpoint from both hosts and restore it, each host's own
checkpoint arrays included.
"""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.cpu_env import cpu_env
from tests.distributed.processes import free_port

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("multiprocess_worker.py")


def _start(out: Path, devices: int, *args: str) -> subprocess.Popen:
    out.mkdir(exist_ok=True)
    env = cpu_env(devices=devices, PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, str(WORKER), f"--out={out}", *args], env=env,
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow
def test_two_processes_match_one_process(tmp_path):
    port = free_port()
    runs = [_start(tmp_path / "single", 4)] + [
        _start(tmp_path / "multi", 2, f"--coordinator=localhost:{port}", "--num_processes=2",
               f"--process_id={i}") for i in range(2)]
    try:
        outputs = [run.communicate(timeout=900)[0] for run in runs]
    finally:
        for run in runs:
            run.kill()
    for name, run, output in zip(("single", "process 0", "process 1"), runs, outputs):
        assert run.returncode == 0, f"{name} failed:\n{output[-3000:]}"
    single = np.load(tmp_path / "single" / "params.npz")
    multi = np.load(tmp_path / "multi" / "params.npz")
    assert sorted(single.files) == sorted(multi.files)
    for name in single.files:
        np.testing.assert_allclose(multi[name], single[name], rtol=0, atol=1e-6, err_msg=name)
    reference = json.loads((tmp_path / "single" / "process0.json").read_text())
    assert reference["moved"] > 1e-4  # the two updates changed the parameters
    for pid in range(2):
        report = json.loads((tmp_path / "multi" / f"process{pid}.json").read_text())
        np.testing.assert_allclose(report["losses"], reference["losses"], rtol=1e-6)
        assert report["restored_step"] == 2 and report["restored_equal"]
        assert report["meta"] == {"process": pid, "rows": 4}
        assert report["routing_equal"]  # each host its own arrays back, though names collide
        assert report["any_process"] is True
