r"""XManager launcher: a sweep (hyper-parameter grid x seeds) of `experiments/run.py`, run locally.

xmanager pins protobuf < 7, older than the project needs: install it in its own environment and
let the jobs run with the project's Python (`--python`):

  python -m venv /tmp/xm_venv && /tmp/xm_venv/bin/pip install xmanager ml-collections
  /tmp/xm_venv/bin/python launch/xm_launch.py --python=$(which python) --workdir=/tmp/sweep \
      --config=experiments/configs/marsrl_qwen3_30b_a3b.py:runlocal
  # a grid for a config without get_sweep(), extra arguments for every run:
  /tmp/xm_venv/bin/python launch/xm_launch.py --python=$(which python) --workdir=/tmp/sweep \
      --config=experiments/configs/smoke.py --grid=config.optimizer.learning_rate=1e-4,3e-4 \
      --seeds=0,1 --run_arg=--config.total_steps=2

The sweep is the config file's `get_sweep()` unless `--grid` is given. Each run is one work unit of
one experiment on the `xm_local.Local` executor (a local process, no Docker); its workdir is
`<workdir>/<run name>`. `--dry_run` prints the command lines instead (no xmanager needed).
"""
from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Sequence

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sweep as sweep_lib  # noqa: E402

try:
    from xmanager import xm, xm_local
except ImportError:  # --dry_run works without xmanager
    xm = xm_local = None

_CONFIG = flags.DEFINE_string("config", None, "Config file (path[:arg]) passed to run.py.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Root directory; each run gets a subdirectory.")
_PYTHON = flags.DEFINE_string("python", sys.executable,
                              "Python interpreter of the project's environment (runs the jobs).")
_GRID = flags.DEFINE_multi_string("grid", [], "config.<field>=v1,v2,... (replaces get_sweep()).")
_SEEDS = flags.DEFINE_list("seeds", ["0"], "Seeds for --grid.")
_RUN_ARGS = flags.DEFINE_multi_string("run_arg", [], "Extra argument for every run.")
_TITLE = flags.DEFINE_string("title", "mars_jax sweep", "Experiment title.")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Print the run commands, launch nothing.")
flags.mark_flags_as_required(["config", "workdir"])


def expand(config: str, grid: Sequence[str], seeds: Sequence[int] | None) -> list[dict]:
    """The sweep's points: the --grid product x seeds (default [0]), else the config's
    `get_sweep()` (then `seeds` must be None: a config's sweep names its own seeds)."""
    if not grid and seeds is not None:
        raise ValueError("--seeds applies to --grid; a config's get_sweep() sets its own seeds")
    points = (sweep_lib.grid_sweep(grid, [0] if seeds is None else seeds) if grid
              else sweep_lib.load_sweep(config))
    names = [sweep_lib.run_name(p) for p in points]
    if len(set(names)) != len(names):
        raise ValueError("sweep: two runs would share a workdir; make the grid points distinct")
    return points


def main(argv: Sequence[str]) -> None:
    del argv
    try:
        points = expand(_CONFIG.value, _GRID.value,
                        [int(s) for s in _SEEDS.value] if _SEEDS.present else None)
    except ValueError as e:
        raise app.UsageError(str(e)) from e
    runs = [(sweep_lib.run_name(p),
             sweep_lib.run_args(_CONFIG.value, os.path.join(_WORKDIR.value, sweep_lib.run_name(p)),
                                p, _RUN_ARGS.value)) for p in points]
    if _DRY_RUN.value:
        for _, args in runs:
            print(shlex.join([_PYTHON.value, str(sweep_lib.RUN_PY), *args]))
        return
    if xm is None:
        raise app.UsageError("xmanager is not installed in this environment; see the docstring")
    with xm_local.create_experiment(experiment_title=_TITLE.value) as experiment:
        [executable] = experiment.package([xm.binary(
            executor_spec=xm_local.Local.Spec(), path=_PYTHON.value,
            args=[str(sweep_lib.RUN_PY)])])
        for name, args in runs:
            experiment.add(xm.Job(executable, executor=xm_local.Local(), args=args, name=name))
    print(f"experiment {experiment.experiment_id}: {len(runs)} runs under {_WORKDIR.value}")


if __name__ == "__main__":
    app.run(main)
