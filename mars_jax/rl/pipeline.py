"""Agentic pipeline parallelism: what each training step decodes and trains on.

pipeline    One decode per step. Its batch holds up to `prompts_per_step` new problems for the
            Solver plus every pending input of later stages (spawned by earlier steps) and one
            more segment of every partial rollout. Each group that completes in the step goes
            straight into the step's update.
sequential  The comparison mode: each step takes `prompts_per_step` new problems and decodes until
            every trajectory is complete (one decode per stage level and segment), then trains on
            all of them. Only complete trajectories are trained.

Admission: a new problem is taken only while the pending rows (rollouts waiting for a decode,
partial ones included) are below `max_inflight_rows`, so the work in flight stays bounded;
`auto_inflight_rows` is the cap a run gets by default.
"""
from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Iterator, Sequence

from mars_jax.rl.rollout import (STAGE_ROLES, AgenticRollouts, Generator, Rollout, RolloutConfig,
                                 segments_needed)

MODES = ("pipeline", "sequential")
# rollout.roles_trained -> the roles whose groups are trained.
ROLES_TRAINED = {"all": ("solver", "verifier", "corrector"), "solver": ("solver",),
                 "vc": ("verifier", "corrector")}


@dataclasses.dataclass(frozen=True)
class StepRollouts:
    """A step's completed groups plus what its decodes held."""

    groups: list[list[Rollout]]
    decode_batches: list[collections.Counter]  # per decode call: requests per stage
    generated_tokens: int


def auto_inflight_rows(config: RolloutConfig, prompts_per_step: int) -> int:
    """The default cap on pending rows: the rows pipeline mode holds in flight in steady state,
    `prompts_per_step` new problems a step, when every output takes its whole budget: the rows
    of a step's trees (per problem a Solver group plus `fan_out` groups per later stage) times
    the segments of the longest output its stages decode (each stage then lasts that many steps)."""
    rows = prompts_per_step * config.group_size * (1 + config.fan_out * (config.max_stages - 1))
    return rows * max(segments_needed(config.max_new_tokens[role], config.segment_tokens)
                      for role in STAGE_ROLES[:config.max_stages])


def rollout_step(engine: AgenticRollouts, problems: Iterator[dict], generate: Generator, *,
                 mode: str, prompts_per_step: int, step: int, version: int,
                 max_inflight_rows: int | None = None,
                 any_process: Callable[[bool], bool] = bool) -> StepRollouts:
    """Runs one step's decodes in `mode`; new problems get uids `'{step}-{i}'`. At most
    `prompts_per_step` problems are admitted, each only while fewer than `max_inflight_rows`
    rows are pending (None: no cap); problems not admitted stay in `problems`.

    With several processes, `generate` is a collective and `any_process` must be
    `distributed.any_process`: a sequential step then decodes until no host has work left, and a
    host whose own work is done takes part with an empty request list."""
    if mode not in MODES:
        raise ValueError(f"pipeline.mode: {mode!r} is not one of {MODES}")
    for i in range(prompts_per_step):
        if max_inflight_rows is not None and len(engine.pending) >= max_inflight_rows:
            break
        engine.add_problems([next(problems)], [f"{step}-{i}"])
    groups: list[list[Rollout]] = []
    batches: list[collections.Counter] = []
    tokens = 0
    while any_process(bool(engine.pending)):
        batch, requests = engine.take_requests()  # empty on a host without work
        outputs = generate(requests)
        if batch:
            batches.append(collections.Counter(r.stage for r in batch))
            tokens += sum(len(o.token_ids) for o in outputs)
            groups += engine.absorb(batch, outputs, version)
        if mode == "pipeline":
            break
    return StepRollouts(groups=groups, decode_batches=batches, generated_tokens=tokens)


def max_staleness(groups: Sequence[list[Rollout]], version: int) -> int:
    """Versions between `version` (the policy the update applies to) and the first segment of the
    stalest sample in `groups` (members that finished early and waited included); 0 if none."""
    return max((version - r.first_version for g in groups for r in g), default=0)


def trainable(groups: Sequence[list[Rollout]], roles_trained: str) -> list[list[Rollout]]:
    """Groups of the roles being trained: 'all' (MarsRL), 'solver' (MarsRL-S), 'vc' (MarsRL-VC)."""
    if roles_trained not in ROLES_TRAINED:
        raise ValueError(f"rollout.roles_trained: {roles_trained!r} is not one of "
                         f"{sorted(ROLES_TRAINED)}")
    return [g for g in groups if g[0].role in ROLES_TRAINED[roles_trained]]
