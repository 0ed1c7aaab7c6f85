"""Sweeps: a config file's `get_sweep()` (or a grid given on the command line) x seeds, expanded
into one `experiments/run.py` command line per run. Pure Python: no JAX, no xmanager."""
from __future__ import annotations

import importlib.util
import itertools
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RUN_PY = REPO / "experiments" / "run.py"


def load_sweep(config: str) -> list[dict[str, Any]]:
    """`get_sweep()` of the config file `config` (`path[:arg]`; the arg is ignored here)."""
    path = Path(config.split(":", 1)[0])
    spec = importlib.util.spec_from_file_location(f"_sweep_{path.stem}", path)
    if spec is None or not path.is_file():
        raise ValueError(f"--config: {path} is not a config file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "get_sweep"):
        raise ValueError(f"--config: {path} defines no get_sweep(); pass --grid and --seeds")
    return [dict(point) for point in module.get_sweep()]


def parse_value(text: str) -> Any:
    """'1e-4' -> 0.0001, '3' -> 3, 'true' -> True, anything else stays a string."""
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def grid_sweep(grid: Sequence[str], seeds: Sequence[int]) -> list[dict[str, Any]]:
    """The product of `field=v1,v2,...` entries, times `seeds` (as `config.seed`)."""
    axes = []
    for entry in grid:
        field, sep, values = entry.partition("=")
        if not sep or not field.startswith("config.") or not values:
            raise ValueError(f"--grid: {entry!r} is not 'config.<field>=v1,v2,...'")
        axes.append([(field, parse_value(v)) for v in values.split(",")])
    points = [dict(combo) for combo in itertools.product(*axes)]
    return [dict(point, **{"config.seed": seed}) for point in points for seed in seeds]


def run_name(point: Mapping[str, Any]) -> str:
    """A short, filesystem-safe name of one point, e.g. 'learning_rate=1e-06_seed=0'."""
    parts = [f"{field.rsplit('.', 1)[-1]}={value}" for field, value in point.items()]
    return re.sub(r"[^A-Za-z0-9_.=+-]", "-", "_".join(parts))


def run_args(config: str, workdir: str, point: Mapping[str, Any],
             extra: Sequence[str] = ()) -> list[str]:
    """Arguments of `experiments/run.py` for one point of the sweep."""
    args = [f"--config={config}", f"--workdir={workdir}"]
    args += [f"--{field}={value}" for field, value in point.items()]
    return args + list(extra)
