"""What a run prints to the console: notes, the progress bar's per-role rewards, the summary.

The summary is read back from what the training job wrote in its workdir (`metrics.jsonl`, the
`tensorboard/` and `checkpoints/` directories), so it describes a resumed run as a whole.
"""
from __future__ import annotations

import math
import shlex
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import tqdm

from mars_jax.metrics import read_rows

ROLES = ("solver", "verifier", "corrector")


def note(message: str) -> None:
    """One line on stdout that does not break a progress bar."""
    tqdm.tqdm.write(message, file=sys.stdout)


def postfix(metrics: Mapping[str, float]) -> dict[str, str]:
    """The progress bar's postfix: this step's mean reward of each role that had samples."""
    values = {role: metrics.get(f"reward/{role}") for role in ROLES}
    return {role: f"{v:.2f}" for role, v in values.items() if v is not None and math.isfinite(v)}


def read_metrics(workdir: str | Path) -> list[dict]:
    """The rows of `workdir/metrics.jsonl` in step order ([] when there is none), up to a line
    cut short by a crash (`metrics.read_rows`)."""
    path = Path(workdir) / "metrics.jsonl"
    if not path.exists():
        return []
    return sorted(read_rows(path), key=lambda row: row["step"])


def window(rows: Sequence[dict]) -> int:
    """How many steps the summary averages at each end: a quarter of them, at least one."""
    return max(1, len(rows) // 4)


def mean_reward(rows: Sequence[dict], role: str) -> float:
    """Mean over `rows` of the steps' mean `role` reward (steps without that role left out)."""
    values = [row[f"reward/{role}"] for row in rows if row.get(f"reward/{role}") is not None]
    return float(np.mean(values)) if values else math.nan


def summary(workdir: str | Path, command: Sequence[str], seconds: float) -> str:
    """The closing summary of a training run in `workdir`, rerun with `command` to resume."""
    workdir = Path(workdir)
    rows = [row for row in read_metrics(workdir) if row["step"] >= 1]  # not the step-0 probe
    if not rows:
        return f"no steps recorded in {workdir / 'metrics.jsonl'}"
    k, last = window(rows), rows[-1]
    samples = " · ".join(f"{role} {sum(row.get(f'samples/{role}', 0) for row in rows)}"
                         for role in ROLES)
    trained = sum(row.get("samples/trained", 0) for row in rows)
    lines = [f"MarsRL: {len(rows)} steps to step {last['step']} (policy version "
             f"{last.get('policy_version', '?')}); this run took {seconds:.0f} s",
             f"  samples per role  {samples} ({trained} in the loss)",
             f"  mean reward       first {k} steps -> last {k} steps"]
    for role in ROLES:
        first_mean, last_mean = mean_reward(rows[:k], role), mean_reward(rows[-k:], role)
        if math.isfinite(first_mean) or math.isfinite(last_mean):
            lines.append(f"    {role:<15} {first_mean:.3f} -> {last_mean:.3f} "
                         f"({last_mean - first_mean:+.3f})")
    lines += [f"  metrics      {workdir / 'metrics.jsonl'}",
              f"  TensorBoard  tensorboard --logdir {workdir / 'tensorboard'}",
              f"  checkpoints  {workdir / 'checkpoints'}",
              f"  resume       {shlex.join(command)}  (add --config.total_steps=N to train on)"]
    return "\n".join(lines)
