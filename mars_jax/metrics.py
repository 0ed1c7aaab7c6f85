"""Per-step metrics: `metrics.jsonl` (one JSON object per step) and TensorBoard scalars."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

from tensorboardX import SummaryWriter


class MetricsWriter:
    """Appends metrics to `workdir/metrics.jsonl` and `workdir/tensorboard`. On resume from step
    `resume_step`, lines for later steps (written after that checkpoint) are dropped first; the
    file is rewritten atomically (temporary file + rename), so a crash then loses nothing."""

    def __init__(self, workdir: str | os.PathLike, *, resume_step: int = 0, tensorboard: bool = True):
        self.path = Path(workdir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            kept = []
            for line in self.path.read_text().splitlines():
                try:
                    if json.loads(line)["step"] <= resume_step:
                        kept.append(line)
                except (ValueError, KeyError):
                    break  # a line cut short by a crash: drop it and everything after
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text("".join(f"{line}\n" for line in kept))
            os.replace(tmp, self.path)
        self.tb = SummaryWriter(str(Path(workdir) / "tensorboard")) if tensorboard else None

    def write(self, step: int, metrics: dict[str, float]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                 for k, v in metrics.items()}
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **clean}, sort_keys=True) + "\n")
        if self.tb is not None:
            for key, value in clean.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.tb.add_scalar(key, value, step)
            self.tb.flush()

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
