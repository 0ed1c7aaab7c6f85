"""The engine's device programs: one jitted program per step of serving, over the slot state.

Caches are stacked over the layers and written in place; inserts and slot moves write one row at a
time, keeping the state's shardings (no gather of other chips' slots). With `stack_weights` runs of
alike layers are scanned, so compile time does not grow with depth. A slot's decode step computes
what `generate`'s row computes for the same request, PRNG key `fold_in(fold_in(key(seed),
sequence_seed), t)` included, up to float32 rounding.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx, struct

from mars_jax import sharding
from mars_jax.buckets import length_bucket
from mars_jax.layers.attention import KVCache, stacked_cache_layout
from mars_jax.layers.attention_mask import AttentionMask
from mars_jax.layers.flash_attention import pad_to
from mars_jax.layers.paged_kv import POOL_AXES, PagedKVCache, write_pages
from mars_jax.models.qwen3 import Qwen3, merge_stacked
from mars_jax.sampling.processors import choose_tokens_per_row

MIN_SPAN = 128  # default shortest KV span a decode chunk attends over


@struct.dataclass
class SlotState:
    """Everything the decode chunk reads and writes, one row per slot."""

    cache: KVCache | tuple      # stacked over layers, [L, slots, ...] over max_length positions;
                                # () paged
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


# The slot state is sharded over slots (`batch`) and KV heads; every program that writes it takes
# it donated and updates it in place: a slot's row is written with a dynamic-update-slice (each
# shard writes its own rows; a scatter on a sharded axis would gather the whole array first) and
# a row is read as a masked sum when the slots are split over chips (each shard reduces its rows,
# one all-reduce of the row; `_row`), and its outputs are pinned to the logical shardings the
# state was created with.

def _slot_axis(name: str) -> int:
    """The slot axis of a `SlotState` field (1 for routing and the cache, else 0)."""
    return 1 if name in ("experts", "cache") else 0


def _state_names(state: SlotState) -> dict[str, object]:
    """Logical axis names of each field of `state` (the cache per layer as `cache_layout`)."""
    names = {f.name: ("batch",) + (None,) * (getattr(state, f.name).ndim - 1)
             for f in dataclasses.fields(state) if f.name not in ("cache", "experts")}
    names["next_logits"] = ("batch", "act_vocab")
    names["cache"] = KVCache(*(names for _, names in stacked_cache_layout(1, 1, 1, 1, 1)))
    names["experts"] = (None, "batch", None, None)
    return names


def _pinned(state: SlotState) -> SlotState:
    """`state` constrained to its logical shardings (a no-op without a mesh)."""
    names = _state_names(state)
    fields = {f.name: sharding.constrain(getattr(state, f.name), names[f.name])
              for f in dataclasses.fields(state) if f.name not in ("cache", "experts")}
    cache = state.cache
    if cache != ():
        cache = KVCache(sharding.constrain(cache.k, names["cache"].k),
                        sharding.constrain(cache.v, names["cache"].v))
    experts = None if state.experts is None else sharding.constrain(state.experts,
                                                                    names["experts"])
    return state.replace(cache=cache, experts=experts, **fields)


def _pinned_pool(pool: KVCache | None) -> KVCache | None:
    """Page pools constrained to their logical shardings (per batch shard, KV heads split)."""
    if pool is None:
        return None
    return KVCache(sharding.constrain(pool.k, POOL_AXES), sharding.constrain(pool.v, POOL_AXES))


def _slots_sharded(num_slots: int) -> bool:
    """Whether the current mesh splits a slot axis of `num_slots` rows."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return False
    axes = sharding.spec_axes(sharding.fitted_spec(("batch",), (num_slots,), mesh)[0])
    return math.prod(mesh.shape[axis] for axis in axes) > 1


def _row(x: jax.Array, index: jax.Array, axis: int = 0) -> jax.Array:
    """Row `index` of `x` along `axis` (kept, size 1): a masked sum where `axis` is sharded
    (XLA:GPU partitions a one-index gather as an all-gather), else a dynamic slice."""
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
            fields[f.name] = () if x == () else KVCache(fn(x.k, *(y.k for y in ys), axis),
                                                        fn(x.v, *(y.v for y in ys), axis))
        else:
            fields[f.name] = fn(x, *ys, axis)
    return state.replace(**fields)


def merged(graphdef, weights) -> tuple[Qwen3, tuple | None]:
    """The model of an engine's `weights`: `(state, None)` unrolled, or `(rest, stacks)` scanned."""
    state, stacks = weights
    if stacks is None:
        return nnx.merge(graphdef, state), None
    return merge_stacked(graphdef, state, stacks), stacks


