"""The rollout scheduler: agent-granularity streaming on one decode engine for the whole job.

The engine (any `sampling.DecodeEngine`) never drains between updates. Each output is graded as
it finishes (`AgenticRollouts.absorb`); trained samples are counted by `samples.SampleRules`, as
the update's batch counts them.

pipeline    Problems are admitted while fewer than `max_inflight_rows` rollouts are in flight
            (submitted or pending) and this host has admitted less than its share of
            `max_problems_per_update` since the last update; a completed stage's children go
            to the running engine at once. `collect` returns once the complete groups hold
            `samples_per_update` trained samples, or every host has admitted its share (so a
            policy whose groups never vary still steps), and hands out groups in completion
            order up to that many (`_hand_out`); the rest wait, and decoding goes on.
sequential  Synchronous barriers on the same engine: `prompts_per_step` problems at a time, a
            stage's requests entering once every request of the stage before has finished;
            `collect` returns when its batches are complete (more batches while the trained
            samples are too few). A batch stopped mid-way is finished before the next starts.

Staleness: a rollout's `first_version` is the policy version it was submitted under. An update to
v + 1 waits (decoding, admitting nothing) while a rollout still to be trained has
`first_version` < v + 1 - `staleness_bound`.

Resume (`weights_updated`): with 'recompute' requests in slots are re-prefilled under the new
weights (so a restored run decodes the same tokens as an uninterrupted one); with 'keep' they go
on from the KV the old weights wrote.

Order: every choice (admission, spawn order, sequence seeds, selection) follows the order of the
outputs, which the engine streams in submission order per chunk, whatever slots they used.

Several hosts (`hosts`): host h of P takes problems h, h + P, h + 2P, ... and grades, selects and
admits on its own. Pipeline mode decodes in rounds of `chunks_per_round` chunks, after which the
hosts exchange their ready groups' trained-sample counts and oldest untrained version and all take
the same decision (the update due; groups handed out host by host in turn). Sequential batches and
barriers span all hosts. Nothing a host decides alone steers another, so hosts never disagree.

Preemption (`should_stop`): every round's exchange carries each host's `should_stop()`; when any
says so, every host raises `Stopped` there, between two engine chunks. `state_dict` holds the
requests in flight as partial outputs; between `collect` and the update,
`state_dict(put_back=True)` puts the handed-out groups back, so a stopped step is redone.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import time
from collections.abc import Callable, Iterator, Mapping, Sequence

from mars_jax.distributed import HostGroup
from mars_jax.preemption import Stopped
from mars_jax.rl.rollout import STAGE_ROLES, AgenticRollouts, Rollout, RolloutConfig
from mars_jax.rl.samples import SampleRules
from mars_jax.sampling import DecodeEngine, EngineOutput
from mars_jax.types import ROLES

MODES = ("pipeline", "sequential")
RESUME_MODES = ("recompute", "keep")
# rollout.roles_trained -> the roles whose groups are trained.
ROLES_TRAINED = {"all": ROLES, "solver": ("solver",),
                 "vc": ("verifier", "corrector")}


def auto_problems_per_update(prompts_per_step: int) -> int:
    """The default cap on problems admitted per update (`rollout.max_problems_per_update` 0)."""
    return 4 * prompts_per_step


def auto_inflight_rows(config: RolloutConfig, prompts_per_step: int) -> int:
    """The default cap on rollouts in flight (`rollout.max_inflight_rows` 0): the rows of
    `prompts_per_step` problems' full trees."""
    stages = min(config.max_stages, len(STAGE_ROLES))
    return prompts_per_step * config.group_size * (1 + config.fan_out * (stages - 1))


@dataclasses.dataclass(frozen=True)
class StreamBatch:
    """What one `collect` produced."""

    groups: list[list[Rollout]]          # complete groups of the roles trained
    all_groups: list[list[Rollout]]      # every group completed (any role)
    generated_tokens: int
    seconds: float                       # wall time of the collect (clock of the scheduler)
    deferred_seconds: float              # of which the update was due but held by staleness
    problems_admitted: int
    inflight: int                        # rollouts in flight when it returned (restored ones
                                         # not yet resubmitted included)
    staleness: list[int]                 # version - first_version per trained sample
    occupancy: float                     # generated tokens / (decode steps x slots)
    sync_seconds: float = 0.0            # of `seconds`, waiting for the other hosts


