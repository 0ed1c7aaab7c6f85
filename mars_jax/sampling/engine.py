"""Continuous batching over fixed decode slots on the trainer's own parameter arrays.

An `Engine` holds `num_slots` slots, each with its own KV cache of `max_length` positions and its
own position, budget, stop ids, temperature / top-k / top-p and PRNG key. Submitted requests wait
in a queue. `stream()` alternates two things: the host admits queued requests into free slots
(the prompts admitted together are prefilled as one batch per prompt bucket, right-padded, in
`prefill_chunk`-token pieces for long prompts, and each row is copied into its slot), then one
jitted chunk of up to `chunk_steps` decode steps runs over all slots; after it the host streams
finished requests out and frees their slots. While requests wait, a chunk ends early as soon
as `admit_batch` slots are free, so they are refilled at once.

Programs: one decode chunk per (slot bucket, KV span); one prefill per (prompt bucket, piece,
batch bucket); one slot insert per (prompt bucket, batch bucket); compiled when first met, or
all ahead on a thread pool by `precompile`. Requests coming and going change only array
values. When nothing waits, the running requests' rows are gathered into a smaller slot bucket
(as `generate` compacts): slot buckets num_slots, /2, .. 1. A chunk attends over the first
`span` cache positions only, `span` = the longest a running request can grow to in the chunk
plus one, rounded up to the next 2^k or 3 * 2^(k-1) (`sampler.length_bucket`; at least
`min_span`, at most `max_length`): it copies those positions out of the slot cache once, decodes
over them, and writes back the rows that decoded. At most 2 * floor(log2(max_length / min_span))
+ 3 spans (for a power-of-two `min_span`: two per doubling, `min_span` and `max_length`).

Sharding: the slot state is split over slots (the mesh's batch axes) and KV heads; inserting a
request, preempting one and shrinking / expanding write it in place, one slot row at a time
(a dynamic-update-slice per row; a row read as a masked sum over the slots when the slots are
split over chips, else as a dynamic slice), never gathering the slots of other chips, and every
program's outputs keep the state's shardings.

Exactness: a slot's row of every decode step computes what `generate`'s row computes for the same
request (same positions, same keys and values visible, sampling by
`processors.choose_tokens_per_row`, which gives each row `choose_tokens`'s result under its own
settings), and row b's PRNG key at step t is `fold_in(fold_in(key(seed), sequence_seed), t)`
as in `generate` (`seed` is the engine's, `sequence_seed` the request's). Tokens and
log-probabilities therefore do not depend on the other slots or on the admission time; they match
`generate`'s up to float32 rounding (reductions run over the chunk's span instead of `generate`'s
cache length), which changes a token only at an exact near-tie. (Paged, the other slots decide
whether a request is preempted, whose KV is then recomputed by a prefill: the same rounding
caveat; "Paged KV" below.)

Order: the outputs finished in one decode chunk are streamed in submission order (not slot
order), so a caller's choices that follow the output order do not depend on slot placement.
`submit(generated=...)` continues a request from tokens it already has (prefilled as prompt +
tokens, PRNG step continuing); `recompute(ids)` re-prefills requests in their slots under the
current weights; `update_weights` drops group prompt prefills made under the old weights.

Layout: a slot holds its request contiguously from cache position 0 (prompt, then generated
tokens); the next token is written at position `length` and sees positions `0..length`.
A request in a slot keeps the KV its tokens were decoded under until `recompute` re-prefills
prompt + tokens so far under the engine's current weights (`update_weights`): exactly on-policy
KV for the cost of a prefill of that many tokens. Recorded routing is a position's from the step
or prefill of this engine that first computed it (for `submit(generated=...)`, its prefill): a
re-prefill (`recompute`, a paged preemption) rewrites the KV, not the routing the tokens were
sampled under.

KV-cache memory: 2 x layers x kv_heads x head_dim x bytes(cache dtype) per token
(`kv_bytes_per_token`), logged at start with the cache's whole size (`kv_bytes`). By default
every slot reserves `max_length` positions whatever its request's length (`kv_bytes_per_slot`).

Paged KV (`kv_pages` = P): the cache is P pages of `page_size` positions, one pool of P / S
pages per batch shard of the slots (S = 1 without a mesh that splits them; `layers.paged_kv`,
each pool with a trash page that writes through unowned table entries land in); a slot owns
pages of its shard's pool, those its request has filled or fills in the next chunk, so
`num_slots` can exceed what reserved slots of `max_length` would fit in the same memory. Pages
are taken when a request is admitted (its prompt and first chunk) and before each chunk (what
the chunk can write), and freed when it finishes. A queued
request is admitted while a slot is free whose pool holds its first chunk's pages beside the
running requests' next chunk's; when, later, the running requests' next chunk does not fit a
pool, that pool's request admitted last is preempted: its pages and slot are freed and it waits
at the front of the queue, to be re-prefilled from prompt + tokens so far when readmitted (as
`submit(generated=...)`: same PRNG steps, KV recomputed under the current weights, which
changes a token only at a near-tie). A decode step attends over the pages with the Pallas
paged-attention kernel of the backend on GPU and TPU where the shapes suit it (reading the pages
in place; `paged_attention`), else by gathering every row's pages of the chunk's span into one
layer's contiguous cache at a time (a copy per layer: more memory traffic than a reserved slot's
in-place read). A request must fit one pool alone. With S > 1 the tail's running rows are
gathered into smaller slot buckets shard by shard (each keeps to its pool's block of rows).
"""
from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import math
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from mars_jax import sharding
from mars_jax.layers.attention import KVCache
from mars_jax.layers.attention_mask import AttentionMask
from mars_jax.layers.flash_attention import pad_to
from mars_jax.layers.paged_kv import (KERNELS, POOL_AXES, PagedKVCache, default_kernel,
                                      write_pages)
from mars_jax.models.qwen3 import Qwen3
from mars_jax.sampling.processors import check_sampling, choose_tokens_per_row
from mars_jax.sampling.sampler import batch_shards, length_bucket, prompt_bucket

log = logging.getLogger(__name__)
PREFILL_CHUNK = 1024  # default prefill piece: longer prompts are prefilled in pieces this long
MIN_SPAN = 128  # default shortest KV span a decode chunk attends over


def kv_bytes_per_token(config) -> int:
    """KV-cache bytes one token of context takes in a slot (keys and values of every layer)."""
    return (2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim
            * jnp.dtype(config.compute_dtype).itemsize)


@struct.dataclass
class SlotState:
    """Everything the decode chunk reads and writes, one row per slot."""

    cache: tuple[KVCache, ...]  # per layer, [slots, ...] over max_length positions; () paged
    next_logits: jax.Array      # [slots, V] logits of the next token
    length: jax.Array           # [slots] filled cache positions = position of the next token
    step: jax.Array             # [slots] tokens generated so far (the PRNG fold index)
    budget: jax.Array           # [slots] new-token budget
    active: jax.Array           # [slots] decoding now
    keys: jax.Array             # [slots] fold_in(key(seed), sequence_seed)
    temperature: jax.Array      # [slots] 0 = greedy
    top_k: jax.Array            # [slots] 0 = off
    top_p: jax.Array            # [slots] 1.0 = off
    stop_ids: jax.Array         # [slots, E] -1 padded
    experts: jax.Array | None   # [L_moe, slots, max_length, k] recorded routing, or None


