"""What a run prints to the console: notes, the progress bar's per-role rewards and truncation, and
the summary, read back from the workdir so that it describes a resumed run as a whole.
"""
from __future__ import annotations

import math
import shlex
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import tqdm

from mars_jax import storage
from mars_jax.metrics import read_rows
from mars_jax.types import ROLES


def note(message: str) -> None:
    """One line on stdout that does not break a progress bar."""
    tqdm.tqdm.write(message, file=sys.stdout)


def _finite(value) -> bool:
    return value is not None and math.isfinite(value)


def postfix(metrics: Mapping[str, float]) -> dict[str, str]:
    """The progress bar's postfix: this step's mean reward per role, and where not zero the share
    cut off by the token budget (`cut 75%`) and of Verifier replies without a verdict (`no
    verdict 40%`)."""
    out = {}
    for role in ROLES:
        reward, cut = metrics.get(f"reward/{role}"), metrics.get(f"truncated/{role}")
        if _finite(reward):
            out[role] = f"{reward:.2f}" + (f" cut {cut:.0%}" if _finite(cut) and cut > 0 else "")
    no_verdict = metrics.get("verifier/no_verdict")
    if "verifier" in out and _finite(no_verdict) and no_verdict > 0:
        out["verifier"] += f" no verdict {no_verdict:.0%}"
    return out


def read_metrics(workdir: str | Path) -> list[dict]:
    """The rows of `workdir/metrics.jsonl` in step order, up to a line a crash cut."""
    path = storage.path(workdir) / "metrics.jsonl"
    if not path.exists():
        return []
    return sorted(read_rows(path), key=lambda row: row["step"])


def window(rows: Sequence[dict]) -> int:
    """How many steps the summary averages at each end: a quarter of them, at least one."""
    return max(1, len(rows) // 4)


def step_mean(rows: Sequence[dict], key: str) -> float:
    """Mean over `rows` of the steps' `key` (steps without a finite value left out; nan if none)."""
    values = [row[key] for row in rows if _finite(row.get(key))]
    return float(np.mean(values)) if values else math.nan


def summary(workdir: str | Path, command: Sequence[str], seconds: float) -> str:
    """The closing summary of a training run in `workdir`, rerun with `command` to resume."""
    workdir = storage.path(workdir)
    rows = [row for row in read_metrics(workdir) if row["step"] >= 1]  # not the step-0 probe
    if not rows:
        return f"no steps recorded in {workdir / 'metrics.jsonl'}"
    k, last = window(rows), rows[-1]
    ends = lambda key: [step_mean(part, key) for part in (rows[:k], rows[-k:])]  # first, last
    samples = " · ".join(f"{role} {sum(row.get(f'samples/{role}', 0) for row in rows)}"
                         for role in ROLES)
    trained = sum(row.get("samples/trained", 0) for row in rows)
    lines = [f"MarsRL: {len(rows)} steps to step {last['step']} (policy version "
             f"{last.get('policy_version', '?')}); this run took {seconds:.0f} s",
             f"  samples per role  {samples} ({trained} in the loss)",
             f"  mean reward       first {k} steps -> last {k} steps"]
    for role in ROLES:
        first_mean, last_mean = ends(f"reward/{role}")
        if math.isfinite(first_mean) or math.isfinite(last_mean):
            lines.append(f"    {role:<15} {first_mean:.3f} -> {last_mean:.3f} "
                         f"({last_mean - first_mean:+.3f})")
    cut = {role: ends(f"truncated/{role}") for role in ROLES}
    cut = {role: pair for role, pair in cut.items() if any(map(math.isfinite, pair))}
    if cut:
        lines.append(f"  cut off by the token budget (no reward), first {k} -> last {k} steps")
        lines += [f"    {role:<15} {first:.0%} -> {last:.0%}"
                  for role, (first, last) in cut.items()]
    no_verdict = ends("verifier/no_verdict")
    if any(map(math.isfinite, no_verdict)):
        lines += ["  Verifier replies without a readable verdict, cut off or not (no reward)",
                  f"    {'verifier':<15} {no_verdict[0]:.0%} -> {no_verdict[1]:.0%}"]
    lines += [f"  metrics      {workdir / 'metrics.jsonl'}",
              f"  TensorBoard  tensorboard --logdir {workdir / 'tensorboard'}",
              f"  checkpoints  {workdir / 'checkpoints'}",
              f"  resume       {shlex.join(command)}  (add --config.total_steps=N to train on)"]
    return "\n".join(lines)
