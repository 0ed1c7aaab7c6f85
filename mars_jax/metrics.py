"""Per-step metrics: `metrics.jsonl` (one JSON object per step) and TensorBoard scalars, in a
local or `gs://` workdir (`mars_jax.storage`)."""
from __future__ import annotations

import json
import math
import os

from tensorboardX import SummaryWriter

from mars_jax import storage


def read_rows(path: str | os.PathLike) -> list[dict]:
    """The rows of a metrics.jsonl file in file order, up to the first line that is not a whole
    row (a line cut short by a crash: it and everything after are left out)."""
    rows = []
    for line in storage.path(path).read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            break
        if not isinstance(row, dict) or "step" not in row:
            break
        rows.append(row)
    return rows


class MetricsWriter:
    """Appends metrics to `workdir/metrics.jsonl` and `workdir/tensorboard`. Resuming from
    `resume_step`, lines of later steps are first dropped (atomically; -1: the file starts over).
    On `gs://` each row rewrites the object and TensorBoard's event file is uploaded at each
    flush."""

    def __init__(self, workdir: str | os.PathLike, *, resume_step: int = 0, tensorboard: bool = True):
        self.path = storage.path(workdir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            kept = [row for row in read_rows(self.path) if row["step"] <= resume_step]
            storage.write_text(self.path, "".join(json.dumps(row, sort_keys=True) + "\n"
                                                  for row in kept))
        self.tb = (SummaryWriter(os.fspath(storage.path(workdir) / "tensorboard"))
                   if tensorboard else None)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                 for k, v in metrics.items()}
        storage.append_text(self.path, json.dumps({"step": step, **clean}, sort_keys=True) + "\n")
        if self.tb is not None:
            for key, value in clean.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.tb.add_scalar(key, value, step)
            self.tb.flush()

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
