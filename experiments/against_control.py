r"""Training rewards of RL runs against a no-update control on the same problem stream.

A run's training reward at step s is measured on the problems its data iterator drew for that
step; runs with the same `seed` draw the same problems, so a control run with
`--config.optimizer.learning_rate=0` gives each step's reward without learning. The per-step
difference (run - control) removes the problems' mix from the curve; its mean over windows of
steps, with a 95% normal interval over the window's steps, is what the updates did to the
policy's reward on fresh problems at the rollout temperature.

  python experiments/against_control.py --control=/tmp/ms7/marsrl_s_lr0 \
      /tmp/ms7/marsrl_s_seed0 /tmp/ms7/marsrl_lr3e5_seed0 [--role=solver --window=20]
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from absl import app, flags

from mars_jax import console

_CONTROL = flags.DEFINE_string("control", None, "Workdir of the learning-rate-0 run.",
                               required=True)
_ROLE = flags.DEFINE_enum("role", "solver", ["solver", "verifier", "corrector"], "Whose reward.")
_WINDOW = flags.DEFINE_integer("window", 20, "Steps per window.")


def step_rewards(workdir: str | Path, role: str) -> dict[int, float]:
    """Step -> mean `role` reward of `workdir/metrics.jsonl` (steps without that role left out)."""
    rows = console.read_metrics(workdir)
    if not rows:
        raise FileNotFoundError(f"{Path(workdir) / 'metrics.jsonl'}: no metrics (is this a "
                                "training run's workdir?)")
    return {r["step"]: r[f"reward/{role}"] for r in rows if r.get(f"reward/{role}") is not None}


def windowed_difference(run: Mapping[int, float], control: Mapping[int, float], window: int
                        ) -> list[dict[str, float]]:
    """Per window of `window` steps (1..window, ..), over the steps both have, then over all of
    them: mean of run - control and the half-width of its 95% normal interval (nan below 2
    steps)."""
    steps = sorted(set(run) & set(control))
    if not steps:
        return []
    spans = [(start, start + window - 1) for start in range(1, steps[-1] + 1, window)]
    result = []
    for first, last in [*spans, (steps[0], steps[-1])]:
        d = np.array([run[s] - control[s] for s in steps if first <= s <= last])
        if len(d) == 0:
            continue
        half = 1.96 * d.std(ddof=1) / np.sqrt(len(d)) if len(d) > 1 else float("nan")
        result.append({"first": first, "last": last, "steps": len(d),
                       "mean": float(d.mean()), "half_width": float(half)})
    return result


def table(runs: Sequence[str], control: str, role: str, window: int) -> str:
    base = step_rewards(control, role)
    lines = [f"{role} reward, run - control ({control}), mean ± the 95% half-width per window"]
    for run in runs:
        cells = [f"{w['first']}-{w['last']}: {w['mean']:+.3f} ±{w['half_width']:.3f}"
                 for w in windowed_difference(step_rewards(run, role), base, window)]
        if not cells:
            lines.append(f"{run}\n  no step where both have a {role} reward")
            continue
        lines.append(f"{run}\n  " + "\n  ".join(cells[:-1]) + f"\n  all {cells[-1]}")
    return "\n".join(lines)


def main(argv: Sequence[str]) -> None:
    if len(argv) < 2:
        raise app.UsageError("give one or more run workdirs after the flags")
    print(table(argv[1:], _CONTROL.value, _ROLE.value, _WINDOW.value))


if __name__ == "__main__":
    app.run(main)
