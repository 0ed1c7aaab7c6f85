"""A 2-configuration x 2-seed sweep of the smoke config through xmanager's local executor.

xmanager pins protobuf < 7 and lives in its own environment: set MARS_JAX_XM_PYTHON to that
environment's python (e.g. /tmp/xm_venv/bin/python); the jobs run with this interpreter.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _xm_python() -> str | None:
    candidates = [os.environ.get("MARS_JAX_XM_PYTHON"), sys.executable]
    for python in filter(None, candidates):
        probe = subprocess.run([python, "-c", "import xmanager.xm_local"], capture_output=True)
        if probe.returncode == 0:
            return python
    return None


@pytest.mark.slow
def test_sweep_runs_locally_through_xmanager(tmp_path):
    xm_python = _xm_python()
    if xm_python is None:
        pytest.skip("xmanager is not installed: it pins protobuf<7, so install it in its own "
                    "venv (pip install xmanager ml-collections) and set MARS_JAX_XM_PYTHON")
    env = dict(os.environ, HOME=str(tmp_path))  # xm_local keeps its sqlite db under $HOME
    result = subprocess.run(
        [xm_python, str(ROOT / "launch" / "xm_launch.py"), f"--python={sys.executable}",
         f"--workdir={tmp_path / 'sweep'}", "--config=experiments/configs/smoke.py",
         "--grid=config.optimizer.learning_rate=1e-4,3e-4", "--seeds=0,1",
         "--run_arg=--config.total_steps=1"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stderr[-4000:]
    runs = sorted(p.name for p in (tmp_path / "sweep").iterdir())
    assert runs == ["learning_rate=0.0001_seed=0", "learning_rate=0.0001_seed=1",
                    "learning_rate=0.0003_seed=0", "learning_rate=0.0003_seed=1"]
    for run in runs:
        lines = (tmp_path / "sweep" / run / "metrics.jsonl").read_text().splitlines()
        assert json.loads(lines[-1])["step"] == 1, run
