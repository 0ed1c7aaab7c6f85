"""experiments/run.py whose checkpoint reads fail with an I/O error for the first $OUTAGE_S
seconds of a simulated clock that only the checkpoint module's retry waits advance (so a 60 s
outage takes no real time). Fault-injection helper."""
import errno
import os
import runpy
import sys
import types
from pathlib import Path

import orbax.checkpoint as ocp

from mars_jax import checkpoint

OUTAGE_S = float(os.environ["OUTAGE_S"])
_clock = [0.0]
_restore = ocp.CheckpointManager.restore


def sleep(seconds: float) -> None:
    _clock[0] += seconds


def restore(self, step, *args, **kwargs):
    if _clock[0] < OUTAGE_S:
        raise OSError(errno.EIO, f"storage unavailable (injected, t={_clock[0]:g}s)")
    return _restore(self, step, *args, **kwargs)


checkpoint.time = types.SimpleNamespace(sleep=sleep)
ocp.CheckpointManager.restore = restore
run = Path(__file__).resolve().parents[2] / "experiments/run.py"
sys.argv[0] = str(run)
runpy.run_path(str(run), run_name="__main__")
