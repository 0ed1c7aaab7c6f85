"""README.md's main command, as CI runs it: the warm start is built (a fresh cache), MarsRL trains
all three roles with non-zero rewards and gradients, the Solver's reward rises, the console shows
the summary and no library INFO logs; a rerun reuses the warm start and resumes."""
import os
import re
import subprocess
import sys
from pathlib import Path

from mars_jax import console

REPO = Path(__file__).resolve().parents[1]


def _run(workdir: Path, cache: Path) -> str:
    """README's main command on `workdir`, with the warm start cached in `cache`."""
    command = [sys.executable, "experiments/run.py", "--config=experiments/configs/quickstart.py",
               f"--workdir={workdir}", f"--config.warm_start.cache_dir={cache}",
               f"--config.jax_cache_dir={os.environ['JAX_COMPILATION_CACHE_DIR']}"]
    env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu")  # one CPU device, as on a laptop
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    return output


def test_main_job_learns_and_summarises(tmp_path):
    workdir, cache = tmp_path / "run", tmp_path / "warm_start"
    output = _run(workdir, cache)
    assert "warm start: 300 SFT steps" in output
    assert not re.search(r"^I\d{4} \d\d:\d\d", output, re.MULTILINE), "absl INFO logs shown"
    rows = console.read_metrics(workdir)
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1)) and len(rows) == 20
    for role in console.ROLES:
        assert any((r.get(f"reward/{role}") or 0) > 0 for r in rows), role
    assert all(r["update/grad_norm"] > 0 for r in rows)
    k = console.window(rows)
    first, last = (console.step_mean(part, "reward/solver") for part in (rows[:k], rows[-k:]))
    assert last > first, (first, last)
    for line in ("mean reward", f"{first:.3f} -> {last:.3f}", str(workdir / "metrics.jsonl"),
                 "tensorboard --logdir", str(workdir / "checkpoints"), "resume"):
        assert line in output, line

    again = _run(workdir, cache)  # the same command: warm start reused, training resumed
    assert "warm start: reusing" in again and f"resumed from step {len(rows)}" in again
    assert f"{first:.3f} -> {last:.3f}" in again