@functools.partial(jax.jit, static_argnames=("shardings",))
def _stack_runs(runs, shardings):
    """Each run's layer weights stacked on a new leading axis, pinned to `shardings`."""
    out = tuple(jax.tree.map(lambda *xs: jnp.stack(xs), *run) for run in runs)
    if shardings is None:
        return out
    leaves, tree = jax.tree.flatten(out)
    return jax.tree.unflatten(tree, [jax.lax.with_sharding_constraint(x, where)
                                     for x, where in zip(leaves, shardings)])


def stack_weights(model: Qwen3):
    """An engine's graph and weights with the layers scanned (`merged`): the model's arrays
    outside the layers and a stacked copy of each run of alike layers (`Qwen3.layer_runs`)."""
    graphdef, layers, rest = nnx.split(model, nnx.PathContains("layers"), ...)
    runs = [[layers["layers"][i] for i in range(start, stop)]
            for start, stop in model.layer_runs()]
    where = [getattr(x, "sharding", None) for x in jax.tree.leaves([run[0] for run in runs])]
    shardings = None
    if all(isinstance(w, jax.sharding.NamedSharding) for w in where):
        shardings = tuple(jax.sharding.NamedSharding(w.mesh, jax.sharding.PartitionSpec(
            None, *w.spec)) for w in where)
    return graphdef, (rest, _stack_runs(runs, shardings))


@functools.partial(jax.jit, static_argnames=("graphdef", "shards", "pages", "page_size"))
def init_pool(graphdef, weights, *, shards: int, pages: int, page_size: int) -> KVCache:
    """Zeroed page pools of every layer: `shards` pools of `pages` pages a layer."""
    cfg = merged(graphdef, weights)[0].config
    shape = (shards, cfg.num_key_value_heads, cfg.num_hidden_layers * pages, page_size,
             cfg.head_dim)
    return _pinned_pool(KVCache(jnp.zeros(shape, cfg.compute_dtype),
                                jnp.zeros(shape, cfg.compute_dtype)))


@functools.partial(jax.jit, static_argnames=("graphdef", "num_slots", "max_length", "max_stops",
                                             "record", "paged"))
def init_state(graphdef, weights, *, num_slots: int, max_length: int, max_stops: int,
               record: bool, paged: bool) -> SlotState:
    model = merged(graphdef, weights)[0]
    cfg = model.config
    zeros = lambda dtype=jnp.int32: jnp.zeros((num_slots,), dtype)
    experts = None
    if record:
        experts = jnp.zeros((len(model.moe_layers), num_slots, max_length,
                             cfg.num_experts_per_tok), jnp.int32)
    return _pinned(SlotState(
        cache=() if paged else model.init_cache(num_slots, max_length, stacked=True),
        next_logits=jnp.zeros((num_slots, cfg.vocab_size), jnp.float32),
        length=zeros(), step=zeros(), budget=zeros(), active=zeros(bool),
        keys=jax.vmap(jax.random.key)(zeros(jnp.uint32)), temperature=zeros(jnp.float32),
        top_k=zeros(), top_p=jnp.ones((num_slots,), jnp.float32),
        stop_ids=jnp.full((num_slots, max_stops), -1, jnp.int32), experts=experts))



def span_bucket(needed: int, max_length: int, min_span: int = MIN_SPAN) -> int:
    """The KV span a decode chunk attends over: `needed` positions rounded up to the next 2^k or
    3 * 2^(k-1) (`length_bucket`; at least `min_span`), at most `max_length`."""
    return min(max_length, length_bucket(needed, min_span))


@functools.partial(jax.jit, static_argnames=("graphdef", "steps", "span", "kernel"),
                   donate_argnames=("state", "pool"))
def decode_chunk(graphdef, weights, state: SlotState, pool, table, stop_after: jax.Array, *,
                 steps: int, span: int, kernel: str = "gather"):
    """Up to `steps` decode steps over all slots, attending over positions `0..span` (the caller
    guarantees `length + steps <= span` for active slots); returns the state, the pool, tokens
    and log-probabilities `[slots, steps]` and the steps run. Stops early when every slot is idle
    or `stop_after` (> 0) requests have ended. Paged: rows read pages `table[b]` through
    `kernel`."""
    model, stacks = merged(graphdef, weights)
    num_slots = state.length.shape[0]
    if pool is not None:
        state = state.replace(cache=PagedKVCache(pool.k, pool.v, table, kernel,
                                                 layers=model.config.num_hidden_layers))
    positions = span if pool is not None else state.cache.v.shape[3]  # a row's cache

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
                            cache_index=jnp.minimum(s.length, positions - 1), layer_stacks=stacks)
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
    if pool is not None:
        pool = KVCache(state.cache.k, state.cache.v)
        state = state.replace(cache=())
    return _pinned(state), _pinned_pool(pool), tokens, logprobs, i


@functools.partial(jax.jit, static_argnames=("graphdef", "bucket", "fresh"),
                   donate_argnames=("cache", "logits", "experts"))
