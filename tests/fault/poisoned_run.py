"""experiments/run.py with a NaN advantage in the update batch of each step in $POISON_STEPS
(comma-separated), which makes that update's loss and gradient NaN. Fault-injection helper."""
import os
import runpy
import sys
from pathlib import Path

import numpy as np

from mars_jax.rl import trainer

POISON_STEPS = {int(s) for s in os.environ["POISON_STEPS"].split(",")}
_step = 0
_rollout_step, _make_batch = trainer.rollout_step, trainer.make_batch


def rollout_step(*args, step, **kwargs):
    global _step
    _step = step
    return _rollout_step(*args, step=step, **kwargs)


def make_batch(*args, **kwargs):
    batch = _make_batch(*args, **kwargs)
    if _step in POISON_STEPS:
        advantages = np.array(batch.advantages)
        advantages.flat[0] = np.nan
        batch = batch.replace(advantages=advantages)
    return batch


trainer.rollout_step, trainer.make_batch = rollout_step, make_batch
run = Path(__file__).resolve().parents[2] / "experiments/run.py"
sys.argv[0] = str(run)
runpy.run_path(str(run), run_name="__main__")
