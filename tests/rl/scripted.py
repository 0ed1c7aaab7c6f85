"""Driving `AgenticRollouts` by stage levels with a scripted generator (no engine): each level
decodes every pending rollout in one call, as the scheduler's sequential mode does."""
from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Iterator

from mars_jax.rl.rollout import AgenticRollouts, Rollout


@dataclasses.dataclass(frozen=True)
class Request:
    """What a scripted generator sees of a pending rollout."""

    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    role: str


def decode_level(rollouts: AgenticRollouts, generate: Callable, version: int = 0
                 ) -> list[list[Rollout]]:
    """Decodes every pending rollout with `generate(requests) -> outputs` (`EngineOutput`s of
    the new tokens) and returns the groups that completed."""
    batch, rollouts.pending = rollouts.pending, []
    if not batch:
        return []
    budgets = rollouts.config.max_new_tokens
    requests = [Request(tuple(r.prompt_ids + r.response_ids),
                        budgets[r.role] - len(r.response_ids), r.role) for r in batch]
    return rollouts.absorb(batch, generate(requests), version)


def decode_all(rollouts: AgenticRollouts, problems: Iterator[dict], generate: Callable, *,
               count: int, prefix: str = "1", version: int = 0
               ) -> tuple[list[list[Rollout]], list[collections.Counter]]:
    """Adds `count` problems (uids '{prefix}-{i}') and decodes level by level until nothing is
    pending: (the completed groups, per level the requests per stage)."""
    rollouts.add_problems([next(problems) for _ in range(count)],
                          [f"{prefix}-{i}" for i in range(count)])
    groups, levels = [], []
    while rollouts.pending:
        levels.append(collections.Counter(r.stage for r in rollouts.pending))
        groups += decode_level(rollouts, generate, version)
    return groups, levels