@dataclasses.dataclass(frozen=True)
class _Agreed:
    """What every host knows after a round: per host, its ready groups' (trained samples, lags
    beyond the bound at the next update) in completion order; the oldest untrained first version;
    whether any host has work or is asked to stop; whether every host has admitted its share."""

    ready: list[list[tuple[int, bool]]]
    oldest: int | None
    busy: bool
    stop: bool
    capped: bool = False

    @property
    def samples(self) -> int:
        return sum(size for host in self.ready for size, _ in host)


@dataclasses.dataclass(frozen=True)
class StreamSettings:
    """`StreamingRollouts`' settings (config.rollout): `max_problems_per_update` counts over all
    hosts, `max_inflight_rows` per host; `sampling` holds the engine's per-request keywords."""

    mode: str
    prompts_per_step: int
    samples_per_update: int
    max_problems_per_update: int
    max_inflight_rows: int
    staleness_bound: int
    resume: str
    roles_trained: str
    drop_zero_variance: bool
    mask_truncated: bool
    sampling: Mapping[str, float]
    chunks_per_round: int

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"rollout.mode: {self.mode!r} is not one of {MODES}")
        if self.resume not in RESUME_MODES:
            raise ValueError(f"rollout.resume: {self.resume!r} is not one of {RESUME_MODES}")
        if self.roles_trained not in ROLES_TRAINED:
            raise ValueError(f"rollout.roles_trained: {self.roles_trained!r} is not one of "
                             f"{sorted(ROLES_TRAINED)}")
        if self.chunks_per_round < 1:
            raise ValueError(f"chunks_per_round: must be >= 1, got {self.chunks_per_round}")
        if min(self.samples_per_update, self.prompts_per_step, self.max_inflight_rows,
               self.max_problems_per_update) < 1:
            raise ValueError("samples_per_update, prompts_per_step, max_inflight_rows and "
                             "max_problems_per_update must be >= 1; got "
                             f"{self.samples_per_update}, {self.prompts_per_step}, "
                             f"{self.max_inflight_rows}, {self.max_problems_per_update}")


