"""A simulated decode engine: the `DecodeEngine` protocol of `mars_jax.rl.streaming` (as
`mars_jax.sampling.Engine` has it: submit / stream / finished / in_slots / partial / recompute /
update_weights / stats) over a simulated clock.

Each request's output length is drawn once from a `LengthModel` by (role, sequence seed), so it
does not depend on when the request runs. The loop is event-driven: it admits queued requests into
free slots (a group's prompt is prefilled once, as `Engine` does; a request submitted with
`generated` tokens is prefilled with them), then jumps straight to the next event, the earliest
finish among the running requests, charging the decode steps in between at the cost model's step
time for that many live rows and their contexts (`MeshCost.decode_seconds`), or for the slot bucket
and KV span `Engine` would decode (`ProfileCost` with `engine_buckets`; the span taken at the
interval's middle). Prefills stall decoding (charged in sequence). A freed slot is refilled at the
next event (the real engine's `admit_batch=1`). With `chunk_steps` = C (reserved slots only) the
engine decodes in chunks of C steps, as `Engine` does: the next event is the end of the chunk in
which the first running request ends, every request ending inside that chunk is yielded then and
its slot idles until then (each stretch of the chunk charged at the rows still live in it; slot
bucket and span taken at the chunk's start), or with `one_chunk` the end of the next chunk (one
chunk per `stream` step, as `Engine`); without it, events fall on the step a request ends.

KV memory: by default a slot holds its KV whatever its request's length (as `Engine` reserves it),
so `num_slots` alone bounds the rows. With `kv_tokens` the cache is paged, as vLLM's: the requests
in slots together hold at most `kv_tokens` positions, each as many as its context; requests are
admitted first come, first served while their context fits, and when the running rows' next tokens
would not fit, the running request admitted last is preempted (its KV freed; back at the head of
the queue, re-prefilled with its generated tokens when admitted again). `num_slots` is then the
most rows decoded at once. `kv_reserve` in [0, 1] makes admission conservative, as SGLang's
new-token ratio: a request is admitted only if the running requests' contexts plus `kv_reserve` of
every admitted request's remaining budget (to `max_new`, not its drawn length) fit; 0 is vLLM's
greedy admission, 1 never preempts.

Tokens: an output of length L is `L - A - 2` thought tokens, `</think>`, A answer tokens and the
first stop id (A = `answer_tokens[role]`, at most half the output); cut at the budget when L
exceeds it (finish 'length'). Log-probabilities are -1.0.
"""
from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence

from benchmarks.sim.lengths import LengthModel
from mars_jax.sampling.engine import EngineOutput, span_bucket
from mars_jax.sampling.scheduler import SlotScheduler, slot_bucket

THOUGHT, THINK_CLOSE, ANSWER, EOS = 4, 3, 8, 1  # ids of `benchmarks.sim.agents.SimTokenizer`


@dataclasses.dataclass
class _Group:
    prompt_len: int
    prefilled: bool | None = None  # `SlotScheduler` drops it to None


@dataclasses.dataclass
class _Request:
    id: int
    group: _Group
    role: str
    target: int            # output length drawn (stop token included)
    max_new: int
    stop_id: int
    answer: int
    generated: int = 0
    restored: tuple[list[int], list[float]] | None = None
    needs_prefill: bool = False   # prompt + generated tokens (restored, or preempted)
    slot: int | None = None
    order: int = 0                # admission order (the preemption victim is the latest)

    @property
    def end(self) -> int:
        """Tokens at which the request stops or finishes by length."""
        return min(self.target, self.max_new)

    @property
    def context(self) -> int:
        return self.group.prompt_len + self.generated


