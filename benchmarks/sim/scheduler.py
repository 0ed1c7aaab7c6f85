"""A stand-in for `mars_jax.rl.streaming.StreamingRollouts` (not on main yet), written to the
streaming contract (/work/briefs/streaming_api.md) and to the rules of the lead's draft, so
`benchmarks/pipeline_sim.py` switches to the real one by import:
`collect(version)`, `decode_while(busy, version)`, `weights_updated(model, version)`.

pipeline    The engine never drains: a finished output is absorbed (graded, its group's next
            stage spawned) at once and the new requests enter the running engine. New problems
            are admitted while fewer than `max_inflight_rows` rollouts are in flight (submitted
            or pending) and no update is due. An update is due once the complete groups hold
            `samples_per_update` trained samples and every rollout still to be trained started
            at version >= version + 1 - `staleness_bound` (else decoding goes on, admitting
            nothing). Outputs are not cut into segments; after an update, requests in slots go
            on per `resume` ('recompute': re-prefilled under the new weights; 'keep': no cost).
sequential  `prompts_per_step` problems at a time; a stage's requests enter only once the engine
            has drained the previous stage of every problem of the batch; more batches while
            fewer than `samples_per_update` samples are complete.
Trained samples: members of complete groups of the roles trained whose rewards differ.
Sequence seeds come from a counter at spawn (consecutive within a group).
"""
from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence

from mars_jax.rl.rollout import AgenticRollouts, GenerationOutput, Rollout

ROLES_TRAINED = {"all": ("solver", "verifier", "corrector"), "solver": ("solver",),
                 "vc": ("verifier", "corrector")}


@dataclasses.dataclass
class StreamBatch:
    groups: list[list[Rollout]]        # complete groups of the roles trained
    all_groups: list[list[Rollout]]    # every group completed, any role
    generated_tokens: int
    seconds: float
    deferred_seconds: float            # update due but held back by the staleness bound
    staleness: list[int]               # version - first_version per trained sample


