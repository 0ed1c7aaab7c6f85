"""experiments/run.py with a NaN advantage on a loss token of the update batch of each step in
$POISON_STEPS (comma-separated), which makes that update's loss and gradient NaN.
Fault-injection helper."""
import os
import runpy
import sys
from pathlib import Path

import numpy as np

from mars_jax.rl import trainer

POISON_STEPS = {int(s) for s in os.environ["POISON_STEPS"].split(",")}
_step = 0  # steps of this (fresh) run so far: the trainer takes a step's samples once a step
_training_samples, _make_batch = trainer.training_samples, trainer.make_batch


def training_samples(*args, **kwargs):
    global _step
    _step += 1
    return _training_samples(*args, **kwargs)


def make_batch(*args, **kwargs):
    batch = _make_batch(*args, **kwargs)
    if _step in POISON_STEPS:
        # The first row's advantage is NaN and its last token is in the loss (even if its
        # sample was not: the update skips micro-batches without loss tokens).
        advantages, loss_mask = np.array(batch.advantages), np.array(batch.loss_mask)
        advantages.flat[0] = np.nan
        loss_mask[0, 0, int(np.asarray(batch.attention_mask)[0, 0].sum()) - 1] = 1.0
        batch = batch.replace(advantages=advantages, loss_mask=loss_mask)
    return batch


trainer.training_samples, trainer.make_batch = training_samples, make_batch
run = Path(__file__).resolve().parents[2] / "experiments/run.py"
sys.argv[0] = str(run)
runpy.run_path(str(run), run_name="__main__")