class SimEngine(SlotScheduler):
    """Simulated continuous batching over `num_slots` slots (`Engine`'s queue, slots and
    admission: `SlotScheduler`, `admit_batch=1`); `now` is the simulated clock (seconds) and
    `clock()` reads it. `role_of(prompt_ids)` names the role a prompt is for."""

    def __init__(self, cost, lengths: LengthModel, *, num_slots: int, max_length: int,
                 role_of: Callable[[Sequence[int]], str], answer_tokens: Mapping[str, int],
                 kv_tokens: int | None = None, kv_reserve: float = 0.0,
                 chunk_steps: int | None = None, one_chunk: bool = False):
        if num_slots < 1:
            raise ValueError(f"num_slots: need >= 1, got {num_slots}")
        if chunk_steps is not None and (chunk_steps < 1 or kv_tokens is not None):
            raise ValueError(f"chunk_steps: need >= 1 and reserved slots (no kv_tokens), got "
                             f"{chunk_steps}")
        self.chunk_steps, self.one_chunk = chunk_steps, one_chunk
        if kv_tokens is not None and kv_tokens < max_length:
            raise ValueError(f"kv_tokens: need >= max_length ({max_length}) so that one request "
                             f"always fits, got {kv_tokens}")
        if not 0.0 <= kv_reserve <= 1.0:
            raise ValueError(f"kv_reserve: need a fraction in [0, 1], got {kv_reserve}")
        super().__init__(num_slots)
        self.kv_tokens, self.kv_reserve = kv_tokens, kv_reserve
        self.cost, self.lengths, self.max_length = cost, lengths, max_length
        self.role_of, self.answer_tokens = role_of, dict(answer_tokens)
        self.now = 0.0
        self.version = 0
        self.stats = collections.Counter()

    def clock(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        """Moves the clock on with nothing decoding (e.g. an update on the same chips)."""
        self.now += seconds
        self.stats["idle_seconds"] += seconds

    def update_weights(self, model) -> None:
        """Counts a new policy version (the simulated engine has no weights); a group prompt
        prefilled under the old weights is prefilled again for members still queued."""
        del model
        self.version += 1
        self._drop_prefills()

    # --- requests ---

    def submit(self, prompt_ids: Sequence[int], *, max_new_tokens: int, temperature: float = 1.0,
               top_p: float = 1.0, top_k: int = 0, seed: int = 0, stop_ids: Sequence[int] = (),
               n: int = 1, generated: tuple[Sequence[int], Sequence[float]] | None = None
               ) -> list[int]:
        """Queues `n` requests on one prompt (sequence seeds `seed`, `seed + 1`, ...); with
        `generated` = (tokens, logprobs) one request continues a partial output (they count
        against `max_new_tokens`, as in `Engine`)."""
        del temperature, top_p, top_k
        prompt_len = len(prompt_ids)
        done = len(generated[0]) if generated else 0
        if prompt_len < 1 or prompt_len + max_new_tokens > self.max_length:
            raise ValueError(f"submit: prompt ({prompt_len}) + max_new_tokens "
                             f"({max_new_tokens}) must fit max_length ({self.max_length})")
        if generated and (n != 1 or done >= max_new_tokens):
            raise ValueError(f"generated: continues one request with fewer tokens than "
                             f"max_new_tokens; got n={n}, {done} tokens")
        role = self.role_of(prompt_ids)
        group = _Group(prompt_len)
        ids = []
        for i in range(n):
            request = _Request(self._new_id(), group, role,
                               target=self.lengths.draw(role, int(seed) + i),
                               max_new=int(max_new_tokens),
                               stop_id=int(stop_ids[0]) if stop_ids else EOS,
                               answer=self.answer_tokens.get(role, 0), generated=done)
            if generated:
                request.restored = (list(generated[0]), list(generated[1]))
                request.needs_prefill = True
            ids.append(request.id)
            self._enqueue(request)
        return ids

    def recompute(self, request_ids: Sequence[int]) -> None:
        """Re-prefills the contexts of requests in slots under the current weights."""
        for request_id in request_ids:
            self._prefill(self._requests[request_id].context)

    def partial(self, request_id: int) -> tuple[list[int], list[float]]:
        """Tokens and log-probabilities a request has so far."""
        return self._output(self._requests[request_id])

    # --- the loop (`SlotScheduler.stream`) ---

    def _step(self) -> bool:
        self._admit()
        if not self._running:
            return False
        self._decode_to_next_event()
        return True

    def _prefill(self, tokens: int) -> None:
        seconds = self.cost.prefill_seconds(tokens)
        self.now += seconds
        self.stats["prefill_seconds"] += seconds
        self.stats["prefill_tokens"] += tokens
        self.stats["prefill_calls"] += 1

    def kv_in_use(self) -> int:
        """Positions the requests in slots hold (their contexts)."""
        return sum(self._requests[i].context for i in self._slots if i is not None)

    def _kv_claim(self, request: _Request) -> int:
        """Positions admission counts for a request: its context and `kv_reserve` of what its
        budget still allows, at least room for its next token."""
        remaining = request.max_new - request.generated
        return request.context + max(1, math.ceil(self.kv_reserve * remaining))

    def _admit(self) -> None:
        """Admits queued requests into the first free slots while their KV claims fit (paged),
        charging their prefills in admission order."""
        claimed = sum(self._kv_claim(self._requests[i]) for i in self._slots
                      if i is not None) if self.kv_tokens is not None else 0

        def place(request: _Request) -> int | None:
            nonlocal claimed
            if self.kv_tokens is not None:
                claim = self._kv_claim(request)
                if claimed + claim > self.kv_tokens:
                    return None
                claimed += claim
            return self._slots.index(None)

        for request in self._admit_queued(place):
            if request.needs_prefill:
                self._prefill(request.context)
                request.needs_prefill = False
            elif not request.group.prefilled:
                self._prefill(request.group.prompt_len)
                request.group.prefilled = True
            self.stats["prefills"] += 1
            self._running.add(request.id)

    def _preempt(self, request: _Request) -> None:
        """Frees a running request's KV and slot; it waits at the head of the queue."""
        self._requeue(request)
        request.needs_prefill = True
        self.stats["preemptions"] += 1

    def _decode_to_next_event(self) -> None:
        running = [self._requests[i] for i in self._running]
        if self.chunk_steps:
            self._decode_chunks(running)
            return
        steps = max(0, min(r.end - r.generated for r in running))
        if self.kv_tokens is not None:
            free = self.kv_tokens - self.kv_in_use()
            running.sort(key=lambda r: r.order)
            while free < len(running):
                victim = running.pop()
                free += victim.context
                self._preempt(victim)
            if not running:
                return
            steps = min(max(0, min(r.end - r.generated for r in running)),
                        free // len(running))
        rows, context = len(running), sum(r.context for r in running)
        seconds = self.cost.decode_seconds(rows, context, steps, bucket=self._bucket(running),
                                           span=span_bucket(max(r.context for r in running)
                                                            + (steps + 1) // 2, self.max_length))
        self.now += seconds
        self.stats["decode_seconds"] += seconds
        self.stats["decode_steps"] += steps
        self.stats["slot_steps"] += steps * self.num_slots
        self.stats["row_steps"] += steps * rows
        self.stats["tokens"] += steps * rows
        self.stats["live_slot_seconds"] += seconds * rows
        self._advance_requests(running, steps)

    def _decode_chunks(self, running: list[_Request]) -> None:
        """Whole chunks up to the end of the one in which the first running request ends
        (module docstring). Slot bucket and span are computed only for a cost model that reads
        them (`engine_buckets`)."""
        lefts = [r.end - r.generated for r in running]
        steps = -(-max(0, min(lefts)) // self.chunk_steps) * self.chunk_steps
        if self.one_chunk:  # one chunk per `stream` step
            steps = min(steps, self.chunk_steps)
        ending = sorted((left, i) for i, left in enumerate(lefts) if left < steps)
        rows = len(running)
        context = sum(r.group.prompt_len + r.generated for r in running)
        bucket = span = None
        if getattr(self.cost, "engine_buckets", False):
            bucket = self._bucket(running)
            span = span_bucket(max(r.context for r in running) + (steps + 1) // 2,
                               self.max_length)
        done = 0
        for at, index in ending + [(steps, None)]:
            if at > done:
                seconds = self.cost.decode_seconds(rows, context, at - done, bucket=bucket,
                                                   span=span)
                self.now += seconds
                self.stats["decode_seconds"] += seconds
                self.stats["live_slot_seconds"] += seconds * rows
                self.stats["row_steps"] += (at - done) * rows
                self.stats["tokens"] += (at - done) * rows
                context += (at - done) * rows
                done = at
            if index is not None:  # a request ends here: its row stops
                rows -= 1
                context -= running[index].context + at
        self.stats["decode_steps"] += steps
        self.stats["slot_steps"] += steps * self.num_slots
        for request, left in zip(running, lefts):
            request.generated += min(steps, left)
        self._advance_requests(running, 0)

    def _advance_requests(self, running: list[_Request], steps: int) -> None:
        """Adds `steps` tokens to each running request and finishes those at their end."""
        for request in running:
            request.generated += steps
            if request.generated < request.end:
                continue
            self._running.discard(request.id)
            self._finish(request, "stop" if request.generated >= request.target else "length")

    def _bucket(self, running: Sequence[_Request]) -> int:
        """The slots `Engine` decodes: all while a request waits, else the slot bucket that
        holds the running rows (`Engine._shrink`)."""
        if self._queue:
            return self.num_slots
        return min(self.num_slots, slot_bucket(len(running)))

    def _finish(self, request: _Request, reason: str) -> None:
        tokens, logprobs = self._output(request)
        self._finish_request(request, EngineOutput(tokens, logprobs, reason, None))

    def _output(self, request: _Request) -> tuple[list[int], list[float]]:
        """The first `generated` tokens of the request's output (module docstring)."""
        n, length = request.generated, request.target
        if length < 2:
            tokens = [request.stop_id][:n]
        else:
            answer = min(request.answer, (length - 2) // 2)
            thought = length - 2 - answer
            tokens = [THOUGHT] * min(n, thought)
            if n > thought:
                tokens += [THINK_CLOSE] + [ANSWER] * min(n - thought - 1, answer)
            if n >= length:
                tokens.append(request.stop_id)
        logprobs = [-1.0] * n
        if request.restored:
            done = len(request.restored[0])
            tokens[:done], logprobs[:done] = request.restored
        return tokens, logprobs