def prefill(graphdef, weights, cache, logits, experts, tokens, start, last, *, bucket: int,
            fresh: bool):
    """Prefills right-padded `tokens [G, T]` at positions start..start+T into a `[G, bucket]`
    prompt cache (zeros when `fresh`); returns the cache, the logits after each row's `last`
    position (rows whose `last` is elsewhere keep `logits`) and the recorded routing (or None)."""
    model, stacks = merged(graphdef, weights)
    rows, width = tokens.shape
    if fresh:
        cache = model.init_cache(rows, bucket, stacked=True)
        logits = jnp.zeros((rows, model.config.vocab_size), jnp.float32)
    mask = AttentionMask(q_segments=jnp.ones((rows, width), jnp.int32),
                         kv_segments=jnp.ones((rows, bucket), jnp.int32),
                         offset=jnp.asarray(start, jnp.int32))
    positions = jnp.broadcast_to(start + jnp.arange(width), (rows, width))
    out = model.forward(tokens, positions=positions, mask=mask, cache=cache,
                        cache_index=0 if fresh else start, layer_stacks=stacks)
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
    """`pool` with row `row` of a stacked prompt cache written to pages `page_ids` of every
    layer, the layer loop unrolled (XLA partitions a `fori_loop` here with copies of the pool)."""
    pages, page = page_ids.shape[1], pool.k.shape[3]
    layers = prompt.k.shape[0]
    block = pool.k.shape[2] // layers  # layer l's pages: the l-th block
    width = pages * page

    def layer(l, pool):
        k = pad_to(_row(prompt.k[l], row)[0], 2, page)[..., :width]  # [K, D, width]
        v = pad_to(_row(prompt.v[l], row)[0], 1, page)[:, :width]    # [K, width, D]
        k = jnp.transpose(k.reshape(*k.shape[:2], pages, page), (0, 2, 3, 1))  # [K, n, page, D]
        v = v.reshape(v.shape[0], pages, page, v.shape[-1])
        return KVCache(*write_pages(pool.k, pool.v, k, v, page_ids + l * block))

    for l in range(layers):
        pool = layer(l, pool)
    return pool


@functools.partial(jax.jit, donate_argnames=("state", "pool"))
def insert(state: SlotState, pool, page_ids, slot, cache, logits, experts, row, length, step,
           budget, seed, sequence_seed, temperature, top_k, top_p, stop_ids
           ) -> tuple[SlotState, KVCache | None]:
    """`state` with slot `slot` holding prompt-cache row `row` and the request, active."""
    if pool is None:
        c = state.cache
        span = min(cache.v.shape[3], c.v.shape[3])  # what a slot holds
        new_cache = KVCache(
            jax.lax.dynamic_update_slice(c.k, _row(cache.k, row, 1)[..., :span].astype(c.k.dtype),
                                         (0, slot, 0, 0, 0)),
            jax.lax.dynamic_update_slice(c.v, _row(cache.v, row, 1)[..., :span, :].astype(
                c.v.dtype), (0, slot, 0, 0, 0)))
    else:
        new_cache = ()
        pool = _pinned_pool(_write_pages(pool, cache, row, page_ids))
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
def put_routing(state: SlotState, slot, routing) -> SlotState:
    """`state` with `routing` `[L_moe, n, k]` as slot `slot`'s first n positions' routing."""
    experts = jax.lax.dynamic_update_slice(
        state.experts, routing[:, None].astype(state.experts.dtype), (0, slot, 0, 0))
    return _pinned(state.replace(experts=experts))


@functools.partial(jax.jit, donate_argnames=("state",))
def deactivate(state: SlotState, slot) -> SlotState:
    """`state` with slot `slot` idle (a preempted request's row stops decoding); in place."""
    return _pinned(state.replace(active=_set_row(state.active, slot, False)))


@jax.jit
def take_slots(state: SlotState, index: jax.Array, live: jax.Array) -> SlotState:
    """The state of slots `index` (idle where not `live`), copied one row at a time."""
    rows = index.shape[0]
    empty = lambda x, axis: jnp.zeros(x.shape[:axis] + (rows,) + x.shape[axis + 1:], x.dtype)
    part = _pinned(_map_rows(empty, state))

    def copy(i, part):
        return _pinned(_map_rows(lambda y, x, axis: _set_row(y, i, _row(x, index[i], axis), axis),
                                 part, state))

    part = jax.lax.fori_loop(0, rows, copy, part)
    return _pinned(part.replace(active=part.active & live))


@functools.partial(jax.jit, donate_argnames=("state",))
def put_slots(state: SlotState, part: SlotState, rows: jax.Array, slots: jax.Array,
              count: jax.Array) -> SlotState:
    """`state` with `part`'s rows `rows[:count]` written in place to slots `slots[:count]`."""
    def copy(i, state):
        return _pinned(_map_rows(
            lambda x, y, axis: _set_row(x, slots[i], _row(y, rows[i], axis), axis), state, part))

    return _pinned(jax.lax.fori_loop(0, count, copy, state))
