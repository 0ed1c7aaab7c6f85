"""Agentic pipeline parallelism: what each training step decodes and trains on.

pipeline    One decode per step. Its batch holds `prompts_per_step` new problems for the Solver
            plus every pending input of later stages (spawned by earlier steps) and every partial
            segment. Each group that completes in the step goes straight into the step's update.
sequential  The comparison mode: each step takes `prompts_per_step` new problems and decodes until
            every trajectory is complete (one decode per stage level and segment), then trains on
            all of them. Only complete trajectories are trained.
"""
from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Iterator, Sequence

from mars_jax.rl.rollout import AgenticRollouts, Generator, Rollout

MODES = ("pipeline", "sequential")


@dataclasses.dataclass(frozen=True)
class StepRollouts:
    """A step's completed groups plus what its decodes held."""

    groups: list[list[Rollout]]
    decode_batches: list[collections.Counter]  # per decode call: requests per stage
    generated_tokens: int


def rollout_step(engine: AgenticRollouts, problems: Iterator[dict], generate: Generator, *,
                 mode: str, prompts_per_step: int, step: int, version: int,
                 any_process: Callable[[bool], bool] = bool) -> StepRollouts:
    """Runs one step's decodes in `mode`; new problems get uids `'{step}-{i}'`.

    With several processes, `generate` is a collective and `any_process` must be
    `distributed.any_process`: a sequential step then decodes until no host has work left, and a
    host whose own work is done takes part with an empty request list."""
    if mode not in MODES:
        raise ValueError(f"pipeline.mode: {mode!r} is not one of {MODES}")
    new = [next(problems) for _ in range(prompts_per_step)]
    engine.add_problems(new, [f"{step}-{i}" for i in range(len(new))])
    groups: list[list[Rollout]] = []
    batches: list[collections.Counter] = []
    tokens = 0
    while any_process(bool(engine.pending)):
        batch, requests = engine.take_requests(version)  # empty on a host without work
        outputs = generate(requests)
        if batch:
            batches.append(collections.Counter(r.stage for r in batch))
            tokens += sum(len(o.token_ids) for o in outputs)
            groups += engine.absorb(batch, outputs, version)
        if mode == "pipeline":
            break
    return StepRollouts(groups=groups, decode_batches=batches, generated_tokens=tokens)


def trainable(groups: Sequence[list[Rollout]], roles_trained: str) -> list[list[Rollout]]:
    """Groups of the roles being trained: 'all' (MarsRL), 'solver' (MarsRL-S), 'vc' (MarsRL-VC)."""
    allowed = {"all": {"solver", "verifier", "corrector"}, "solver": {"solver"},
               "vc": {"verifier", "corrector"}}
    if roles_trained not in allowed:
        raise ValueError(f"rollout.roles_trained: {roles_trained!r} is not one of {sorted(allowed)}")
    return [g for g in groups if g[0].role in allowed[roles_trained]]
