"""Where the problem JSONL files (the "manual dir") are found."""

from __future__ import annotations

import os

MANUAL_DIR_ENV = "MARS_JAX_DATA_DIR"
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHARED_DATA = os.path.join(os.path.dirname(_REPO_ROOT), "shared", "data")


def default_manual_dir() -> str:
    """`$MARS_JAX_DATA_DIR` if set, else `<repo root>/../shared/data` if it exists."""
    from_env = os.environ.get(MANUAL_DIR_ENV)
    if from_env:
        return from_env
    if os.path.isdir(SHARED_DATA):
        return SHARED_DATA
    raise FileNotFoundError(
        f"no data dir: ${MANUAL_DIR_ENV} is not set and {SHARED_DATA} does not exist; "
        "pass manual_dir= or set the variable"
    )