class StreamingRollouts:
    """Feeds `rollouts`' requests to `engine` and hands out complete groups per update."""

    def __init__(self, rollouts: AgenticRollouts, engine: DecodeEngine, problems: Iterator[dict],
                 settings: StreamSettings, *, stop_ids: Sequence[int],
                 clock: Callable[[], float] = time.perf_counter,
                 hosts: HostGroup | None = None,
                 should_stop: Callable[[], bool] = lambda: False):
        self.rollouts, self.engine, self.problems = rollouts, engine, problems
        self.mode, self.prompts_per_step = settings.mode, settings.prompts_per_step
        self.samples_per_update = settings.samples_per_update
        self.max_inflight_rows = settings.max_inflight_rows
        self.staleness_bound, self.resume = settings.staleness_bound, settings.resume
        self.rules = SampleRules(ROLES_TRAINED[settings.roles_trained],
                                 settings.drop_zero_variance, settings.mask_truncated)
        self.sampling, self.stop_ids, self.clock = dict(settings.sampling), tuple(stop_ids), clock
        self.hosts = hosts or HostGroup("stream")
        self.should_stop = should_stop
        self.chunks_per_round = settings.chunks_per_round
        # this host's share of the problems admitted per update
        self.problem_share = -(-settings.max_problems_per_update // self.hosts.count)
        self.problems_admitted = 0                   # problems this host took so far
        self._admitted_before = 0                    # ... at the last collect's start or end
        self.batches = 0                             # sequential batches started (all hosts)
        self._inflight: dict[int, Rollout] = {}      # engine request id -> rollout
        self._ready: list[list[Rollout]] = []        # complete groups not yet handed out
        self._others_ready = 0                       # other hosts' ready samples, last agreed
        self._others_oldest: int | None = None       # and their oldest untrained version
        # `_ready` before the last hand-out (until the update), and how many of its groups were
        # kept (now the head of `_ready`)
        self._before_hand_out: list[list[Rollout]] | None = None
        self._kept = 0

    # --- one update's worth ----------------------------------------------------------------

    def collect(self, version: int) -> StreamBatch:
        """Decodes until an update is due (module docstring) and returns what completed."""
        start, tokens = self.clock(), self.engine.stats["tokens"]
        slot_steps, synced = self.engine.stats["slot_steps"], self.hosts.seconds
        admitted, deferred_since, deferred = self.problems_admitted, None, 0.0
        self._admitted_before = admitted
        self._before_hand_out = None
        while True:
            agreed = self._agree(version)
            if agreed.stop:
                raise Stopped("stream: stopped between two decode rounds")
            batch_open = self.mode == "sequential" and agreed.busy  # one restored mid-way
            capped = self.mode == "pipeline" and agreed.capped
            if (agreed.samples >= self.samples_per_update or capped) and not batch_open:
                if self._fresh_enough(agreed, version):
                    break
                deferred_since = self.clock() if deferred_since is None else deferred_since
            if self.mode == "pipeline":
                if not agreed.busy:
                    raise RuntimeError("stream: nothing to decode and no update due "
                                       f"({agreed.samples} trained samples ready)")
                self._round(version, until=lambda: self._due_here(version))
            else:
                self._decode_sequential_batch(version)
        if deferred_since is not None:
            deferred = self.clock() - deferred_since
        self._before_hand_out = self._ready
        groups, self._ready = self._hand_out(agreed, version)
        self._admitted_before = self.problems_admitted  # a share for `decode_while` too
        self._kept = len(self._ready)
        trained = [g for g in groups if g[0].role in self.rules.roles]
        generated = self.engine.stats["tokens"] - tokens
        return StreamBatch(
            groups=trained, all_groups=groups, generated_tokens=generated,
            occupancy=generated / max(1, self.engine.stats["slot_steps"] - slot_steps),
            seconds=self.clock() - start, deferred_seconds=deferred,
            problems_admitted=self.problems_admitted - admitted,
            inflight=len(self._inflight) + sum(r.first_version is not None
                                               for r in self.rollouts.pending),
            staleness=[version - g[i].first_version for g in trained
                       for i, _ in self.rules.trained(g)],
            sync_seconds=self.hosts.seconds - synced)

    def decode_while(self, busy: Callable[[], bool], version: int) -> None:
        """Pipeline mode: decodes and admits while `busy()` (the update to `version + 1` on other
        devices); the next `collect` hands out what completes. Work started here trains one
        version later at the earliest, so with `staleness_bound=0` nothing runs (a run then trains
        what one shared mesh trains). Hosts do not wait for each other here."""
        if self.mode != "pipeline":
            raise ValueError("decode_while: only pipeline mode overlaps rollout with an update")
        if self.staleness_bound < 1:
            return
        while busy() and not self.should_stop():
            if not self._round(version, until=lambda: not busy()):
                return

    def free_kv(self) -> None:
        """The engine's KV cache off its devices for an update on them, where that loses nothing:
        no request holds a slot, or `resume='recompute'` re-prefills them after the update."""
        if self.resume == "recompute" or not self.engine.in_slots():
            self.engine.free_kv()

    def weights_updated(self, model, version: int) -> None:
        """Decodes with `model` from now on; requests in slots go on per `resume`."""
        del version  # requests keep their first_version; the next submissions get the new one
        self._before_hand_out = None  # what was handed out is trained
        self.engine.update_weights(model)
        if self.resume == "recompute":
            self.engine.recompute(self.engine.in_slots())

    def weights_moved(self, model) -> None:
        """Decodes with `model`: the weights it decoded with, in other arrays (an update that
        changed nothing donated the old ones); requests in slots go on as they are."""
        self.engine.update_weights(model)

    # --- decoding --------------------------------------------------------------------------

    def _round(self, version: int, until: Callable[[], bool]) -> bool:
        """Admits, submits and decodes `chunks_per_round` engine chunks, admitting and submitting
        again after each output until `until()`; False when there was nothing to decode."""
        self._admit()
        self._submit(version)
        if not self._inflight:
            return False
        holding = False

        def after_output() -> None:
            nonlocal holding
            holding = holding or until()
            if not holding:
                self._admit()
                self._submit(version)

        self._chunk(version, after_output, self.chunks_per_round)
        return True

    def _chunk(self, version: int, after_output: Callable[[], None] = lambda: None,
               chunks: int = 1) -> None:
        """Decodes `chunks` engine chunks, absorbing each output, then `after_output()`."""
        asks = iter((False,) * chunks)  # `stream` asks before each chunk: `chunks`, then stop
        for request_id, output in self.engine.stream(stop=lambda: next(asks, True)):
            self._absorb(request_id, output, version)
            after_output()

    def _decode_sequential_batch(self, version: int) -> None:
        """One synchronous batch of `prompts_per_step` problems (over all hosts), stage by stage
        with every host's engine drained between stages, in rounds of one chunk. A batch restored
        mid-way is finished instead: its restored requests first (on every host), then the rest."""
        started = False
        while True:
            restored = any(r.first_version is not None for r in self.rollouts.pending)
            everyone = self.hosts.gather([bool(self._inflight), bool(self.rollouts.pending),
                                          restored, self.should_stop()])
            inflight, pending, restored, stop = (any(column) for column in zip(*everyone))
            if stop:
                raise Stopped("stream: stopped between two decode chunks")
            if inflight:
                if self._inflight:
                    self._chunk(version)
            elif pending:
                self._submit(version, restored_only=restored)
            elif started:
                return
            else:
                self._start_sequential_batch()
            started = True

    def _start_sequential_batch(self) -> None:
        end = (self.batches + 1) * self.prompts_per_step
        self.batches += 1
        while self._problem_number(self.problems_admitted) < end:
            self._take_problem()

    def _problem_number(self, taken: int) -> int:
        """The job-wide number of this host's `taken`-th problem (module docstring)."""
        return taken * self.hosts.count + self.hosts.index

    def _take_problem(self) -> None:
        uid = f"p{self._problem_number(self.problems_admitted)}"
        self.problems_admitted += 1
        self.rollouts.add_problems([next(self.problems)], [uid])

    def _can_admit(self) -> bool:
        """Pipeline: a new problem may start (rows in flight below this host's cap, no update due
        by the samples ready on every host as last agreed, this host's share not yet admitted)."""
        return (len(self._inflight) + len(self.rollouts.pending) < self.max_inflight_rows
                and self._ready_samples() + self._others_ready < self.samples_per_update
                and not self._share_admitted())

    def _share_admitted(self) -> bool:
        """This host has admitted its share of `max_problems_per_update` since the last
        `collect`'s start or end."""
        return self.problems_admitted - self._admitted_before >= self.problem_share

    def _admit(self) -> None:
        """Pipeline: new problems while `_can_admit`."""
        while self._can_admit():
            self._take_problem()

    def _submit(self, version: int, restored_only: bool = False) -> None:
        """Submits the pending rollouts (with `restored_only`, only the leading restored ones):
        consecutive members of a group as one request group, a partial output as a continuation."""
        pending, self.rollouts.pending = self.rollouts.pending, []
        if restored_only:
            cut = next((i for i, r in enumerate(pending) if r.first_version is None),
                       len(pending))
            pending, self.rollouts.pending = pending[:cut], pending[cut:]
        budgets = self.rollouts.config.max_new_tokens

        def key(item):
            index, r = item
            if r.response_ids:
                return ("continue", index)
            return (tuple(r.prompt_ids), r.role, r.seed - index)  # consecutive seeds together

        for _, run in itertools.groupby(enumerate(pending), key=key):
            members = [r for _, r in run]
            first = members[0]
            # A partial output needs a `ContinuingEngine` (`Engine`) to go on from its tokens.
            continued = (dict(generated=(first.response_ids, first.logprobs))
                         if first.response_ids else {})
            ids = self.engine.submit(first.prompt_ids, max_new_tokens=budgets[first.role],
                                     seed=first.seed, stop_ids=self.stop_ids, n=len(members),
                                     **continued, **self.sampling)
            for request_id, r in zip(ids, members):
                if r.first_version is None:
                    r.first_version = version
                self._inflight[request_id] = r

    def _absorb(self, request_id: int, output, version: int) -> None:
        rollout = self._inflight.pop(request_id)
        done = len(rollout.response_ids)
        reason = "stop" if output.finish_reason == "stop" else "length"
        new = EngineOutput(output.tokens[done:], output.logprobs[done:], reason, output.expert_ids)
        self._ready += self.rollouts.absorb([rollout], [new], version)

    # --- when an update is due -------------------------------------------------------------

    def _size(self, group: list[Rollout]) -> int:
        """Trained samples of a complete group (`samples.SampleRules`)."""
        return len(self.rules.trained(group))

    def _agree(self, version: int) -> _Agreed:
        """Exchanges every host's ready groups and oldest untrained version (a round)."""
        oldest = version + 1 - self.staleness_bound
        mine = [(self._size(g), min(r.first_version for r in g) < oldest) for g in self._ready]
        first = min((r.first_version for r in self._untrained()), default=None)
        busy = bool(self._inflight or self.rollouts.pending) or (
            self.mode == "pipeline" and self._can_admit())
        everyone = self.hosts.gather([mine, first, busy, self.should_stop(),
                                      self._share_admitted()])
        ready = [[tuple(group) for group in host[0]] for host in everyone]
        self._others_ready = sum(size for h, host in enumerate(ready) if h != self.hosts.index
                                 for size, _ in host)
        others = [host[1] for h, host in enumerate(everyone)
                  if h != self.hosts.index and host[1] is not None]
        self._others_oldest = min(others, default=None)
        return _Agreed(ready, min(others + ([] if first is None else [first]), default=None),
                       any(host[2] for host in everyone), any(host[3] for host in everyone),
                       all(host[4] for host in everyone))

    def _hand_out(self, agreed: _Agreed, version: int
                  ) -> tuple[list[list[Rollout]], list[list[Rollout]]]:
        """(groups for this update, groups kept). Sequential: all. Pipeline: the hosts' groups in
        turn (host 0's first, host 1's first, ..., host 0's second, ...) until `samples_per_update`
        trained samples, plus every group that would lag beyond the bound at the next update and
        every group with nothing to train."""
        if self.mode == "sequential":
            self._others_ready = 0
            return self._ready, []
        turns = [(h, i) for i in range(max(map(len, agreed.ready), default=0))
                 for h in range(len(agreed.ready)) if i < len(agreed.ready[h])]
        taken, count = set(), 0
        for h, i in turns:
            size, stale = agreed.ready[h][i]
            if not size or count < self.samples_per_update or stale:
                taken.add((h, i))
                count += size
        me = self.hosts.index
        self._others_ready = sum(agreed.ready[h][i][0] for h, i in turns
                                 if h != me and (h, i) not in taken)
        now = [g for i, g in enumerate(self._ready) if (me, i) in taken]
        later = [g for i, g in enumerate(self._ready) if (me, i) not in taken]
        return now, later

    def _ready_samples(self) -> int:
        return sum(self._size(g) for g in self._ready)

    def _due_here(self, version: int) -> bool:
        """Whether an update is due by this host's groups and the other hosts' as last agreed
        (the round's outputs then stop admitting and submitting)."""
        if self._ready_samples() + self._others_ready < self.samples_per_update:
            return False
        oldest = version + 1 - self.staleness_bound
        return ((self._others_oldest is None or self._others_oldest >= oldest)
                and all(r.first_version >= oldest for r in self._untrained()))

    def _fresh_enough(self, agreed: _Agreed, version: int) -> bool:
        """An update to `version + 1` keeps every untrained rollout of every host within bound."""
        return agreed.oldest is None or agreed.oldest >= version + 1 - self.staleness_bound

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

    def _ready_groups(self, put_back: bool) -> list[list[Rollout]]:
        """Complete groups not yet handed out; with `put_back`, also those the last `collect`
        handed out, in the order they completed (module docstring)."""
        if not put_back:
            return self._ready
        if self._before_hand_out is None:
            raise ValueError("put_back: no hand-out since the last update")
        return self._before_hand_out + self._ready[self._kept:]

    def state_dict(self, put_back: bool = False) -> dict:
        """JSON-serialisable state: the rollouts (in-flight ones as partial outputs, in submission
        order, ahead of the pending ones), `_ready_groups(put_back)` and counters (routing apart:
        `routing`)."""
        inflight = []
        for request_id in sorted(self._inflight):
            rollout = dataclasses.replace(self._inflight[request_id])
            tokens, logprobs = self.engine.partial(request_id)
            rollout.response_ids, rollout.logprobs = tokens, logprobs
            inflight.append(rollout.to_json())
        state = self.rollouts.state_dict()
        state["pending"] = inflight + state["pending"]
        return dict(rollouts=state, problems_admitted=self.problems_admitted,
                    batches=self.batches,
                    ready=[[r.to_json() for r in g] for g in self._ready_groups(put_back)])

    def routing(self, put_back: bool = False) -> dict:
        """Recorded expert ids, by uid, of every rollout still to be trained that has them
        (`put_back`: as `state_dict`)."""
        ready = {r.uid: r.expert_ids for g in self._ready_groups(put_back) for r in g
                 if r.expert_ids is not None}
        return {**self.rollouts.routing(), **ready}

    def load_state_dict(self, state: dict, routing=None) -> None:
        """Restores `state_dict()` output into a fresh engine's scheduler; partial outputs are
        resubmitted as continuations at the next `collect`."""
        if self._inflight:
            raise ValueError("load_state_dict: the engine already has requests in flight")
        routing = routing or {}
        self.rollouts.load_state_dict(state["rollouts"], routing)
        self.problems_admitted = state["problems_admitted"]
        self.batches = state.get("batches", self.problems_admitted // self.prompts_per_step)
        self._ready = [[dataclasses.replace(Rollout(**r), expert_ids=routing.get(r["uid"]))
                        for r in g] for g in state.get("ready", [])]
