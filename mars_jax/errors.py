"""Errors every floor may raise about a run's configuration; imports nothing of mars_jax."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Problem:
    """One unusable field: what is wrong and how to fix it."""

    field: str
    problem: str
    fix: str

    def __str__(self) -> str:
        return f"{self.field}: {self.problem}; fix: {self.fix}"


class ConfigError(ValueError):
    """The config cannot run; the message names each field with its problem and fix."""

    exit_code = 2  # EX_USAGE-like: nothing was built

    def __init__(self, problems: list[Problem]):
        self.problems = problems
        lines = "\n".join(f"  {p}" for p in problems)
        super().__init__(f"invalid config ({len(problems)} problem(s)):\n{lines}")
