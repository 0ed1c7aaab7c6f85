"""Agent-granularity streaming on one continuous-batching engine (`rollout.scheduler='stream'`).

The engine (`mars_jax.sampling.Engine`, or anything with its `DecodeEngine` methods) runs for the
whole job and never drains between updates. Each output is graded as soon as it finishes
(`AgenticRollouts.absorb`); when its group's stage completes, the next stage's requests (chosen by
the selection policy) are submitted to the running engine at once.

pipeline    New problems are admitted while fewer than `max_inflight_rows` rollouts are in flight
            (submitted, or spawned and about to be). `collect` returns as soon as the complete
            groups hold `samples_per_update` trained samples, and hands out groups in completion
            order up to that many (more complete during an overlapped update: the rest wait for
            the next); decoding of everything else goes on after the update, on the new weights.
sequential  The barriers of synchronous training on the same engine: `prompts_per_step` problems
            at a time, a stage's requests enter only when every request of the stage before
            (of every problem of the batch) has finished, and `collect` returns only when every
            trajectory of its batches is complete (more batches while the trained samples are
            fewer than `samples_per_update`). Both modes train on the same update size.

Trained samples: members of complete groups of the roles trained whose rewards differ (a
zero-variance group adds no gradient).

Staleness: a rollout's `first_version` is the policy version when it was submitted. An update to
version v + 1 waits (decoding, admitting nothing new) while a rollout still to be trained (in
flight, or finished in an incomplete group) started before v + 1 - `staleness_bound`, so no
trained sample lags its first token by more than `staleness_bound` versions.

After an update (`weights_updated`), requests holding a slot continue per `resume`:
'recompute' re-prefills their prompt + tokens so far under the new weights (exactly on-policy KV,
and a run restored from a checkpoint decodes the same tokens as the uninterrupted run), 'keep'
goes on from the KV cache the old weights wrote (no prefill; a restored run re-prefills, so it
matches the uninterrupted one only up to that KV). Outputs are not cut into segments: a long
output keeps its slot across updates instead of holding one.

Order: the engine streams the outputs of one decode chunk in submission order and every choice
here (admission, spawn order, sequence seeds, selection) follows from the order of outputs, so a
run is reproducible whatever slots the requests landed in.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

from mars_jax.rl.pipeline import ROLES_TRAINED
from mars_jax.rl.rollout import AgenticRollouts, GenerationOutput, Rollout

MODES = ("pipeline", "sequential")
RESUME_MODES = ("recompute", "keep")


class DecodeEngine(Protocol):
    """What the scheduler uses of `mars_jax.sampling.Engine`."""

    stats: collections.Counter

    def submit(self, prompt_ids: Sequence[int], *, max_new_tokens: int, temperature: float,
               top_p: float, top_k: int, seed: int, stop_ids: Sequence[int], n: int,
               generated: tuple[Sequence[int], Sequence[float]] | None = None) -> list[int]: ...

    def stream(self, stop: Callable[[], bool] | None = None
               ) -> Iterator[tuple[int, object]]: ...

    def finished(self) -> list[tuple[int, object]]: ...

    def in_slots(self) -> list[int]: ...

    def partial(self, request_id: int) -> tuple[list[int], list[float]]: ...

    def recompute(self, request_ids: Sequence[int]) -> None: ...

    def update_weights(self, model) -> None: ...


@dataclasses.dataclass(frozen=True)
class StreamBatch:
    """What one `collect` produced."""

    groups: list[list[Rollout]]          # complete groups of the roles trained
    all_groups: list[list[Rollout]]      # every group completed (any role)
    generated_tokens: int
    seconds: float                       # wall time of the collect (clock of the scheduler)
    deferred_seconds: float              # of which the update was due but held by staleness
    problems_admitted: int
    inflight: int                        # rollouts in flight when it returned
    staleness: list[int]                 # version - first_version per trained sample
    occupancy: float                     # generated tokens / (decode steps x slots)


class StreamingRollouts:
    """Feeds `rollouts`' requests to `engine` and hands out complete groups per update."""

    def __init__(self, rollouts: AgenticRollouts, engine: DecodeEngine, problems: Iterator[dict],
                 *, mode: str, prompts_per_step: int, samples_per_update: int,
                 max_inflight_rows: int, staleness_bound: int, resume: str, roles_trained: str,
                 drop_zero_variance: bool, sampling: dict, stop_ids: Sequence[int],
                 clock: Callable[[], float] = time.perf_counter):
        if mode not in MODES:
            raise ValueError(f"rollout.mode: {mode!r} is not one of {MODES}")
        if resume not in RESUME_MODES:
            raise ValueError(f"rollout.resume: {resume!r} is not one of {RESUME_MODES}")
        if roles_trained not in ROLES_TRAINED:
            raise ValueError(f"rollout.roles_trained: {roles_trained!r} is not one of "
                             f"{sorted(ROLES_TRAINED)}")
        if samples_per_update < 1 or prompts_per_step < 1 or max_inflight_rows < 1:
            raise ValueError("samples_per_update, prompts_per_step and max_inflight_rows must be "
                             f">= 1; got {samples_per_update}, {prompts_per_step}, "
                             f"{max_inflight_rows}")
        self.rollouts, self.engine, self.problems = rollouts, engine, problems
        self.mode, self.prompts_per_step = mode, prompts_per_step
        self.samples_per_update, self.max_inflight_rows = samples_per_update, max_inflight_rows
        self.staleness_bound, self.resume = staleness_bound, resume
        self.roles = ROLES_TRAINED[roles_trained]
        self.drop_zero_variance = drop_zero_variance
        self.sampling, self.stop_ids, self.clock = dict(sampling), tuple(stop_ids), clock
        self.problems_admitted = 0                   # problems taken so far (uids 'p{n}')
        self._inflight: dict[int, Rollout] = {}      # engine request id -> rollout
        self._ready: list[list[Rollout]] = []        # complete groups not yet handed out

    # --- one update's worth ----------------------------------------------------------------

    def collect(self, version: int) -> StreamBatch:
        """Decodes until an update is due (module docstring) and returns what completed."""
        start, tokens = self.clock(), self.engine.stats["tokens"]
        slot_steps = self.engine.stats["slot_steps"]
        admitted, deferred_since, deferred = self.problems_admitted, None, 0.0
        while True:
            if self._ready_samples() >= self.samples_per_update:
                if self._fresh_enough(version):
                    break
                deferred_since = self.clock() if deferred_since is None else deferred_since
            if self.mode == "pipeline":
                if not self._decode_pipeline(version, until=lambda: self._due(version)):
                    raise RuntimeError("stream: nothing to decode and no update due "
                                       f"({self._ready_samples()} trained samples ready)")
            else:
                self._decode_sequential_batch(version)
        if deferred_since is not None:
            deferred = self.clock() - deferred_since
        groups, self._ready = self._hand_out(version)
        trained = [g for g in groups if g[0].role in self.roles]
        generated = self.engine.stats["tokens"] - tokens
        return StreamBatch(
            groups=trained, all_groups=groups, generated_tokens=generated,
            occupancy=generated / max(1, self.engine.stats["slot_steps"] - slot_steps),
            seconds=self.clock() - start, deferred_seconds=deferred,
            problems_admitted=self.problems_admitted - admitted, inflight=len(self._inflight),
            staleness=[version - r.first_version for g in trained if self._size(g) for r in g])

    def decode_while(self, busy: Callable[[], bool], version: int) -> None:
        """Pipeline mode: keeps decoding and admitting while `busy()` (the update to
        `version + 1` running on other devices; checked after every decode chunk); what completes
        meanwhile is handed out by the next `collect`. Work started now is trained one version
        later at the earliest, so with `staleness_bound=0` nothing starts (and by the staleness
        gate nothing is in flight): the run then trains exactly what one shared mesh trains."""
        if self.mode != "pipeline":
            raise ValueError("decode_while: only pipeline mode overlaps rollout with an update")
        if self.staleness_bound < 1:
            return
        while busy():
            if not self._decode_pipeline(version, until=lambda: not busy()):
                return

    def weights_updated(self, model, version: int) -> None:
        """Decodes with `model` from now on; requests in slots go on per `resume`."""
        del version  # requests keep their first_version; the next submissions get the new one
        self.engine.update_weights(model)
        if self.resume == "recompute":
            self.engine.recompute(self.engine.in_slots())

    # --- decoding --------------------------------------------------------------------------

    def _decode_pipeline(self, version: int, *, until: Callable[[], bool]) -> bool:
        """Admits, submits and streams until `until()` or the engine runs dry; False when there
        was nothing to decode."""
        self._admit()
        self._submit(version)
        if not self._inflight:
            return False
        for request_id, output in self.engine.stream(stop=until):
            self._absorb(request_id, output, version)
            if until():
                break
            self._admit()
            self._submit(version)
        for request_id, output in self.engine.finished():
            self._absorb(request_id, output, version)
        return True

    def _decode_sequential_batch(self, version: int) -> None:
        """One synchronous batch: `prompts_per_step` problems decoded stage level by stage level
        (the engine drains between levels) until every trajectory is complete."""
        for _ in range(self.prompts_per_step):
            self._take_problem()
        while self.rollouts.pending:
            self._submit(version)
            for request_id, output in self.engine.stream():
                self._absorb(request_id, output, version)

    def _take_problem(self) -> None:
        uid = f"p{self.problems_admitted}"
        self.problems_admitted += 1
        self.rollouts.add_problems([next(self.problems)], [uid])

    def _admit(self) -> None:
        """Pipeline: new problems while rows in flight are below the cap, unless an update is
        due (then only the work in flight continues)."""
        while (len(self._inflight) + len(self.rollouts.pending) < self.max_inflight_rows
               and self._ready_samples() < self.samples_per_update):
            self._take_problem()

    def _submit(self, version: int) -> None:
        """Submits every pending rollout: members of a group spawned together as one request
        group (prompt prefilled once), a restored partial output as a continuation."""
        pending, self.rollouts.pending = self.rollouts.pending, []
        budgets = self.rollouts.config.max_new_tokens

        def key(item):
            index, r = item
            if r.response_ids:
                return ("continue", index)
            return (tuple(r.prompt_ids), r.role, r.seed - index)  # consecutive seeds together

        for _, run in itertools.groupby(enumerate(pending), key=key):
            members = [r for _, r in run]
            first = members[0]
            generated = ((first.response_ids, first.logprobs) if first.response_ids else None)
            ids = self.engine.submit(first.prompt_ids, max_new_tokens=budgets[first.role],
                                     seed=first.seed, stop_ids=self.stop_ids, n=len(members),
                                     generated=generated, **self.sampling)
            for request_id, r in zip(ids, members):
                if r.first_version is None:
                    r.first_version = version
                self._inflight[request_id] = r

    def _absorb(self, request_id: int, output, version: int) -> None:
        rollout = self._inflight.pop(request_id)
        done = len(rollout.response_ids)
        reason = "stop" if output.finish_reason == "stop" else "length"
        new = GenerationOutput(tuple(output.tokens[done:]), tuple(output.logprobs[done:]), reason,
                               output.expert_ids)
        self._ready += self.rollouts.absorb([rollout], [new], version)

    # --- when an update is due -------------------------------------------------------------

    def _size(self, group: list[Rollout]) -> int:
        """Trained samples of a complete group (module docstring)."""
        if group[0].role not in self.roles:
            return 0
        if self.drop_zero_variance and len({r.reward for r in group}) == 1:
            return 0
        return len(group)

    def _hand_out(self, version: int) -> tuple[list[list[Rollout]], list[list[Rollout]]]:
        """(groups for this update, groups kept for the next). Sequential: all. Pipeline: in
        completion order until `samples_per_update` trained samples, plus every group that
        would lag beyond the bound at the next update and every group with nothing to train."""
        if self.mode == "sequential":
            return self._ready, []
        oldest = version + 1 - self.staleness_bound
        now, later, count = [], [], 0
        for group in self._ready:
            size = self._size(group)
            if (not size or count < self.samples_per_update
                    or min(r.first_version for r in group) < oldest):
                now.append(group)
                count += size
            else:
                later.append(group)
        return now, later

    def _ready_samples(self) -> int:
        return sum(self._size(g) for g in self._ready)

    def _fresh_enough(self, version: int) -> bool:
        """An update to `version + 1` keeps every rollout still to be trained within the bound."""
        oldest = version + 1 - self.staleness_bound
        return all(r.first_version >= oldest for r in self._untrained())

    def _due(self, version: int) -> bool:
        return (self._ready_samples() >= self.samples_per_update
                and self._fresh_enough(version))

    def _untrained(self) -> Iterator[Rollout]:
        """Rollouts in flight (or restored from a checkpoint, not yet resubmitted) and finished
        members of incomplete groups."""
        yield from self._inflight.values()
        yield from (r for r in self.rollouts.pending if r.first_version is not None)
        size = self.rollouts.config.group_size
        for tree in self.rollouts.trees.values():
            for members in tree.finished.values():
                counts = collections.Counter(r.group_key for r in members)
                yield from (r for r in members if counts[r.group_key] < size)

    # --- checkpointing ---------------------------------------------------------------------

    def state_dict(self) -> dict:
        """JSON-serialisable state: the rollouts (in-flight ones as pending partial outputs, in
        submission order, ahead of those not yet submitted), complete groups not yet handed out
        and counters (recorded routing apart: `routing`)."""
        inflight = []
        for request_id in sorted(self._inflight):
            rollout = dataclasses.replace(self._inflight[request_id])
            tokens, logprobs = self.engine.partial(request_id)
            rollout.response_ids, rollout.logprobs = tokens, logprobs
            inflight.append(rollout.to_json())
        state = self.rollouts.state_dict()
        state["pending"] = inflight + state["pending"]
        return dict(rollouts=state, problems_admitted=self.problems_admitted,
                    ready=[[r.to_json() for r in g] for g in self._ready])

    def routing(self) -> dict:
        """Recorded expert ids, by uid, of every rollout still to be trained that has them."""
        ready = {r.uid: r.expert_ids for g in self._ready for r in g if r.expert_ids is not None}
        return {**self.rollouts.routing(), **ready}

    def load_state_dict(self, state: dict, routing=None) -> None:
        """Restores `state_dict()` output into a fresh engine's scheduler: the partial outputs
        are resubmitted (prefilled as prompt + tokens so far) at the next `collect`."""
        if self._inflight:
            raise ValueError("load_state_dict: the engine already has requests in flight")
        routing = routing or {}
        self.rollouts.load_state_dict(state["rollouts"], routing)
        self.problems_admitted = state["problems_admitted"]
        self._ready = [[dataclasses.replace(Rollout(**r), expert_ids=routing.get(r["uid"]))
                        for r in g] for g in state.get("ready", [])]