class ContractScheduler:
    def __init__(self, rollouts: AgenticRollouts, engine, problems: Iterator[dict], *, mode: str,
                 prompts_per_step: int, samples_per_update: int, max_inflight_rows: int,
                 staleness_bound: int, resume: str, roles_trained: str,
                 drop_zero_variance: bool, sampling: dict, stop_ids: Sequence[int],
                 clock: Callable[[], float] = time.perf_counter):
        if mode not in ("pipeline", "sequential") or resume not in ("keep", "recompute"):
            raise ValueError(f"mode / resume: got {mode!r}, {resume!r}")
        self.rollouts, self.engine, self.problems, self.mode = rollouts, engine, problems, mode
        self.prompts_per_step, self.samples_per_update = prompts_per_step, samples_per_update
        self.max_inflight_rows, self.staleness_bound = max_inflight_rows, staleness_bound
        self.resume, self.roles = resume, ROLES_TRAINED[roles_trained]
        self.drop_zero_variance, self.sampling = drop_zero_variance, dict(sampling)
        self.stop_ids, self.clock = tuple(stop_ids), clock
        self.problems_admitted = 0
        self._inflight: dict[int, Rollout] = {}      # engine request id -> rollout
        self._seeds: dict[str, int] = {}             # rollout uid -> sequence seed
        self._next_seed = 0
        self._ready: list[list[Rollout]] = []
        self._ready_count = 0                        # trained samples in `_ready`

    # --- the contract ---

    def collect(self, version: int) -> StreamBatch:
        start, tokens = self.clock(), self.engine.stats["tokens"]
        deferred_since = None
        while True:
            if self._ready_samples() >= self.samples_per_update:
                if self._fresh_enough(version):
                    break
                deferred_since = self.clock() if deferred_since is None else deferred_since
            if self.mode == "pipeline":
                if not self._decode_pipeline(version, until=lambda: self._due(version)):
                    raise RuntimeError("nothing to decode and no update due")
            else:
                self._decode_sequential_batch(version)
        groups, self._ready, self._ready_count = self._ready, [], 0
        trained = [g for g in groups if g[0].role in self.roles]
        return StreamBatch(
            groups=trained, all_groups=groups,
            generated_tokens=self.engine.stats["tokens"] - tokens, seconds=self.clock() - start,
            deferred_seconds=0.0 if deferred_since is None else self.clock() - deferred_since,
            staleness=[version - r.first_version for g in trained if self.size(g) for r in g])

    def decode_while(self, busy: Callable[[], bool], version: int) -> None:
        if self.mode != "pipeline":
            raise ValueError("decode_while: pipeline mode only")
        while busy():
            if not self._decode_pipeline(version, until=lambda: not busy()):
                return

    def weights_updated(self, model, version: int) -> None:
        del version
        self.engine.update_weights(model)
        if self.resume == "recompute":
            self.engine.recompute(self.engine.in_slots())

    def size(self, group: list[Rollout]) -> int:
        """Trained samples of a complete group."""
        if group[0].role not in self.roles:
            return 0
        if self.drop_zero_variance and len({r.reward for r in group}) == 1:
            return 0
        return len(group)

    # --- decoding ---

    def _decode_pipeline(self, version: int, *, until: Callable[[], bool]) -> bool:
        self._admit()
        self._submit(version)
        if not self._inflight:
            return False
        for request_id, output in self.engine.stream():
            self._absorb(request_id, output, version)
            if until():
                break
            self._admit()
            self._submit(version)
        for request_id, output in self.engine.finished():
            self._absorb(request_id, output, version)
        return True

    def _decode_sequential_batch(self, version: int) -> None:
        for _ in range(self.prompts_per_step):
            self._take_problem()
        while self.rollouts.pending:
            self._submit(version)
            for request_id, output in self.engine.stream():
                self._absorb(request_id, output, version)

    def _take_problem(self) -> None:
        self.rollouts.add_problems([next(self.problems)], [f"p{self.problems_admitted}"])
        self.problems_admitted += 1

    def _admit(self) -> None:
        while (len(self._inflight) + len(self.rollouts.pending) < self.max_inflight_rows
               and self._ready_samples() < self.samples_per_update):
            self._take_problem()

    def _submit(self, version: int) -> None:
        pending, self.rollouts.pending = self.rollouts.pending, []
        budgets = self.rollouts.config.max_new_tokens
        groups: dict = collections.OrderedDict()
        for r in pending:  # a group's fresh members share a prompt: one submit(n=G)
            if r.uid not in self._seeds:
                self._seeds[r.uid] = self._next_seed
                self._next_seed += 1
            groups.setdefault(r.uid if r.response_ids else r.group_key, []).append(r)
        for members in groups.values():
            first = members[0]
            generated = (first.response_ids, first.logprobs) if first.response_ids else None
            ids = self.engine.submit(first.prompt_ids, max_new_tokens=budgets[first.role],
                                     seed=self._seeds[first.uid], stop_ids=self.stop_ids,
                                     n=len(members), generated=generated, **self.sampling)
            for request_id, r in zip(ids, members):
                if r.first_version is None:
                    r.first_version = version
                self._inflight[request_id] = r

    def _absorb(self, request_id: int, output, version: int) -> None:
        rollout = self._inflight.pop(request_id)
        done = len(rollout.response_ids)
        reason = "stop" if output.finish_reason == "stop" else "length"
        new = GenerationOutput(tuple(output.tokens[done:]), tuple(output.logprobs[done:]), reason)
        groups = self.rollouts.absorb([rollout], [new], version)
        self._ready += groups
        self._ready_count += sum(self.size(g) for g in groups)
        self._seeds.pop(rollout.uid, None)

    # --- when an update is due ---

    def _ready_samples(self) -> int:
        return self._ready_count

    def _fresh_enough(self, version: int) -> bool:
        oldest = version + 1 - self.staleness_bound
        return all(r.first_version >= oldest for r in self._untrained())

    def _due(self, version: int) -> bool:
        return self._ready_samples() >= self.samples_per_update and self._fresh_enough(version)

    def _untrained(self) -> Iterator[Rollout]:
        yield from self._inflight.values()
        size = self.rollouts.config.group_size
        for tree in self.rollouts.trees.values():
            for members in tree.finished.values():
                counts = collections.Counter(r.group_key for r in members)
                yield from (r for r in members if counts[r.group_key] < size)