@dataclasses.dataclass
class EngineOutput:
    """A request's new tokens (stop token included), their log-probabilities, why it ended
    ('stop' | 'length'), and with `record_routing` the expert ids `[L_moe, prompt + new tokens,
    k]`."""

    tokens: list[int]
    logprobs: list[float]
    finish_reason: str
    expert_ids: np.ndarray | None = None


@dataclasses.dataclass
class _Group:
    """A prompt shared by `n` requests; its prefill is kept until every member has a slot."""

    prompt: list[int]
    waiting: int
    prefilled: tuple | None = None


@dataclasses.dataclass
class _Request:
    id: int
    group: _Group
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


# --- device programs -------------------------------------------------------------------------
#
# The slot state is sharded over slots (`batch`) and KV heads; every program that writes it takes
# it donated and updates it in place: a slot's row is written with a dynamic-update-slice (each
# shard writes its own rows; a scatter on a sharded axis would gather the whole array first) and
# a row is read as a masked sum when the slots are split over chips (each shard reduces its rows,
# one all-reduce of the row; `_row`), and its outputs are pinned to the logical shardings the
# state was created with.

def _slot_axis(name: str) -> int:
    """The slot axis of a `SlotState` field (routing is `[L_moe, slots, ...]`)."""
    return 1 if name == "experts" else 0


def _state_names(state: SlotState) -> dict[str, object]:
    """Logical axis names of each field of `state` (the cache per layer as `cache_layout`)."""
    names = {f.name: ("batch",) + (None,) * (getattr(state, f.name).ndim - 1)
             for f in dataclasses.fields(state) if f.name not in ("cache", "experts")}
    names["next_logits"] = ("batch", "act_vocab")
    names["cache"] = KVCache(("batch", "act_kv_heads", None, "cache_length"),
                             ("batch", "act_kv_heads", "cache_length", None))
    names["experts"] = (None, "batch", None, None)
    return names


def _pinned(state: SlotState) -> SlotState:
    """`state` constrained to its logical shardings (a no-op without a mesh)."""
    names = _state_names(state)
    fields = {f.name: sharding.constrain(getattr(state, f.name), names[f.name])
              for f in dataclasses.fields(state) if f.name not in ("cache", "experts")}
    cache = tuple(KVCache(sharding.constrain(c.k, names["cache"].k),
                          sharding.constrain(c.v, names["cache"].v)) for c in state.cache)
    experts = None if state.experts is None else sharding.constrain(state.experts,
                                                                    names["experts"])
    return state.replace(cache=cache, experts=experts, **fields)


def _pinned_pool(pool: tuple[KVCache, ...] | None) -> tuple[KVCache, ...] | None:
    """Page pools constrained to their logical shardings (a pool per batch shard, KV heads
    split; pages never)."""
    if pool is None:
        return None
    return tuple(KVCache(sharding.constrain(p.k, POOL_AXES), sharding.constrain(p.v, POOL_AXES))
                 for p in pool)


