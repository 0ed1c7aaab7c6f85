"""Checked reading of problem JSONL files (one JSON object per line)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Mapping

REQUIRED_FIELDS = ("id", "problem", "answer")
NON_EMPTY_FIELDS = ("id", "problem")  # an empty answer is kept: upstream DSR-sub has one
OPTIONAL_FIELDS: Mapping[str, type] = {"source": str, "answer_as_in_source": str}


class MalformedRowError(ValueError):
    """A row of a JSONL file that is not a valid problem; names the file and line."""

    def __init__(self, path: str | os.PathLike, line: int, reason: str) -> None:
        super().__init__(f"{path}:{line}: {reason}")
        self.path, self.line, self.reason = str(path), line, reason


@dataclasses.dataclass
class ReadResult:
    """Valid rows, and a description (`path:line: reason`) of each skipped one."""

    rows: list[dict]
    skipped: list[str]


def _check_row(row: object, extra_fields: Mapping[str, type], seen_ids: set[str]) -> dict:
    """The row with defaults filled in, or ValueError naming the offending field."""
    if not isinstance(row, dict):
        raise ValueError(f"expected a JSON object, got {type(row).__name__}")
    for name in REQUIRED_FIELDS:
        value = row.get(name)
        if not isinstance(value, str):
            got = "missing" if name not in row else type(value).__name__
            raise ValueError(f"field '{name}' must be a string ({got})")
        if name in NON_EMPTY_FIELDS and not value.strip():
            raise ValueError(f"field '{name}' is empty")
    if row["id"] in seen_ids:
        raise ValueError(f"duplicate id '{row['id']}'")
    checked = {name: row[name] for name in REQUIRED_FIELDS}
    for name, kind in {**OPTIONAL_FIELDS, **extra_fields}.items():
        value = row.get(name, kind())
        if type(value) is not kind:  # bool is not an int here
            raise ValueError(f"field '{name}' must be {kind.__name__}, got {type(value).__name__}")
        checked[name] = value
    return checked


def read_problems(
    path: str | os.PathLike,
    *,
    extra_fields: Mapping[str, type] | None = None,
    skip_malformed: bool = False,
) -> ReadResult:
    """Rows of a problem JSONL file, each with string `id`, `problem`, `answer`: `id` and
    `problem` non-empty, ids unique; an empty `answer` is kept and logged (no response can match
    it). Optional fields are type-checked and default to "" / 0; other keys are dropped; blank
    lines are ignored. A malformed row raises `MalformedRowError`, or with `skip_malformed` is
    skipped and listed in `ReadResult.skipped`."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"problem file not found: {path}")
    rows: list[dict] = []
    skipped: list[str] = []
    seen_ids: set[str] = set()
    with open(path, "rb") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:  # UnicodeDecodeError and json.JSONDecodeError are ValueErrors too
                row = _check_row(json.loads(line.decode("utf-8")), extra_fields or {}, seen_ids)
            except ValueError as error:
                if not skip_malformed:
                    raise MalformedRowError(path, line_number, str(error)) from None
                skipped.append(f"{path}:{line_number}: {error}")
                continue
            seen_ids.add(row["id"])
            rows.append(row)
    logger = logging.getLogger(__name__)
    if skipped:
        logger.warning("skipped %d malformed rows of %s, first: %s", len(skipped), path, skipped[0])
    empty = [row["id"] for row in rows if not row["answer"].strip()]
    if empty:
        logger.warning("%s: %d rows have an empty answer (never gradable): %s", path, len(empty), empty[:5])
    return ReadResult(rows, skipped)
