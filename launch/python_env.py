"""The jobs' Python environment: a venv of Python 3.11 made with uv (which fetches that Python
when the machine lacks it), the project installed with the tested versions; and a check that an
interpreter is new enough. Pure Python: no JAX."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PYTHON_VERSION = (3, 11)


def make_commands(venv: str, extras: str = "", uv: str = "uv") -> list[list[str]]:
    """The commands that make `venv` and install the project (`.[extras]`) into it."""
    target = f"{REPO}[{extras}]" if extras else str(REPO)
    return [[uv, "venv", "--python", ".".join(map(str, PYTHON_VERSION)), venv],
            [uv, "pip", "install", "--python", os.path.join(venv, "bin", "python"),
             "-c", str(REPO / "constraints.txt"), "-e", target]]


def check_python(python: str) -> None:
    """Raises ValueError unless `python` runs and is PYTHON_VERSION or newer."""
    probe = subprocess.run([python, "-c", "import sys; print(*sys.version_info[:2])"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        raise ValueError(f"--python: {python} does not run: {probe.stderr.strip()[-300:]}")
    version = tuple(int(v) for v in probe.stdout.split())
    if version < PYTHON_VERSION:
        raise ValueError(f"--python: {python} is Python {version[0]}.{version[1]}; the project "
                         f"needs {'.'.join(map(str, PYTHON_VERSION))} or newer (pass --venv=DIR "
                         "to make one)")
