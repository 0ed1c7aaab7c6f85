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
`<workdir>/<run name>`. Each runs under launch/restart.py: rerun on exit 75 (preempted) or 74
(storage unavailable), up to `--max_restarts` times. `--venv=DIR` runs the jobs in a Python 3.11
venv made there with uv (the project installed with constraints.txt) when DIR has none; the
jobs' Python must be 3.11 or newer. `--dry_run` prints the command lines instead (no xmanager
needed).
"""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Sequence

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sweep as sweep_lib  # noqa: E402
import python_env  # noqa: E402

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
_VENV = flags.DEFINE_string("venv", "", "Run the jobs with DIR/bin/python, made (uv, Python "
                            "3.11, the project) when missing; replaces --python.")
_MAX_RESTARTS = flags.DEFINE_integer("max_restarts", 3, "Reruns of a job on exit 75 / 74.")
_BACKOFF_S = flags.DEFINE_float("backoff_s", 10.0, "First wait before a rerun (doubles).")
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


def job_command(python: str, max_restarts: int, backoff_s: float) -> list[str]:
    """The executable part of every job: run.py under launch/restart.py (the run's own
    arguments follow)."""
    return [python, str(sweep_lib.REPO / "launch" / "restart.py"), f"--max_restarts={max_restarts}",
            f"--backoff_s={backoff_s:g}", "--", python, str(sweep_lib.RUN_PY)]


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
    python = os.path.join(_VENV.value, "bin", "python") if _VENV.value else _PYTHON.value
    if _VENV.value and not os.path.exists(python):
        uv = shutil.which("uv") or "uv"
        for command in python_env.make_commands(_VENV.value, uv=uv):
            print(shlex.join(command), flush=True)
            if not _DRY_RUN.value:
                subprocess.run(command, check=True)
    command = job_command(python, _MAX_RESTARTS.value, _BACKOFF_S.value)
    if _DRY_RUN.value:
        for _, args in runs:
            print(shlex.join([*command, *args]))
        return
    try:
        python_env.check_python(python)
    except ValueError as e:
        raise app.UsageError(str(e)) from e
    if xm is None:
        raise app.UsageError("xmanager is not installed in this environment; see the docstring")
    with xm_local.create_experiment(experiment_title=_TITLE.value) as experiment:
        [executable] = experiment.package([xm.binary(
            executor_spec=xm_local.Local.Spec(), path=command[0], args=command[1:])])
        for name, args in runs:
            experiment.add(xm.Job(executable, executor=xm_local.Local(), args=args, name=name))
    print(f"experiment {experiment.experiment_id}: {len(runs)} runs under {_WORKDIR.value}")


if __name__ == "__main__":
    app.run(main)
