"""A stand-in for `mars_jax.rl.streaming.StreamingRollouts` (not on main yet), written to the
same contract (/work/briefs/streaming_api.md) so `benchmarks/pipeline_sim.py` can switch to the
real one by import: `collect(version)`, `decode_while(busy, version)`,
`weights_updated(model, version)` over a `DecodeEngine`.

pipeline    The engine never drains: a finished output is absorbed (graded, its group's next
            stage spawned) at once and the new requests enter the running engine; a paused
            segment resumes at once (`resume` mode when the weights changed since it started,
            else `keep`); new problems are admitted while the rows in flight are below
            `max_inflight_rows`, at most `prompts_per_step` per policy version. `collect`
            returns once `samples_per_update` samples of trainable groups are complete.
sequential  `prompts_per_step` new problems per call; a stage's requests enter only once the
            engine has drained the previous stage of every problem; returns every trainable
            group of the step.
Sequence seeds are assigned at spawn (a counter), so lengths do not depend on admission time.
"""
from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence

from mars_jax.rl.pipeline import trainable
from mars_jax.rl.rollout import AgenticRollouts, GenerationOutput, Rollout


@dataclasses.dataclass
class StreamBatch:
    groups: list[list[Rollout]]        # complete trainable groups
    all_groups: list[list[Rollout]]    # every group completed, any role
    generated_tokens: int
    decode_seconds: float


class ContractScheduler:
    def __init__(self, rollouts: AgenticRollouts, engine, problems: Iterator[dict], *, mode: str,
                 prompts_per_step: int, samples_per_update: int, max_inflight_rows: int,
                 staleness_bound: int, resume: str, roles_trained: str, sampling: dict,
                 stop_ids: Sequence[int], seed: int,
                 clock: Callable[[], float] = time.perf_counter):
        if mode not in ("pipeline", "sequential"):
            raise ValueError(f"mode: {mode!r}")
        self.rollouts, self.engine, self.problems, self.mode = rollouts, engine, problems, mode
        self.prompts_per_step, self.samples_per_update = prompts_per_step, samples_per_update
        self.max_inflight_rows, self.staleness_bound = max_inflight_rows, staleness_bound
        self.resume_mode, self.roles_trained, self.sampling = resume, roles_trained, dict(sampling)
        self.stop_ids, self.seed, self.clock = tuple(stop_ids), seed, clock
        self._inflight: dict[int, Rollout] = {}      # engine request id -> rollout
        self._weights_at: dict[int, int] = {}        # request id -> version its segment began on
        self._seeds: dict[str, int] = {}             # rollout uid -> sequence seed
        self._next_seed = 0
        self._stream: Iterator | None = None
        self._ready: list[list[Rollout]] = []
        self._all: list[list[Rollout]] = []
        self._tokens = 0
        self._version = 0
        self._problems_added = 0

    # --- the contract ---

    def collect(self, version: int) -> StreamBatch:
        self._version = version
        decode_before = self.engine.stats["decode_seconds"]
        if self.mode == "sequential":
            self._add_problems(self.prompts_per_step)
            while self.rollouts.pending:
                self._submit_pending()
                for request_id, output in self.engine.stream():
                    self._handle(request_id, output)
        else:
            while self._ready_samples() < self.samples_per_update:
                if not self._step_pipeline():
                    break
        groups, self._ready = self._ready, []
        all_groups, self._all = self._all, []
        tokens, self._tokens = self._tokens, 0
        return StreamBatch(groups, all_groups, tokens,
                           self.engine.stats["decode_seconds"] - decode_before)

    def decode_while(self, busy: Callable[[], bool], version: int) -> None:
        self._version = version
        while busy():
            if not self._step_pipeline():
                return

    def weights_updated(self, model, version: int) -> None:
        self.engine.update_weights(model)
        self._version = version

    # --- internals ---

    def _ready_samples(self) -> int:
        return sum(len(g) for g in self._ready)

    def _rows_in_flight(self) -> int:
        return len(self._inflight) + len(self.rollouts.pending)

    def _add_problems(self, count: int) -> None:
        for _ in range(count):
            self.rollouts.add_problems([next(self.problems)], [f"p{self._problems_added}"])
            self._problems_added += 1

    def _admit_pipeline(self) -> None:
        allowed = self.prompts_per_step * (self._version + 1 + self.staleness_bound)
        while (self._problems_added < allowed
               and self._rows_in_flight() < self.max_inflight_rows):
            self._add_problems(1)

    def _step_pipeline(self) -> bool:
        """Admits, submits, and handles one engine output; False when nothing is left to do."""
        self._admit_pipeline()
        self._submit_pending()
        if self._stream is None:
            self._stream = self.engine.stream()
        try:
            request_id, output = next(self._stream)
        except StopIteration:
            self._stream = None
            return bool(self._inflight or self.rollouts.pending)
        self._handle(request_id, output)
        return True

    def _submit_pending(self) -> None:
        batch, self.rollouts.pending = self.rollouts.pending, []
        config = self.rollouts.config
        segment = config.segment_tokens if self.mode == "pipeline" else None
        groups: dict[tuple, list[Rollout]] = collections.OrderedDict()
        for r in batch:  # members of a group share a prompt: one submit(n=G)
            if r.uid not in self._seeds:
                self._seeds[r.uid] = self._next_seed
                self._next_seed += 1
            groups.setdefault(r.uid if r.response_ids else r.group_key, []).append(r)
        for members in groups.values():
            seeds = [self._seeds[r.uid] for r in members]
            if seeds != list(range(seeds[0], seeds[0] + len(seeds))):  # not consecutive
                parts = [[r] for r in members]
            else:
                parts = [members]
            for part in parts:
                head = part[0]
                budget = config.max_new_tokens[head.role] - len(head.response_ids)
                generated = ((head.response_ids, head.logprobs) if head.response_ids else None)
                ids = self.engine.submit(
                    head.prompt_ids, max_new_tokens=budget, seed=self._seeds[head.uid],
                    stop_ids=self.stop_ids, n=len(part), segment_tokens=segment,
                    generated=generated, **self.sampling)
                for request_id, r in zip(ids, part):
                    if r.first_version is None:
                        r.first_version = self._version
                    self._inflight[request_id] = r
                    self._weights_at[request_id] = self._version

    def _handle(self, request_id: int, output) -> None:
        r = self._inflight[request_id]
        if output.finish_reason == "segment":
            changed = self._weights_at[request_id] != self._version
            self._weights_at[request_id] = self._version
            self.engine.resume(request_id, mode=self.resume_mode if changed else "keep",
                               segment_tokens=self.rollouts.config.segment_tokens)
            return
        del self._inflight[request_id], self._weights_at[request_id]
        new = output.tokens[len(r.response_ids):]
        self._tokens += len(new)
        done = GenerationOutput(tuple(new), tuple(output.logprobs[len(r.logprobs):]),
                                "stop" if output.finish_reason == "stop" else "length")
        groups = self.rollouts.absorb([r], [done], self._version)
        self._all += groups
        self._ready += trainable(groups, self.roles_trained)
        self._seeds.pop(r.uid, None)
