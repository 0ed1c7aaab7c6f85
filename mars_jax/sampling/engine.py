"""Continuous batching over fixed decode slots on the trainer's own parameter arrays.

Each of `num_slots` slots holds one request and a KV cache of `max_length` positions. `stream()`
alternates host admission of queued requests (prompts prefilled together) with one jitted chunk of
up to `chunk_steps` decode steps over all slots. Programs compile once per bucket (slots, KV span,
prompt length), so requests coming and going change only array values.

A request's tokens and log-probabilities do not depend on the other slots or its admission time and
match `generate`'s up to float32 rounding; outputs finished in one chunk stream in submission order.
A request keeps the KV it was decoded under until `recompute`. Paged KV (`kv_pages`): pages of
`page_size` positions, one pool per batch shard, so more slots fit; a pool that runs out preempts
its newest request, later re-prefilled with the same PRNG steps.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mars_jax import sharding
from mars_jax.layers.attention import KVCache
from mars_jax.layers.paged_kv import KERNELS, default_kernel
from mars_jax.models.qwen3 import Qwen3
from mars_jax.sampling import engine_programs as programs
from mars_jax.sampling.engine_programs import MIN_SPAN, SlotState, span_bucket, stack_weights
from mars_jax.sampling.kv_memory import (bytes_per_row, device_free_bytes, kv_bytes_per_token,
                                          prefill_parts)
from mars_jax.sampling.pages import PageTable
from mars_jax.sampling.prefill_batches import Prefilled, prefill_batches
from mars_jax.sampling.processors import check_sampling
from mars_jax.sampling.sampler import batch_shards
from mars_jax.sampling.scheduler import Group, SlotScheduler, shrink_plan, slot_buckets

__all__ = ["MIN_SPAN", "PREFILL_CHUNK", "Engine", "EngineOutput", "SlotState",
           "kv_bytes_per_token", "span_bucket"]
log = logging.getLogger(__name__)
PREFILL_CHUNK = 1024  # default prefill piece: longer prompts are prefilled in pieces this long


@dataclasses.dataclass
class EngineOutput:
    """A request's new tokens (stop token included), their log-probabilities, why it ended
    ('stop' | 'length'), and with `record_routing` the expert ids `[L_moe, prompt + new, k]`."""

    tokens: list[int]
    logprobs: list[float]
    finish_reason: str
    expert_ids: np.ndarray | None = None


@dataclasses.dataclass
class _Request:
    id: int
    group: Group
    max_new: int
    temperature: float
    top_k: int
    top_p: float
    sequence_seed: int
    stop_ids: tuple[int, ...]
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    slot: int | None = None
    order: int = 0  # admission count when it last took a slot (paged: preempted newest first)
    routing: np.ndarray | None = None  # recorded routing of its positions, kept over a re-prefill


class Engine(SlotScheduler):
    """Continuous-batching decode (module docstring); `seed` is the base of every request's PRNG
    key. `prefill_ahead` = P > 0 also prefills up to P next queued prompts in an admission's
    prefill."""

    def __init__(self, model: Qwen3, *, num_slots: int, max_length: int, chunk_steps: int = 8,
                 prefill_chunk: int = PREFILL_CHUNK, max_stop_ids: int = 8, seed: int = 0,
                 record_routing: bool = False, mesh: jax.sharding.Mesh | None = None,
                 admit_batch: int = 1, prefill_ahead: int = 0, min_span: int = MIN_SPAN,
                 kv_pages: int | None = None, page_size: int = 64,
                 paged_attention: str = "auto", scan_layers: bool | None = None):
        if num_slots < 1 or max_length < 2 or chunk_steps < 1:
            raise ValueError(f"Engine: need num_slots >= 1, max_length >= 2, chunk_steps >= 1; "
                             f"got {num_slots}, {max_length}, {chunk_steps}")
        if min_span < 1:
            raise ValueError(f"min_span: must be >= 1, got {min_span}")
        if prefill_ahead < 0:
            raise ValueError(f"prefill_ahead: must be >= 0, got {prefill_ahead}")
        if prefill_chunk < 16 or prefill_chunk & (prefill_chunk - 1):
            raise ValueError(f"prefill_chunk: must be a power of two >= 16, got {prefill_chunk}")
        multiple = batch_shards(mesh)
        if num_slots % multiple:
            raise ValueError(f"num_slots: {num_slots} is not a multiple of the mesh's batch "
                             f"shards ({multiple})")
        if kv_pages is not None and (kv_pages < 1 or page_size < 1):
            raise ValueError(f"kv_pages, page_size: need >= 1 each, got {kv_pages}, {page_size}")
        if paged_attention not in ("auto",) + KERNELS:
            raise ValueError(f"paged_attention: one of {('auto',) + KERNELS}, got "
                             f"{paged_attention!r}")
        if kv_pages is not None and kv_pages % multiple:
            raise ValueError(f"kv_pages: {kv_pages} is not a multiple of the mesh's batch shards "
                             f"({multiple}: one pool each)")
        if model.config.capacity_factor is not None:
            raise ValueError("Engine: capacity-based MoE drops tokens depending on the batch; "
                             "set capacity_factor=None (dropless) for exact per-request outputs")
        super().__init__(num_slots, admit_batch=admit_batch)
        self.max_length, self.chunk_steps = max_length, chunk_steps
        self.prefill_chunk, self.max_stop_ids, self.seed = prefill_chunk, max_stop_ids, seed
        self.mesh, self.min_span, self.prefill_ahead = mesh, min_span, prefill_ahead
        self.record_routing = bool(record_routing) and bool(model.config.num_experts)
        self.vocab_size, self.num_layers = model.config.vocab_size, model.config.num_hidden_layers
        self.kv_pages, self.page_size = kv_pages, page_size
        self.paged_attention = (default_kernel(model.config.head_dim, page_size)
                                if paged_attention == "auto" else paged_attention)
        self.batch_shards = multiple
        self.scan_layers = model.config.scan_layers if scan_layers is None else scan_layers
        self.update_weights(model)
        self.page_table = None if kv_pages is None else PageTable(
            num_slots=num_slots, pools=multiple, pages=kv_pages, page_size=page_size,
            max_length=max_length)
        with self.mesh_context():
            self.state = programs.init_state(
                self.graphdef, self.weights, num_slots=num_slots, max_length=max_length,
                max_stops=max_stop_ids, record=self.record_routing, paged=kv_pages is not None)
            self.pool = None if kv_pages is None else programs.init_pool(
                self.graphdef, self.weights, shards=multiple,
                pages=kv_pages // multiple + 1, page_size=page_size)
        if self.committed:  # as the programs' outputs will be: one program per shape
            self.state, self.pool = jax.device_put(
                (self.state, self.pool), jax.tree.map(lambda x: x.sharding,
                                                      (self.state, self.pool)))
        self.kv_bytes_per_token = kv_bytes_per_token(model.config)
        self.kv_bytes_per_slot = self.kv_bytes_per_token * max_length
        if kv_pages is None:
            self.kv_bytes = self.kv_bytes_per_slot * num_slots
            log.info("Engine: %d slots x %d positions; KV cache %d bytes per token, %d per slot, "
                     "%d in all", num_slots, max_length, self.kv_bytes_per_token,
                     self.kv_bytes_per_slot, self.kv_bytes)
        else:  # every pool's pages and its trash page
            self.kv_bytes = self.kv_bytes_per_token * page_size * (kv_pages + multiple)
            log.info("Engine: %d slots of up to %d positions over %d pools of %d pages x %d "
                     "positions; KV cache %d bytes per token, %d in all", num_slots, max_length,
                     multiple, self.page_table.pool_pages, page_size, self.kv_bytes_per_token,
                     self.kv_bytes)
        self._full: SlotState | None = None   # all slots, while `state` holds just a few
        self._rows: dict[int, int] = {}       # slot -> row of `state` while shrunk
        self.stats = collections.Counter()

    def _devices(self) -> list:
        """This process's devices of the slot state."""
        return list(self.state.length.sharding.addressable_devices)

    def mesh_context(self) -> contextlib.AbstractContextManager:
        """The engine's mesh as the current one (nothing without a mesh)."""
        return sharding.use_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

    @property
    def committed(self) -> bool:
        """Whether the engine's arrays are committed to their devices (as the weights are)."""
        return jax.tree.leaves(self.weights)[0].committed

    @property
    def full_state(self) -> SlotState:
        """The slot state of every slot (`state` holds just the running rows while shrunk)."""
        return self.state if self._full is None else self._full

    def slot_buckets(self) -> list[int]:
        """Every number of rows `state` can have, all slots first (`scheduler.slot_buckets`)."""
        return slot_buckets(self.num_slots, pools=self._pools(), shards=self.batch_shards)

    def pages_for(self, positions: int) -> int:
        """Pages holding `positions` cache positions (0 with reserved slots)."""
        return 0 if self.page_table is None else self.page_table.pages_for(positions)

    def update_weights(self, model: Qwen3) -> None:
        """Reads `model`'s current arrays for later steps, dropping queued prefills; with
        `scan_layers` the engine keeps its own stacked copy of the layer weights."""
        self.weights = None  # the old stacked copy freed before the new one is made
        if self.scan_layers:
            self.graphdef, self.weights = stack_weights(model)
        else:
            graphdef, state = nnx.split(model)
            self.graphdef, self.weights = graphdef, (state, None)
        self._drop_prefills()

    def free_kv(self) -> None:
        """Deletes the KV cache and queued prefills from device memory (e.g. for an update on the
        same chips); the next step reallocates it and re-prefills every request holding a slot."""
        self._expand()
        self._drop_prefills()
        if not self._kv_freed:
            for array in jax.tree.leaves((self.state.cache, self.pool)):
                array.delete()

    @property
    def _kv_freed(self) -> bool:
        """Whether `free_kv` deleted the cache (and nothing has allocated it since)."""
        return jax.tree.leaves((self.state.cache, self.pool))[0].is_deleted()

    def _allocate_kv(self) -> bool:
        """Allocates the cache `free_kv` deleted (zeros, same shardings); whether it did."""
        if not self._kv_freed:
            return False
        zeros = lambda x: jnp.zeros(x.shape, x.dtype, device=x.sharding)
        with self.mesh_context():
            self.state = self.state.replace(cache=jax.tree.map(zeros, self.state.cache))
            self.pool = jax.tree.map(zeros, self.pool)
        return True

    # --- requests ---

    def submit(self, prompt_ids: Sequence[int], *, max_new_tokens: int, temperature: float = 1.0,
               top_p: float = 1.0, top_k: int = 0, seed: int = 0, stop_ids: Sequence[int] = (),
               n: int = 1, generated: tuple[Sequence[int], Sequence[float]] | None = None
               ) -> list[int]:
        """Queues `n` requests on one prompt (sequence seeds `seed`, `seed + 1`, ...) and returns
        their ids; `temperature=0` is greedy. `generated` continues one request from tokens it
        already has: prefilled with the prompt, counted against `max_new_tokens`, its PRNG step
        continuing."""
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("prompt_ids: need at least one token")
        if any(t < 0 or t >= self.vocab_size for t in prompt):
            raise ValueError(f"prompt_ids: token ids must be in [0, {self.vocab_size})")
        if max_new_tokens < 0 or len(prompt) + max_new_tokens > self.max_length:
            raise ValueError(f"max_new_tokens: prompt ({len(prompt)}) + max_new_tokens "
                             f"({max_new_tokens}) must fit max_length ({self.max_length})")
        if self.page_table is not None and -(-(len(prompt) + max_new_tokens)
                                         // self.page_size) > self.page_table.pool_pages:
            raise ValueError(f"max_new_tokens: prompt ({len(prompt)}) + max_new_tokens "
                             f"({max_new_tokens}) must fit kv_pages ({self.kv_pages}) / batch "
                             f"shards ({self.batch_shards}) x page_size ({self.page_size})")
        check_sampling(temperature, top_p, top_k, self.vocab_size)
        if len(stop_ids) > self.max_stop_ids:
            raise ValueError(f"stop_ids: at most {self.max_stop_ids} (max_stop_ids), got "
                             f"{len(stop_ids)}")
        if n < 1:
            raise ValueError(f"n: need n >= 1, got {n}")
        tokens, logprobs = ([int(t) for t in generated[0]], [float(x) for x in generated[1]]
                            ) if generated else ([], [])
        if generated and (n != 1 or len(tokens) != len(logprobs)
                          or len(tokens) >= max_new_tokens):
            raise ValueError(f"generated: continues one request (n=1) with as many logprobs as "
                             f"tokens and fewer tokens than max_new_tokens ({max_new_tokens}); got "
                             f"n={n}, {len(tokens)} tokens, {len(logprobs)} logprobs")
        group = Group(prompt, waiting=n)
        ids = []
        for i in range(n):
            request = _Request(self._new_id(), group, int(max_new_tokens), float(temperature),
                               int(top_k), float(top_p), int(seed) + i,
                               tuple(int(s) for s in stop_ids), list(tokens), list(logprobs))
            ids.append(request.id)
            if max_new_tokens == 0:
                self._requests[request.id] = request
                group.waiting -= 1
                self._finish(request, "length")
            else:
                self._enqueue(request)
        return ids

    def recompute(self, request_ids: Sequence[int]) -> None:
        """Re-prefills `request_ids` (in slots) under the current weights; same PRNG steps."""
        requests = [self._requests[i] for i in request_ids]
        if any(r.slot is None for r in requests):
            raise ValueError("recompute: every request must hold a slot")
        self._expand()
        if self._allocate_kv():  # after `free_kv`: every request in a slot
            requests = [self._requests[i] for i in self.in_slots()]
        sequences = [r.group.prompt + r.tokens for r in requests]
        for part in self._prefill_parts(sequences):
            for i in part:
                requests[i].routing = self._recorded_routing(requests[i])
            for i, prefilled in zip(part, self._prefill([sequences[i] for i in part])):
                self._insert(requests[i], requests[i].slot, prefilled)

    def _prefill_parts(self, sequences: list[list[int]]) -> list[list[int]]:
        """`kv_memory.prefill_parts` of `sequences` on the engine's devices."""
        devices = self._devices()
        return prefill_parts([len(s) for s in sequences], free=device_free_bytes(devices),
                             devices=len(devices), bytes_per_token=self.kv_bytes_per_token)

    def partial(self, request_id: int) -> tuple[list[int], list[float]]:
        """Tokens and log-probabilities a queued or decoding request has so far."""
        request = self._requests[request_id]
        return list(request.tokens), list(request.logprobs)

    def kv_cache(self, request_id: int) -> tuple[KVCache, ...]:
        """The filled part of a request's cache as host arrays: per layer `[K, D, L]` keys and
        `[K, L, D]` values, L = prompt + new tokens."""
        request = self._requests[request_id]
        length = len(request.group.prompt) + len(request.tokens)
        layers = self.num_layers
        if self.page_table is not None:
            pages, shard = self.page_table.owned[request.slot], self.page_table.pool(request.slot)
            pool = sharding.fetch(self.pool)
            block = pool.k.shape[2] // layers  # layer l's pages: the l-th block
            join = lambda x: x.reshape(x.shape[0], -1, x.shape[-1])[:, :length]  # [K, L, D]
            return tuple(KVCache(
                np.swapaxes(join(np.asarray(pool.k)[shard][:, np.add(pages, l * block)]), 1, 2),
                join(np.asarray(pool.v)[shard][:, np.add(pages, l * block)]))
                for l in range(layers))
        cache, row = sharding.fetch(self.state.cache), self._row(request.slot)
        return tuple(KVCache(np.asarray(cache.k[l, row, :, :, :length]),
                             np.asarray(cache.v[l, row, :, :length])) for l in range(layers))

    # --- the loop ---

    def _step(self) -> bool:
        if self._kv_freed:
            self.recompute([])
        self._admit()
        if self.page_table is not None:
            self._ensure_pages()
        if not self._running:
            self._expand()
            return False
        self._shrink()
        self._decode()
        return True

    def _row(self, slot: int) -> int:
        return slot if self._full is None else self._rows[slot]

    def _running_slots(self) -> list[int]:
        return sorted(self._requests[i].slot for i in self._running)

    def _pools(self) -> int:
        """Blocks of rows a shrunk state keeps apart: one per page pool, else one."""
        return self.batch_shards if self.page_table is not None else 1

    def _shrink(self) -> None:
        """Once nothing waits and the running rows fit a slot bucket at most half the current
        one, decodes just those rows (if the gathered copy fits in memory), each staying in its
        pool's block."""
        if self._queue:
            return
        plan = shrink_plan(self._running_slots(), current_rows=self.state.length.shape[0],
                           row_of=self._row, block_of=lambda s: self.page_table.pool(s),
                           pools=self._pools(), shards=self.batch_shards)
        if plan is None or not self._room_for(len(plan.index)):
            return
        if self._full is None:
            self._full = self.state
        # numpy arguments: placed on the engine's devices by the call, not on the default device
        self.state = programs.take_slots(self.state, np.array(plan.index, np.int32),
                                         np.array(plan.live, bool))
        self._rows = plan.rows
        self.stats["shrinks"] += 1

    def _room_for(self, rows: int) -> bool:
        """Whether `rows` gathered rows of the slot state fit each device's free memory."""
        free = device_free_bytes(self._devices())
        if free is None or bytes_per_row(self.state, self.state.length.shape[0]) * rows <= free:
            return True
        self.stats["shrinks_skipped"] += 1
        return False

    def _expand(self) -> None:
        """Back to all slots (the shrunk rows written to theirs)."""
        if self._full is None:
            return
        rows, slots = np.zeros((2, self.state.length.shape[0]), np.int32)
        for i, (slot, row) in enumerate(self._rows.items()):
            rows[i], slots[i] = row, slot
        self.state = programs.put_slots(self._full, self.state, rows, slots,
                                        np.int32(len(self._rows)))
        self._full, self._rows = None, {}

    def _place(self, request: _Request) -> int | None:
        """A free slot for `request`, or None; paged, the first whose pool holds its first chunk
        beside the running requests' next chunks (so admitting it preempts nobody)."""
        free = [slot for slot, held in enumerate(self._slots) if held is None]
        if self.page_table is None:
            return free[0] if free else None
        running = {self._requests[i].slot: self._chunk_positions(self._requests[i])
                   for i in self._running}
        slot = self.page_table.first_fit(free, self._chunk_positions(request), running)
        if slot is not None:
            self.page_table.grow(slot, self._chunk_positions(request))
        return slot

    def _admit(self) -> None:
        """Fills free slots from the queue, prefilling new prompts together (`_admit_queued`)."""
        admitted = self._admit_queued(self._place)
        if not admitted:
            return
        self._expand()
        groups, continued = self._prefill_plan(admitted, self.prefill_ahead)
        owners = groups + [r.group for r in continued]
        sequences = [g.prompt for g in groups] + [r.group.prompt + r.tokens for r in continued]
        for part in self._prefill_parts(sequences) or [[]]:
            for i, prefilled in zip(part, self._prefill([sequences[i] for i in part])):
                owners[i].prefilled = prefilled
            waiting = []
            for request in admitted:
                if request.group.prefilled is None:
                    waiting.append(request)
                    continue
                self._insert(request, request.slot, request.group.prefilled)
                self._running.add(request.id)
                self._seated(request)
            admitted = waiting

    def _prefill(self, sequences: list[list[int]]) -> list[Prefilled]:
        """Per sequence: its prefill in a batch (`prefill_batches`) under the current weights."""
        return prefill_batches(self.graphdef, self.weights, sequences,
                               prefill_chunk=self.prefill_chunk,
                               mesh_context=self.mesh_context, stats=self.stats)

    def _insert(self, request: _Request, slot: int, prefilled: tuple) -> None:
        cache, logits, experts, row = prefilled
        step = len(request.tokens)
        stops = np.full((self.max_stop_ids,), -1, np.int32)
        stops[:len(request.stop_ids)] = request.stop_ids
        page_ids = None
        if self.page_table is not None:
            page_ids = jnp.asarray(self.page_table.insert_ids(
                slot, len(request.group.prompt) + step, cache.v.shape[3]))
        with self.mesh_context():
            self.state, self.pool = programs.insert(
                self.state, self.pool, page_ids, jnp.int32(slot), cache, logits, experts,
                jnp.int32(row),
                jnp.int32(len(request.group.prompt) + step), jnp.int32(step),
                jnp.int32(request.max_new),
                jnp.uint32(self.seed), jnp.uint32(request.sequence_seed),
                jnp.float32(request.temperature), jnp.int32(request.top_k),
                jnp.float32(request.top_p), jnp.asarray(stops))
            if request.routing is not None:  # positions decoded before: their own routing
                self.state = programs.put_routing(self.state, jnp.int32(slot), request.routing)
        request.routing = None

    def _span(self) -> int:
        """The KV span of the next chunk: the longest a running request can reach in it, plus one
        (a row stopping mid-chunk still writes discarded keys at its length), bucketed
        (`chunk_span`)."""
        needed = max(self._chunk_positions(self._requests[i]) for i in self._running)
        return self.chunk_span(needed + 1)

    def chunk_span(self, needed: int) -> int:
        """`needed` positions bucketed (`span_bucket`), in whole pages when paged."""
        span = span_bucket(needed, self.max_length, self.min_span)
        return span if self.page_table is None else self.page_table.pages_for(span) * self.page_size

    def _chunk_positions(self, request: _Request) -> int:
        """Cache positions `request` fills by the end of the next decode chunk."""
        return len(request.group.prompt) + min(len(request.tokens) + self.chunk_steps,
                                               request.max_new)

    def _decode(self) -> None:
        start_time = time.perf_counter()
        span, table = self._span(), None
        if self.page_table is not None:  # an idle row's writes go to the trash page
            table = jnp.asarray(self.page_table.chunk_table(
                {self._row(s): s for s in self._running_slots()}, self.state.length.shape[0],
                span))
        with self.mesh_context():
            self.state, self.pool, tokens, logprobs, steps = programs.decode_chunk(
                self.graphdef, self.weights, self.state, self.pool, table,
                jnp.int32(self._stop_after()), steps=self.chunk_steps, span=span,
                kernel=self.paged_attention)
        tokens, logprobs, step, active, steps = sharding.fetch(
            (tokens, logprobs, self.state.step, self.state.active, steps))
        self.stats["decode_seconds"] += time.perf_counter() - start_time
        self.stats["decode_steps"] += int(steps)
        self.stats["slot_steps"] += int(steps) * self.num_slots
        self.stats["row_steps"] += int(steps) * len(step)
        for request_id in sorted(self._running):
            request = self._requests[request_id]
            row = self._row(request.slot)
            new = int(step[row]) - len(request.tokens)
            request.tokens += tokens[row, :new].tolist()
            request.logprobs += logprobs[row, :new].tolist()
            self.stats["tokens"] += new
            if active[row]:
                continue
            self._running.discard(request_id)
            stopped = bool(request.tokens) and request.tokens[-1] in request.stop_ids
            self._finish(request, "stop" if stopped else "length")

    def _recorded_routing(self, request: _Request) -> np.ndarray | None:
        """The expert ids recorded for `request`'s positions so far, or None."""
        if not self.record_routing or request.slot is None:
            return None
        length = len(request.group.prompt) + len(request.tokens)
        return np.asarray(sharding.fetch(self.state.experts[:, self._row(request.slot), :length]))

    def _finish(self, request: _Request, reason: str) -> None:
        self._finish_request(request, EngineOutput(list(request.tokens), list(request.logprobs),
                                                   reason, self._recorded_routing(request)))

    def _vacate(self, slot: int) -> None:
        """Frees `slot` and the pages it owns."""
        super()._vacate(slot)
        if self.page_table is not None:
            self.page_table.release(slot)

    # --- pages (paged KV only) ---

    def _ensure_pages(self) -> None:
        """Gives every running request the pages its next chunk writes, oldest admission first;
        when a pool runs out, preempts that pool's newest admission (`_preempt`)."""
        running = {}
        for request_id in self._running:
            request = self._requests[request_id]
            running[request.slot] = (self._chunk_positions(request), request.order)
        self.page_table.make_room(running, self._preempt)

    def _preempt(self, slot: int) -> None:
        """Stops `slot`'s request, freeing slot and pages; it waits at the queue's front."""
        request = self._requests[self._slots[slot]]
        request.routing = self._recorded_routing(request)
        self.state = programs.deactivate(self.state, np.int32(self._row(slot)))
        self._requeue(request)
        request.group = Group(request.group.prompt, waiting=1)
        self.stats["preemptions"] += 1
