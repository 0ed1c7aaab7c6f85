"""One of 2 processes saving checkpoints 1 and 2 of a state split over both, then restoring with
process 1's view of the directory made stale. Test helper (`test_agreed_restore.py`):

  python tests/distributed/restore_worker.py --out=DIR --coordinator=localhost:PORT --process_id=I

First process 1 lists only step 1 (a cached listing from before step 2 was saved): every process
restores; then process 1 sees no commit marker in step 2 (its files not visible yet): every
process restores again and exits with the error's exit code. Writes `process{I}.json` (the step
and state restored the first time, the second restore's error) to `--out`.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import jax
import numpy as np

from mars_jax import checkpoint, distributed
from mars_jax.checkpoint import Checkpointer, CheckpointUnavailable


def state(step: int) -> dict:
    """`[2, 4]` float32 rows `10 * step + process`, split over the processes (a row each)."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("process",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("process"))
    row = np.full((1, 4), 10 * step + jax.process_index(), np.float32)
    return {"w": jax.make_array_from_process_local_data(sharding, row, (2, 4))}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--coordinator", required=True)
    parser.add_argument("--process_id", type=int, required=True)
    args = parser.parse_args()
    distributed.initialize(args.coordinator, 2, args.process_id)
    checkpoint.READ_RETRY_WAITS = ()
    directory = Path(args.out) / "checkpoints"
    saver = Checkpointer(directory, keep=5)
    for step in (1, 2):
        saver.save(step, state(step), {"step": step})
    saver.close()

    report = {}
    restorer = Checkpointer(directory, keep=5)
    if jax.process_index() == 1:
        restorer._steps = lambda: [1]  # its listing from before step 2 was saved
    step, restored, meta, _ = restorer.restore_latest(state(0))
    report["restored"] = [step, meta["step"], np.asarray(
        restored["w"].addressable_data(0)).tolist()]
    if jax.process_index() == 1:  # step 2's files not visible here yet
        marker = str(directory / "2" / checkpoint.COMMIT_MARKER)
        exists = os.path.exists
        os.path.exists = lambda path: exists(path) and str(path) != marker
    try:
        restorer.restore_latest(state(0))
    except CheckpointUnavailable as error:
        report["error"] = str(error)
        (Path(args.out) / f"process{args.process_id}.json").write_text(json.dumps(report))
        sys.exit(error.exit_code)
    (Path(args.out) / f"process{args.process_id}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
