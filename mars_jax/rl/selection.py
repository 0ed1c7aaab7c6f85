"""Choosing the parents of the next MarsRL stage.

Verifier stage: every Solver solution is eligible, wrong ones preferred. Corrector stage: reports
that found an error are eligible, those on an actually wrong solution preferred. `fan_out` picks
without replacement: 'random', 'balanced' (preferred and others equally where possible) or
'adaptive' (preferred first).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal

import numpy as np

POLICIES = ("random", "balanced", "adaptive")
STAGES = ("verifier", "corrector")


@dataclasses.dataclass(frozen=True)
class Candidate:
    """An output of the previous stage: `is_correct`, whether the (judged) solution is actually
    correct; `verdict`, the parsed Verifier verdict (False = error found; unused for solutions)."""

    is_correct: bool
    verdict: bool | None = None


def select_parents(
    candidates: Sequence[Candidate],
    *,
    stage: Literal["verifier", "corrector"],
    fan_out: int = 2,
    policy: str,
    rng: np.random.Generator,
) -> list[int]:
    """Indices (ascending) of at most ``fan_out`` candidates chosen as parents."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; valid policies: {POLICIES}")
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; valid stages: {STAGES}")
    if fan_out < 0:
        raise ValueError(f"fan_out must be >= 0, got {fan_out}")

    eligible = [i for i, c in enumerate(candidates) if stage == "verifier" or c.verdict is False]
    if policy == "random":
        return sorted(rng.permutation(eligible)[:fan_out].tolist())
    preferred = rng.permutation([i for i in eligible if not candidates[i].is_correct]).tolist()
    others = rng.permutation([i for i in eligible if candidates[i].is_correct]).tolist()
    if policy == "adaptive":
        return sorted((preferred + others)[:fan_out])
    want_preferred = fan_out // 2 + (fan_out % 2) * int(rng.integers(2))
    n_others = min(fan_out - min(want_preferred, len(preferred)), len(others))
    n_preferred = min(fan_out - n_others, len(preferred))
    return sorted(preferred[:n_preferred] + others[:n_others])