def _slots_sharded(num_slots: int) -> bool:
    """Whether the current mesh (if any) splits a slot axis of `num_slots` rows into more than
    one shard (mesh axes of size 1 split nothing)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return False
    axes = sharding.spec_axes(sharding.fitted_spec(("batch",), (num_slots,), mesh)[0])
    return math.prod(mesh.shape[axis] for axis in axes) > 1


def _row(x: jax.Array, index: jax.Array, axis: int = 0) -> jax.Array:
    """Row `index` of `x` along `axis`, the axis kept (size 1). On an `axis`-sharded `x`, a
    masked sum over the axis: each shard reduces its own rows and one row is all-reduced
    (XLA:GPU partitions a one-index gather as an all-gather of `x`); exact, the other rows
    contribute zeros. Otherwise a dynamic slice (reads one row, not all of them)."""
    if not _slots_sharded(x.shape[axis]):
        return jax.lax.dynamic_slice_in_dim(x, index, 1, axis=axis)
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        data = _row(jax.random.key_data(x), index, axis)
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    hit = (jnp.arange(x.shape[axis]) == index).reshape((-1,) + (1,) * (x.ndim - axis - 1))
    if x.dtype == jnp.bool_:
        return jnp.any(hit & x, axis=axis, keepdims=True)
    return jnp.sum(jnp.where(hit, x, jnp.zeros((), x.dtype)), axis=axis, keepdims=True,
                   dtype=x.dtype)


def _set_row(x: jax.Array, index: jax.Array, value, axis: int = 0) -> jax.Array:
    """`x` with row `index` along `axis` set to `value` (with or without that axis)."""
    value = jnp.asarray(value, x.dtype)
    if value.ndim < x.ndim:
        value = jnp.expand_dims(value, axis)
    return jax.lax.dynamic_update_slice_in_dim(x, value, index, axis=axis)


def _map_rows(fn, state: SlotState, *others: SlotState) -> SlotState:
    """`fn(field, *others' fields, slot_axis)` over every array field (and layer) of `state`."""
    fields = {}
    for f in dataclasses.fields(state):
        x = getattr(state, f.name)
        if x is None:
            continue
        axis = _slot_axis(f.name)
        ys = [getattr(o, f.name) for o in others]
        if f.name == "cache":
            fields[f.name] = tuple(KVCache(fn(c.k, *(y[i].k for y in ys), axis),
                                           fn(c.v, *(y[i].v for y in ys), axis))
                                   for i, c in enumerate(x))
        else:
            fields[f.name] = fn(x, *ys, axis)
    return state.replace(**fields)


@functools.partial(jax.jit, static_argnames=("graphdef", "shards", "pages", "page_size"))
def _init_pool(graphdef, weights, *, shards: int, pages: int, page_size: int
               ) -> tuple[KVCache, ...]:
    """Zeroed page pools per layer, `shards` of `pages` pages each (`paged_kv`'s layouts)."""
    cfg = nnx.merge(graphdef, weights).config
    shape = (shards, cfg.num_key_value_heads, pages, page_size, cfg.head_dim)
    return _pinned_pool(tuple(
        KVCache(jnp.zeros(shape, cfg.compute_dtype), jnp.zeros(shape, cfg.compute_dtype))
        for _ in range(cfg.num_hidden_layers)))


@functools.partial(jax.jit, static_argnames=("graphdef", "num_slots", "max_length", "max_stops",
                                             "record", "paged"))
def _init_state(graphdef, weights, *, num_slots: int, max_length: int, max_stops: int,
                record: bool, paged: bool) -> SlotState:
    model = nnx.merge(graphdef, weights)
    cfg = model.config
    zeros = lambda dtype=jnp.int32: jnp.zeros((num_slots,), dtype)
    experts = None
    if record:
        experts = jnp.zeros((len(model.moe_layers), num_slots, max_length,
                             cfg.num_experts_per_tok), jnp.int32)
    return _pinned(SlotState(
        cache=() if paged else model.init_cache(num_slots, max_length),
        next_logits=jnp.zeros((num_slots, cfg.vocab_size), jnp.float32),
        length=zeros(), step=zeros(), budget=zeros(), active=zeros(bool),
        keys=jax.vmap(jax.random.key)(zeros(jnp.uint32)), temperature=zeros(jnp.float32),
        top_k=zeros(), top_p=jnp.ones((num_slots,), jnp.float32),
        stop_ids=jnp.full((num_slots, max_stops), -1, jnp.int32), experts=experts))


def _compile(program: Callable, *args) -> None:
    program.lower(*args).compile()


def _abstract_outputs(lowered: jax.stages.Lowered, committed: bool) -> Any:
    """Compiles `lowered`; returns its outputs as arguments of a later lowering that match the
    arrays the program returns: shapes, dtypes and, for `committed` arrays (placed by the
    caller, e.g. on a mesh), shardings."""
    compiled = lowered.compile()
    return jax.tree.map(lambda out, where: jax.ShapeDtypeStruct(
        out.shape, out.dtype, sharding=where if committed else None, weak_type=out.weak_type),
        lowered.out_info, compiled.output_shardings)


def span_bucket(needed: int, max_length: int, min_span: int = MIN_SPAN) -> int:
    """The KV span a decode chunk attends over: `needed` positions rounded up to the next 2^k or
    3 * 2^(k-1) (`length_bucket`; at least `min_span`), at most `max_length`."""
    return min(max_length, length_bucket(needed, min_span))


@functools.partial(jax.jit, static_argnames=("graphdef", "steps", "span", "kernel"),
                   donate_argnames=("state", "pool"))
def _decode_chunk(graphdef, weights, state: SlotState, pool, table, stop_after: jax.Array, *,
                  steps: int, span: int, kernel: str = "gather"):
    """Up to `steps` decode steps over all slots, attending over cache positions `0..span`
    only (the caller guarantees that every active slot's `length + steps <= span`); returns
    the state, the page pool, the chunk's tokens and log-probabilities `[slots, steps]` (a
    slot's first `step` increase entries are its own) and the steps run. Stops early when every
    slot is idle, or once `stop_after` (> 0) requests have ended. Slots idle at the start keep
    their cache. Paged (`pool` given, else None): row b's positions are in pages `table[b]`
    (`span / page` of them; the caller gives 0, the trash page, where a row owns none and for
    every row idle at the start), attended by `kernel` (`paged_kv`)."""
    model = nnx.merge(graphdef, weights)
    num_slots = state.length.shape[0]
    if pool is not None:
        state = state.replace(cache=tuple(PagedKVCache(p.k, p.v, table, kernel) for p in pool))
    max_length = span if pool is not None else state.cache[0].v.shape[2]
    full_cache, was_active = state.cache, state.active
    if span < max_length:
        state = state.replace(cache=tuple(KVCache(c.k[..., :span], c.v[:, :, :span])
                                          for c in state.cache))

    def cond(carry):
        i, s, _, _, ended = carry
        return (i < steps) & jnp.any(s.active) & ~((stop_after > 0) & (ended >= stop_after))

    def body(carry):
        i, s, tokens, logprobs, ended = carry
        keys = jax.vmap(jax.random.fold_in)(s.keys, s.step)
        token, logprob = choose_tokens_per_row(s.next_logits, keys, temperature=s.temperature,
                                               top_k=s.top_k, top_p=s.top_p)
        active = s.active
        token = jnp.where(active, token, 0)
        logprob = jnp.where(active, logprob, 0.0)
        step = s.step + active
        finished = active & (jnp.any(token[:, None] == s.stop_ids, axis=-1) | (step >= s.budget))
        out = model.forward(token[:, None], positions=s.length[:, None],
                            mask=AttentionMask.filled(s.length + 1, span), cache=s.cache,
                            cache_index=jnp.minimum(s.length, span - 1))
        experts = s.experts
        if experts is not None:
            write = lambda e, new, at: jax.lax.dynamic_update_slice_in_dim(e, new, at, axis=1)
            written = jax.vmap(write, in_axes=(1, 1, 0), out_axes=1)(experts, out.expert_ids,
                                                                      s.length)
            # An idle row's write would clamp onto its last token once its length is max_length.
            experts = jnp.where(active[None, :, None, None], written, experts)
        next_logits = jnp.where(active[:, None], model.logits(out.hidden[:, 0]), s.next_logits)
        s = s.replace(cache=out.cache, next_logits=next_logits, length=s.length + active,
                      step=step, active=active & ~finished, experts=experts)
        tokens = jax.lax.dynamic_update_slice_in_dim(tokens, token[:, None], i, axis=1)
        logprobs = jax.lax.dynamic_update_slice_in_dim(logprobs, logprob[:, None], i, axis=1)
        return i + 1, s, tokens, logprobs, ended + jnp.sum(finished)

    carry = (jnp.zeros((), jnp.int32), state, jnp.zeros((num_slots, steps), jnp.int32),
             jnp.zeros((num_slots, steps), jnp.float32), jnp.zeros((), jnp.int32))
    i, state, tokens, logprobs, _ = jax.lax.while_loop(cond, body, carry)
    if span < max_length:  # the span written back for the slots that decoded
        keep = lambda new, old: jnp.where(
            was_active.reshape((-1,) + (1,) * (new.ndim - 1)), new, old)
        state = state.replace(cache=tuple(
            KVCache(jax.lax.dynamic_update_slice(
                        full.k, keep(c.k, full.k[..., :span]), (0, 0, 0, 0)),
                    jax.lax.dynamic_update_slice(
                        full.v, keep(c.v, full.v[:, :, :span]), (0, 0, 0, 0)))
            for c, full in zip(state.cache, full_cache)))
    if pool is not None:
        pool = tuple(KVCache(c.k, c.v) for c in state.cache)
        state = state.replace(cache=())
    return _pinned(state), _pinned_pool(pool), tokens, logprobs, i


@functools.partial(jax.jit, static_argnames=("graphdef", "bucket", "fresh"),
                   donate_argnames=("cache", "logits", "experts"))
def _prefill(graphdef, weights, cache, logits, experts, tokens, start, last, *, bucket: int,
             fresh: bool):
    """Prefills `tokens [G, T]` (G right-padded prompts) at positions start.. start+T into a
    `[G, bucket]` prompt cache (zeros when `fresh`); returns the cache, the logits `[G, V]` after
    each row's position `last [G]` (rows whose `last` lies in this piece; the others keep
    `logits`) and the recorded routing `[L_moe, G, bucket, k]` (or None)."""
    model = nnx.merge(graphdef, weights)
    rows, width = tokens.shape
    if fresh:
        cache = model.init_cache(rows, bucket)
        logits = jnp.zeros((rows, model.config.vocab_size), jnp.float32)
    mask = AttentionMask(q_segments=jnp.ones((rows, width), jnp.int32),
                         kv_segments=jnp.ones((rows, bucket), jnp.int32),
                         offset=jnp.asarray(start, jnp.int32))
    positions = jnp.broadcast_to(start + jnp.arange(width), (rows, width))
    out = model.forward(tokens, positions=positions, mask=mask, cache=cache,
                        cache_index=0 if fresh else start)
    at = jnp.clip(last - start, 0, width - 1)
    hidden = jnp.take_along_axis(out.hidden, at[:, None, None], axis=1)[:, 0]
    here = (last >= start) & (last < start + width)
    logits = jnp.where(here[:, None], model.logits(hidden), logits)
    if out.expert_ids is not None:
        if fresh:
            experts = jnp.zeros(out.expert_ids.shape[:2] + (bucket,) + out.expert_ids.shape[3:],
                                jnp.int32)
        experts = jax.lax.dynamic_update_slice_in_dim(experts, out.expert_ids, start, axis=2)
    return out.cache, logits, experts


def _write_pages(pool: KVCache, prompt: KVCache, row, page_ids: jax.Array) -> KVCache:
    """`pool` with row `row` of a prompt cache written to pages `page_ids [shards, n]` (its
    positions 0 .. n * page, zero-padded or cut; `paged_kv.write_pages`)."""
    pages, page = page_ids.shape[1], pool.k.shape[3]
    width = pages * page
    k = pad_to(_row(prompt.k, row)[0], 2, page)[..., :width]  # [K, D, width]
    v = pad_to(_row(prompt.v, row)[0], 1, page)[:, :width]    # [K, width, D]
    k = jnp.transpose(k.reshape(*k.shape[:2], pages, page), (0, 2, 3, 1))  # [K, n, page, D]
    v = v.reshape(v.shape[0], pages, page, v.shape[-1])
    return KVCache(*write_pages(pool.k, pool.v, k, v, page_ids))


@functools.partial(jax.jit, donate_argnames=("state", "pool"))
def _insert(state: SlotState, pool, page_ids, slot, cache, logits, experts, row, length, step,
            budget, seed, sequence_seed, temperature, top_k, top_p, stop_ids
            ) -> tuple[SlotState, tuple[KVCache, ...] | None]:
    """`state` with slot `slot` holding row `row` of the prompt cache `[G, bucket]` (its first
    `max_length` positions, or with a page `pool` its first `len(page_ids)` pages' worth, in
    those pages) and the request's settings, active; written in place."""
    if pool is None:
        span = min(cache[0].v.shape[2], state.cache[0].v.shape[2])  # what a slot holds
        new_cache = tuple(KVCache(
            jax.lax.dynamic_update_slice(c.k, _row(p.k, row)[..., :span].astype(c.k.dtype),
                                         (slot, 0, 0, 0)),
            jax.lax.dynamic_update_slice(c.v, _row(p.v, row)[:, :, :span].astype(c.v.dtype),
                                         (slot, 0, 0, 0)))
            for c, p in zip(state.cache, cache))
    else:
        new_cache = ()
        pool = _pinned_pool(tuple(_write_pages(p, c, row, page_ids) for p, c in zip(pool, cache)))
    new_experts = state.experts
    if new_experts is not None:
        new_experts = jax.lax.dynamic_update_slice(
            new_experts, _row(experts, row, 1)[:, :, :new_experts.shape[2]], (0, slot, 0, 0))
    key = jax.random.fold_in(jax.random.key(seed), sequence_seed)
    put = lambda x, value: _set_row(x, slot, value)
    state = _pinned(state.replace(
        cache=new_cache, next_logits=put(state.next_logits, _row(logits, row)),
        length=put(state.length, length), step=put(state.step, step),
        budget=put(state.budget, budget), active=put(state.active, True), keys=put(state.keys, key),
        temperature=put(state.temperature, temperature), top_k=put(state.top_k, top_k),
        top_p=put(state.top_p, top_p), stop_ids=put(state.stop_ids, stop_ids),
        experts=new_experts))
    return state, pool


@functools.partial(jax.jit, donate_argnames=("state",))
def _put_routing(state: SlotState, slot, routing) -> SlotState:
    """`state` with `routing` `[L_moe, n, k]` as slot `slot`'s recorded routing of its first n
    positions; written in place."""
    experts = jax.lax.dynamic_update_slice(
        state.experts, routing[:, None].astype(state.experts.dtype), (0, slot, 0, 0))
    return _pinned(state.replace(experts=experts))


@functools.partial(jax.jit, donate_argnames=("state",))
def _deactivate(state: SlotState, slot) -> SlotState:
    """`state` with slot `slot` idle (a preempted request's row stops decoding); in place."""
    return _pinned(state.replace(active=_set_row(state.active, slot, False)))


@jax.jit
def _take_slots(state: SlotState, index: jax.Array, live: jax.Array) -> SlotState:
    """The state of slots `index` (KV cache included); rows where `live` is False are idle.
    Copied one row at a time into a state sharded like `state` (no gather of all slots)."""
    rows = index.shape[0]
    empty = lambda x, axis: jnp.zeros(x.shape[:axis] + (rows,) + x.shape[axis + 1:], x.dtype)
    part = _pinned(_map_rows(empty, state))

    def copy(i, part):
        return _pinned(_map_rows(lambda y, x, axis: _set_row(y, i, _row(x, index[i], axis), axis),
                                 part, state))

    part = jax.lax.fori_loop(0, rows, copy, part)
    return _pinned(part.replace(active=part.active & live))


@functools.partial(jax.jit, donate_argnames=("state",))
def _put_slots(state: SlotState, part: SlotState, rows: jax.Array, slots: jax.Array,
               count: jax.Array) -> SlotState:
    """`state` with `part`'s rows `rows[:count]` written to slots `slots[:count]`, one row at a
    time, in place."""
    def copy(i, state):
        return _pinned(_map_rows(
            lambda x, y, axis: _set_row(x, slots[i], _row(y, rows[i], axis), axis), state, part))

    return _pinned(jax.lax.fori_loop(0, count, copy, state))


# --- host side -------------------------------------------------------------------------------

class Engine:
    """Continuous-batching decode (module docstring). `model`'s arrays are read at construction
    and at each `update_weights`; `seed` is the base of every request's PRNG key. Queued
    requests are admitted once `admit_batch` slots are free (fewer if fewer wait), so their
    prompts are prefilled in one batch; decode chunks end early as soon as that many are.
    With `prefill_ahead` = P > 0, an admission's prefill call also prefills the prompts of the
    next queued requests, up to P prompts in the call; those keep their prompt KV until they get
    a slot, which they then take one at a time without a prefill (as a group's members do).
    `min_span` is the shortest KV span a decode chunk attends over (module docstring). With
    `kv_pages` = P the KV cache is P pages of `page_size` positions, pooled per batch shard
    (module docstring, "Paged KV"), attended by `paged_attention` ('auto': the backend's Pallas
    kernel on GPU and TPU where the shapes suit it, else 'gather': `paged_kv.default_kernel`;
    `paged_kv.KERNELS`)."""

    def __init__(self, model: Qwen3, *, num_slots: int, max_length: int, chunk_steps: int = 8,
                 prefill_chunk: int = PREFILL_CHUNK, max_stop_ids: int = 8, seed: int = 0,
                 record_routing: bool = False, mesh: jax.sharding.Mesh | None = None,
                 admit_batch: int = 1, prefill_ahead: int = 0, min_span: int = MIN_SPAN,
                 kv_pages: int | None = None, page_size: int = 64,
                 paged_attention: str = "auto"):
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
        self.num_slots, self.max_length, self.chunk_steps = num_slots, max_length, chunk_steps
        self.prefill_chunk, self.max_stop_ids, self.seed = prefill_chunk, max_stop_ids, seed
        self.mesh, self.admit_batch, self.min_span = mesh, max(1, admit_batch), min_span
        self.prefill_ahead = prefill_ahead
        self.record_routing = bool(record_routing) and bool(model.config.num_experts)
        self.vocab_size = model.config.vocab_size
        self._queue: collections.deque[_Request] = collections.deque()
        self.kv_pages, self.page_size = kv_pages, page_size
        self.paged_attention = (default_kernel(model.config.head_dim, page_size)
                                if paged_attention == "auto" else paged_attention)
        self.update_weights(model)
        with self._mesh():
            self._state = _init_state(self._graphdef, self._weights, num_slots=num_slots,
                                      max_length=max_length, max_stops=max_stop_ids,
                                      record=self.record_routing, paged=kv_pages is not None)
            self._pool = None if kv_pages is None else _init_pool(
                self._graphdef, self._weights, shards=multiple,
                pages=kv_pages // multiple + 1, page_size=page_size)
        if self._committed():  # as the programs' outputs will be: one program per shape
            self._state, self._pool = jax.device_put(
                (self._state, self._pool), jax.tree.map(lambda x: x.sharding,
                                                        (self._state, self._pool)))
        self._pages_per_slot = -(-max_length // page_size)
        self._table = np.zeros((num_slots, self._pages_per_slot), np.int32)  # 0: trash page
        self._owned: list[list[int]] = [[] for _ in range(num_slots)]
        self._pool_pages = (kv_pages or 0) // multiple  # per shard's pool
        self._free_pages = [list(range(self._pool_pages, 0, -1)) for _ in range(multiple)]
        self._admissions = 0
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
                     multiple, self._pool_pages, page_size, self.kv_bytes_per_token,
                     self.kv_bytes)
        self._requests: dict[int, _Request] = {}
        self._slots: list[int | None] = [None] * num_slots   # request id per slot
        self._running: set[int] = set()                      # slots decoding
        self._done: collections.deque[tuple[int, EngineOutput]] = collections.deque()
        self._next_id = 0
        self._full: SlotState | None = None   # all slots, while `_state` holds just a few
        self._rows: dict[int, int] = {}       # slot -> row of `_state` while shrunk
        self._multiple = multiple
        self.stats = collections.Counter()

    def _mesh(self):
        return sharding.use_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

    def update_weights(self, model: Qwen3) -> None:
        """Reads `model`'s current arrays: later steps, prefills and `recompute`s use them (a
        group prompt prefilled under the old arrays is prefilled again for members still
        waiting)."""
        self._graphdef, self._weights = nnx.split(model)
        for request in self._queue:
            request.group.prefilled = None

    # --- compilation ahead of serving ---

    def precompile(self, prompt_lengths: Sequence[int] = (), *, threads: int | None = None
                   ) -> int:
        """Compiles, `threads` at a time (default: one per host CPU, at most 16, as each
        compile holds its own memory; XLA compiles without the GIL), the programs serving
        reaches: a decode chunk per slot bucket and KV span, the gathers between slot buckets,
        with a paged cache a preempted row's deactivation per slot bucket, and for the prompt
        buckets of `prompt_lengths` (a recomputed request's is prompt + tokens so far) the
        prefill pieces and slot inserts at every batch bucket of a prefill. Serving then compiles
        none of these again; what it may still compile is the recorded routing written back
        into a slot (`record_routing`, one program per request length). Returns the number of
        programs compiled."""
        prompt_lengths = list(prompt_lengths)
        if any(n < 1 or n > self.max_length for n in prompt_lengths):
            raise ValueError(f"prompt_lengths: each must be in [1, max_length={self.max_length}]")
        full = self._state if self._full is None else self._full
        buckets = self._slot_buckets()
        threads = threads or min(16, os.cpu_count() or 1)
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            run = lambda jobs: list(pool.map(lambda job: job(), jobs))
            smaller = buckets[1:]
            states = dict(zip(smaller, run([functools.partial(self._compile_take, full, rows)
                                            for rows in smaller])))
            states[self.num_slots] = full
            jobs = [functools.partial(self._compile_take, states[a], b)
                    for a in smaller for b in smaller if b <= a // 2]
            index = {b: jnp.zeros((b,), jnp.int32) for b in smaller}
            jobs += [functools.partial(_compile, _put_slots, full, states[b], index[b], index[b],
                                       jnp.int32(0)) for b in smaller]
            if self._pool is not None:
                jobs += [functools.partial(_compile, _deactivate, states[b], jnp.int32(0))
                         for b in buckets]
            jobs += [functools.partial(self._compile_decode, states[b], span)
                     for b in buckets for span in self._spans()]
            shapes = [(bucket, rows)
                      for bucket in sorted({prompt_bucket(n) for n in prompt_lengths})
                      for rows in self._prefill_rows()]
            count = len(smaller) + len(jobs)
            firsts = run([functools.partial(self._compile_prefill, None, b, r, min(
                b, self.prefill_chunk)) for b, r in shapes] + jobs)[:len(shapes)]
            later = [(first, bucket, rows, width) for (bucket, rows), first in zip(shapes, firsts)
                     for width in self._later_pieces(bucket)]
            run([functools.partial(self._compile_prefill, *piece) for piece in later])
            run([functools.partial(self._compile_insert, full, first) for first in firsts])
        return count + 2 * len(shapes) + len(later)

    def _slot_buckets(self) -> list[int]:
        """Rows of the state `_shrink` can leave, largest (all slots) first."""
        sizes, per_block = {self.num_slots}, 1
        while (rows := self._bucket_rows(per_block)) <= self.num_slots // 2:
            sizes.add(rows)
            per_block *= 2
        return sorted(sizes, reverse=True)

    def _spans(self) -> list[int]:
        """Every KV span `_span` can give a decode chunk."""
        spans, needed = set(), 1
        while needed <= self.max_length:
            spans.add(self._chunk_span(needed))
            needed = span_bucket(needed, self.max_length, self.min_span) + 1
        return sorted(spans)

    def _prefill_rows(self) -> list[int]:
        """Batch buckets of a prefill: powers of two up to the slots (or `prefill_ahead`)."""
        most = max(self.num_slots, self.prefill_ahead)
        return [1 << k for k in range((most - 1).bit_length() + 1)]

    def _committed(self) -> bool:
        """Whether the engine's arrays are committed to their devices (as the weights are)."""
        return jax.tree.leaves(self._weights)[0].committed

    def _compile_take(self, state: SlotState, rows: int) -> SlotState:
        """Compiles `_shrink`'s gather of `rows` rows from `state`; returns its output's shapes."""
        lowered = _take_slots.lower(state, jnp.zeros((rows,), jnp.int32),
                                    jnp.zeros((rows,), bool))
        return _abstract_outputs(lowered, self._committed())

    # Each argument is made inside or outside the mesh context as serving makes it (inside,
    # it is placed on the mesh), so that the compiled programs are the ones serving looks up.
    def _compile_decode(self, state: SlotState, span: int) -> None:
        table = None
        if self._pool is not None:
            table = jnp.zeros((state.length.shape[0], span // self.page_size), jnp.int32)
        with self._mesh():
            _decode_chunk.lower(self._graphdef, self._weights, state, self._pool, table,
                                jnp.int32(0), steps=self.chunk_steps, span=span,
                                kernel=self.paged_attention).compile()

    def _later_pieces(self, bucket: int) -> set[int]:
        """Widths of the prefill pieces after the first of a prompt bucket (`_prefill`)."""
        piece = min(bucket, self.prefill_chunk)
        return {min(piece, bucket - start) for start in range(piece, bucket, piece)}

    def _compile_prefill(self, previous: tuple | None, bucket: int, rows: int, width: int
                         ) -> tuple:
        """Compiles a prefill piece `width` tokens wide of a `[rows, bucket]` batch, the first
        (`previous` None) or a later one (`previous`: the first's outputs, shaped as every
        piece's); returns its outputs' shapes."""
        cache, logits, experts = previous or (None, None, None)
        with self._mesh():
            return _abstract_outputs(_prefill.lower(
                self._graphdef, self._weights, cache, logits, experts,
                jnp.zeros((rows, width), jnp.int32), jnp.int32(0),
                jnp.zeros((rows,), jnp.int32), bucket=bucket, fresh=previous is None),
                self._committed())

    def _compile_insert(self, full: SlotState, prefilled: tuple) -> None:
        cache, logits, experts = prefilled
        page_ids = None
        if self._pool is not None:
            page_ids = jnp.zeros((self._multiple, self._pages_for(cache[0].v.shape[2])),
                                 jnp.int32)
        with self._mesh():
            i32, f32, u32 = jnp.int32(0), jnp.float32(0), jnp.uint32(0)
            _insert.lower(full, self._pool, page_ids, i32, cache, logits, experts, i32, i32, i32,
                          i32, u32, u32, f32, i32, f32,
                          jnp.zeros((self.max_stop_ids,), jnp.int32)).compile()

    # --- requests ---

    def submit(self, prompt_ids: Sequence[int], *, max_new_tokens: int, temperature: float = 1.0,
               top_p: float = 1.0, top_k: int = 0, seed: int = 0, stop_ids: Sequence[int] = (),
               n: int = 1, generated: tuple[Sequence[int], Sequence[float]] | None = None
               ) -> list[int]:
        """Queues `n` requests on one prompt (sequence seeds `seed`, `seed + 1`, ...; the prompt
        is prefilled once, kept until every member has a slot) and returns their ids.
        `temperature=0` is greedy. `generated` continues one request (`n=1`) from tokens and
        log-probabilities it already produced (e.g. restored from a checkpoint): prompt + tokens
        are prefilled, its PRNG step continues at their count, they count against
        `max_new_tokens` and its output includes them, so it equals an uninterrupted decode whose
        KV was recomputed at that point."""
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("prompt_ids: need at least one token")
        if any(t < 0 or t >= self.vocab_size for t in prompt):
            raise ValueError(f"prompt_ids: token ids must be in [0, {self.vocab_size})")
        if max_new_tokens < 0 or len(prompt) + max_new_tokens > self.max_length:
            raise ValueError(f"max_new_tokens: prompt ({len(prompt)}) + max_new_tokens "
                             f"({max_new_tokens}) must fit max_length ({self.max_length})")
        if self.kv_pages is not None and -(-(len(prompt) + max_new_tokens)
                                           // self.page_size) > self._pool_pages:
            raise ValueError(f"max_new_tokens: prompt ({len(prompt)}) + max_new_tokens "
                             f"({max_new_tokens}) must fit kv_pages ({self.kv_pages}) / batch "
                             f"shards ({self._multiple}) x page_size ({self.page_size})")
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
        group = _Group(prompt, waiting=n)
        ids = []
        for i in range(n):
            request = _Request(self._next_id, group, int(max_new_tokens), float(temperature),
                               int(top_k), float(top_p), int(seed) + i,
                               tuple(int(s) for s in stop_ids), list(tokens), list(logprobs))
            self._next_id += 1
            self._requests[request.id] = request
            ids.append(request.id)
            if max_new_tokens == 0:
                group.waiting -= 1
                self._finish(request, "length")
            else:
                self._queue.append(request)
        return ids

    def recompute(self, request_ids: Sequence[int]) -> None:
        """Re-prefills the KV caches of requests in slots from prompt + tokens so far under the
        current weights, in one batched prefill; they go on from there (same PRNG steps, same
        budgets)."""
        requests = [self._requests[i] for i in request_ids]
        if any(r.slot is None for r in requests):
            raise ValueError("recompute: every request must hold a slot")
        self._expand()
        for request in requests:
            request.routing = self._recorded_routing(request)
        for request, prefilled in zip(requests, self._prefill(
                [r.group.prompt + r.tokens for r in requests])):
            self._insert(request, request.slot, prefilled)

    def in_slots(self) -> list[int]:
        """Ids of the requests holding a slot (decoding), by slot."""
        return [i for i in self._slots if i is not None]

    def partial(self, request_id: int) -> tuple[list[int], list[float]]:
        """Tokens and log-probabilities a queued or decoding request has so far."""
        request = self._requests[request_id]
        return list(request.tokens), list(request.logprobs)

    def finished(self) -> list[tuple[int, EngineOutput]]:
        """Takes the outputs that finished but were not yet yielded by `stream`."""
        done = list(self._done)
        self._done.clear()
        return done

    def kv_cache(self, request_id: int) -> tuple[KVCache, ...]:
        """The filled part of a request's slot cache (host arrays, per layer `[K, D, L]` keys
        and `[K, L, D]` values for its L = prompt + new tokens positions)."""
        request = self._requests[request_id]
        length = len(request.group.prompt) + len(request.tokens)
        if self._pool is not None:
            pages, shard = self._owned[request.slot], self._shard(request.slot)
            pool = sharding.fetch(self._pool)
            join = lambda x: x.reshape(x.shape[0], -1, x.shape[-1])[:, :length]  # [K, L, D]
            return tuple(KVCache(
                np.swapaxes(join(np.asarray(p.k)[shard][:, pages]), 1, 2),
                join(np.asarray(p.v)[shard][:, pages])) for p in pool)
        cache, row = sharding.fetch(self._state.cache), self._row(request.slot)
        return tuple(KVCache(np.asarray(c.k[row, :, :, :length]),
                             np.asarray(c.v[row, :, :length])) for c in cache)

    # --- the loop ---

    def stream(self, stop: Callable[[], bool] | None = None
               ) -> Iterator[tuple[int, EngineOutput]]:
        """Runs until no request decodes (or, with `stop`, until `stop()` is true after a decode
        chunk), yielding `(request_id, output)` as each one finishes."""
        while True:
            while self._done:
                yield self._done.popleft()
            if stop is not None and stop():
                return
            self._admit()
            if self._pool is not None:
                self._ensure_pages()
            if not self._running:
                self._expand()
                return
            self._shrink()
            self._decode()

    def run(self) -> dict[int, EngineOutput]:
        """Drains everything submitted; outputs by request id."""
        return dict(self.stream())

    def _row(self, slot: int) -> int:
        return slot if self._full is None else self._rows[slot]

    def _shrink(self) -> None:
        """Once nothing waits and the running requests fit a slot bucket at most half the
        current one, decodes just their rows (gathered, KV caches included) so idle slots stop
        costing compute; tokens are unchanged (each row keeps its state). With a page pool per
        batch shard, each shard's requests stay in that shard's block of rows."""
        rows = self._state.length.shape[0]
        if self._queue:
            return
        pools = self._pools()
        blocks: list[list[int]] = [[] for _ in range(pools)]
        for slot in sorted(self._running):
            blocks[self._shard(slot) if pools > 1 else 0].append(slot)
        target = self._bucket_rows(1 << (max(map(len, blocks)) - 1).bit_length())
        if target > rows // 2:
            return
        stride = target // pools  # block b is rows b * stride ..
        index = np.full((target,), self._row(min(self._running)), np.int32)
        live, placed = np.zeros((target,), bool), {}
        for b, slots in enumerate(blocks):
            for j, slot in enumerate(slots):
                index[b * stride + j], live[b * stride + j] = self._row(slot), True
                placed[slot] = b * stride + j
        if self._full is None:
            self._full = self._state
        self._state = _take_slots(self._state, jnp.asarray(index), jnp.asarray(live))
        self._rows = placed
        self.stats["shrinks"] += 1

    def _pools(self) -> int:
        """Blocks of rows a shrunk state keeps apart: one per page pool, else one."""
        return self._multiple if self._pool is not None else 1

    def _bucket_rows(self, per_block: int) -> int:
        """Rows of a shrunk state holding `per_block` requests in each of `_pools()` blocks."""
        return -(-per_block * self._pools() // self._multiple) * self._multiple

    def _expand(self) -> None:
        """Back to all slots (the shrunk rows written to theirs)."""
        if self._full is None:
            return
        rows, slots = np.zeros((2, self._state.length.shape[0]), np.int32)
        for i, (slot, row) in enumerate(self._rows.items()):
            rows[i], slots[i] = row, slot
        self._state = _put_slots(self._full, self._state, jnp.asarray(rows), jnp.asarray(slots),
                                 jnp.int32(len(self._rows)))
        self._full, self._rows = None, {}

    def _admission_size(self) -> int:
        """Free slots wanted before admitting: one if the next request's prompt is already
        prefilled, else `admit_batch`, or fewer if fewer requests wait."""
        if self._queue and self._queue[0].group.prefilled is not None:
            return 1
        return min(self.admit_batch, len(self._queue))

    def _stop_after(self) -> int:
        """Finishes after which the next chunk ends early (0: never): enough for an admission."""
        if not self._queue:
            return 0
        return max(1, self._admission_size() - self._slots.count(None))

    def _admit(self) -> None:
        """Fills free slots from the queue once `_admission_size` of them are free (or nothing
        runs); the prompts not yet prefilled are prefilled together (one call per prompt bucket
        and batch bucket)."""
        if not self._queue or (self._running
                               and self._slots.count(None) < self._admission_size()):
            return
        if self._pool is not None and self._free_slot_for(self._queue[0]) is None:
            return
        self._expand()
        admitted = []
        while self._queue and None in self._slots:
            request = self._queue[0]
            slot = self._free_slot_for(request)
            if slot is None:
                break
            self._queue.popleft()
            self._slots[slot], request.slot = request.id, slot
            self._admissions += 1
            request.order = self._admissions
            if self._pool is not None:
                self._grow(slot, self._chunk_positions(request))
            admitted.append(request)
        fresh = [r for r in admitted if not r.tokens]
        continued = [r for r in admitted if r.tokens]
        groups = list({id(r.group): r.group for r in fresh
                       if r.group.prefilled is None}.values())
        if groups or continued:
            groups += self._ahead(self.prefill_ahead - len(groups) - len(continued), groups)
        prefills = self._prefill([g.prompt for g in groups]
                                 + [r.group.prompt + r.tokens for r in continued])
        for group, prefilled in zip(groups, prefills):
            group.prefilled = prefilled
        for request, prefilled in zip(continued, prefills[len(groups):]):
            request.group.prefilled = prefilled
        for request in admitted:
            self._insert(request, request.slot, request.group.prefilled)
            self._running.add(request.slot)
            request.group.waiting -= 1
            if request.group.waiting == 0:
                request.group.prefilled = None

    def _ahead(self, count: int, chosen: list[_Group]) -> list[_Group]:
        """Up to `count` groups of queued fresh requests, in queue order, whose prompts are not
        prefilled and not among `chosen`."""
        seen, ahead = {id(g) for g in chosen}, []
        for request in self._queue:
            if len(ahead) >= count:
                break
            group = request.group
            if not request.tokens and group.prefilled is None and id(group) not in seen:
                seen.add(id(group))
                ahead.append(group)
        return ahead

    def _prefill(self, sequences: list[list[int]]) -> list[tuple]:
        """Per sequence: (prompt cache, logits, routing, row) of a batched prefill, sequences
        right-padded to their prompt bucket and batched by bucket (batch a power of two)."""
        if not sequences:
            return []
        start_time = time.perf_counter()
        by_bucket: dict[int, list[int]] = {}
        for i, seq in enumerate(sequences):
            by_bucket.setdefault(prompt_bucket(len(seq)), []).append(i)
        out: list[tuple | None] = [None] * len(sequences)
        for bucket, members in by_bucket.items():
            rows = 1 << (len(members) - 1).bit_length()
            padded = np.zeros((rows, bucket), np.int32)
            last = np.zeros((rows,), np.int32)
            for row, i in enumerate(members):
                padded[row, :len(sequences[i])] = sequences[i]
                last[row] = len(sequences[i]) - 1
            piece = min(bucket, self.prefill_chunk)
            cache = logits = experts = None
            with self._mesh():
                for start in range(0, int(last.max()) + 1, piece):
                    cache, logits, experts = _prefill(
                        self._graphdef, self._weights, cache, logits, experts,
                        jnp.asarray(padded[:, start:start + piece]), jnp.int32(start),
                        jnp.asarray(last), bucket=bucket, fresh=start == 0)
            for row, i in enumerate(members):
                out[i] = (cache, logits, experts, row)
            self.stats["prefills"] += len(members)
            self.stats["prefill_calls"] += 1
            self.stats["prefill_tokens"] += sum(len(sequences[i]) for i in members)
        jax.block_until_ready(out[-1][1])
        self.stats["prefill_seconds"] += time.perf_counter() - start_time
        return out

    def _insert(self, request: _Request, slot: int, prefilled: tuple) -> None:
        cache, logits, experts, row = prefilled
        step = len(request.tokens)
        stops = np.full((self.max_stop_ids,), -1, np.int32)
        stops[:len(request.stop_ids)] = request.stop_ids
        page_ids = None
        if self._pool is not None:
            if not self._grow(slot, len(request.group.prompt) + step):
                raise RuntimeError("kv_pages: no free page for a request's prefill")
            pages = self._pages_for(cache[0].v.shape[2])
            ids = np.zeros((self._multiple, pages), np.int32)  # other pools: their trash page
            ids[self._shard(slot)] = self._table[slot, :pages]
            page_ids = jnp.asarray(ids)
        with self._mesh():
            self._state, self._pool = _insert(
                self._state, self._pool, page_ids, jnp.int32(slot), cache, logits, experts,
                jnp.int32(row),
                jnp.int32(len(request.group.prompt) + step), jnp.int32(step),
                jnp.int32(request.max_new),
                jnp.uint32(self.seed), jnp.uint32(request.sequence_seed),
                jnp.float32(request.temperature), jnp.int32(request.top_k),
                jnp.float32(request.top_p), jnp.asarray(stops))
            if request.routing is not None:  # positions decoded before: their own routing
                self._state = _put_routing(self._state, jnp.int32(slot), request.routing)
        request.routing = None

    def _span(self) -> int:
        """The KV span of the next decode chunk: the longest a running request can grow to in
        it (prompt + tokens + at most `chunk_steps`, up to its budget), plus one, bucketed
        (`_chunk_span`). The one: a row that stops mid-chunk goes on writing (discarded) keys
        at its length until the chunk ends."""
        needed = max(self._chunk_positions(self._requests[self._slots[s]])
                     for s in self._running)
        return self._chunk_span(needed + 1)

    def _chunk_span(self, needed: int) -> int:
        """`needed` positions bucketed (`span_bucket`), in whole pages when paged."""
        span = span_bucket(needed, self.max_length, self.min_span)
        return span if self._pool is None else self._pages_for(span) * self.page_size

    def _chunk_positions(self, request: _Request) -> int:
        """Cache positions `request` fills by the end of the next decode chunk."""
        return len(request.group.prompt) + min(len(request.tokens) + self.chunk_steps,
                                               request.max_new)

    def _decode(self) -> None:
        start_time = time.perf_counter()
        span, table = self._span(), None
        if self._pool is not None:
            # The running rows' first pages (an idle row's writes go to the trash page).
            pages = span // self.page_size
            rows = np.zeros((self._state.length.shape[0], pages), np.int32)
            for slot in self._running:
                rows[self._row(slot)] = self._table[slot, :pages]
            table = jnp.asarray(rows)
        with self._mesh():
            self._state, self._pool, tokens, logprobs, steps = _decode_chunk(
                self._graphdef, self._weights, self._state, self._pool, table,
                jnp.int32(self._stop_after()), steps=self.chunk_steps, span=span,
                kernel=self.paged_attention)
        tokens, logprobs, step, active, steps = sharding.fetch(
            (tokens, logprobs, self._state.step, self._state.active, steps))
        self.stats["decode_seconds"] += time.perf_counter() - start_time
        self.stats["decode_steps"] += int(steps)
        self.stats["slot_steps"] += int(steps) * self.num_slots
        self.stats["row_steps"] += int(steps) * len(step)
        for slot in sorted(self._running, key=lambda s: self._slots[s]):  # by request id
            request, row = self._requests[self._slots[slot]], self._row(slot)
            new = int(step[row]) - len(request.tokens)
            request.tokens += tokens[row, :new].tolist()
            request.logprobs += logprobs[row, :new].tolist()
            self.stats["tokens"] += new
            if active[row]:
                continue
            self._running.discard(slot)
            stopped = bool(request.tokens) and request.tokens[-1] in request.stop_ids
            self._finish(request, "stop" if stopped else "length")

    def _recorded_routing(self, request: _Request) -> np.ndarray | None:
        """The expert ids recorded for the positions of `request` (in a slot) so far, or None
        without `record_routing`."""
        if not self.record_routing or request.slot is None:
            return None
        length = len(request.group.prompt) + len(request.tokens)
        return np.asarray(sharding.fetch(self._state.experts[:, self._row(request.slot), :length]))

    def _finish(self, request: _Request, reason: str) -> None:
        self._done.append((request.id, EngineOutput(list(request.tokens), list(request.logprobs),
                                                    reason, self._recorded_routing(request))))
        if request.slot is not None:
            self._free_slot(request.slot)
        del self._requests[request.id]

    # --- pages (paged KV only) ---

    def _shard(self, slot: int) -> int:
        """The batch shard, and so the page pool, of `slot`."""
        return slot // (self.num_slots // self._multiple)

    def _free_slot(self, slot: int) -> None:
        """Frees `slot` and the pages it owns (its table row back to the trash page)."""
        self._slots[slot] = None
        self._free_pages[self._shard(slot)] += self._owned[slot][::-1]
        self._owned[slot] = []
        self._table[slot] = 0

    def _pages_for(self, positions: int) -> int:
        """Pages that hold `positions` cache positions (at most a slot's table)."""
        return min(-(-positions // self.page_size), self._pages_per_slot)

    def _grow(self, slot: int, positions: int) -> bool:
        """Extends `slot`'s pages to hold `positions` cache positions; False, taking none,
        when its pool has too few free."""
        owned, free = self._owned[slot], self._free_pages[self._shard(slot)]
        need = self._pages_for(positions) - len(owned)
        if need > len(free):
            return False
        for _ in range(need):
            self._table[slot, len(owned)] = free[-1]
            owned.append(free.pop())
        return True

    def _free_slot_for(self, request: _Request) -> int | None:
        """A free slot for queued `request` (reserved slots: the first); paged, the first whose
        pool holds what it fills by the end of its first chunk beside the pages the pool's
        running requests take for their next chunk (so admitting it preempts nobody before that
        chunk), or None."""
        free = [slot for slot, held in enumerate(self._slots) if held is None]
        if self._pool is None:
            return free[0] if free else None
        growth = collections.Counter()
        for slot in self._running:
            running = self._requests[self._slots[slot]]
            growth[self._shard(slot)] += max(
                0, self._pages_for(self._chunk_positions(running)) - len(self._owned[slot]))
        need = self._pages_for(self._chunk_positions(request))
        return next((slot for slot in free if need + growth[self._shard(slot)]
                     <= len(self._free_pages[self._shard(slot)])), None)

    def _ensure_pages(self) -> None:
        """Gives every running request the pages its next chunk writes, oldest admission first;
        when its pool runs out, preempts the running request of that pool admitted last
        (`_preempt`)."""
        order = lambda slot: self._requests[self._slots[slot]].order
        for slot in sorted(self._running, key=order):
            if slot not in self._running:  # preempted for an older one
                continue
            while not self._grow(slot, self._chunk_positions(self._requests[self._slots[slot]])):
                victim = max((s for s in self._running if self._shard(s) == self._shard(slot)),
                             key=order)
                self._preempt(victim)
                if victim == slot:
                    break

    def _preempt(self, slot: int) -> None:
        """Stops `slot`'s request and frees its slot and pages; it goes back to the front of the
        queue with its tokens, to be re-prefilled (prompt + tokens) when readmitted."""
        request = self._requests[self._slots[slot]]
        request.routing = self._recorded_routing(request)
        self._state = _deactivate(self._state, jnp.int32(self._row(slot)))
        self._running.discard(slot)
        self._free_slot(slot)
        request.slot = None
        request.group = _Group(request.group.prompt, waiting=1)
        self._queue.appendleft(request)
        self.stats["preemptions"] += 1
