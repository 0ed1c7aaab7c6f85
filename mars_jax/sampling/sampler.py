"""Batched KV-cache sampling on the trainer's own parameter arrays.

`generate` prefills left-padded prompts and decodes in one jitted `lax.while_loop`, compacting live
rows into smaller batch buckets; row keys `fold_in(fold_in(key(seed), sequence_seed), step)` keep a
sequence's tokens independent of the rest of the batch.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from mars_jax import sharding
from mars_jax.buckets import length_bucket, pow2_at_least
from mars_jax.layers.attention import KVCache
from mars_jax.layers.attention_mask import AttentionMask
from mars_jax.models.qwen3 import Qwen3, positions_from_mask
from mars_jax.sampling import batch_memory
from mars_jax.sampling.processors import check_sampling, choose_tokens

MIN_PROMPT_BUCKET = 16
MIN_NEW_BUCKET = 16
COMPACT_EVERY = 32  # decode steps between checks for finished rows to drop (see `generate`)


@struct.dataclass
class DecodeState:
    """Everything the decode loop carries (compaction continues from it exactly)."""

    cache: tuple[KVCache, ...]
    next_logits: jax.Array      # [B, V] logits for the next token
    tokens: jax.Array           # [B, N] generated ids (0 after a row stops)
    logprobs: jax.Array         # [B, N]
    experts: jax.Array | None   # [L_moe, B, P + N, k] recorded routing, or None
    step: jax.Array             # () tokens decoded so far (shared by all rows)
    lengths: jax.Array          # [B] tokens generated per row
    done: jax.Array             # [B] row has stopped
    hit_stop: jax.Array         # [B] row stopped on a stop token
    keys: jax.Array             # [B] per-row PRNG keys
    prompt_mask: jax.Array      # [B, P] real prompt tokens (left padding)
    prompt_lengths: jax.Array   # [B]
    max_new: jax.Array          # [B] per-row budget of new tokens
    stop_ids: jax.Array         # [B, E] per-row stop token ids, -1 padded


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Static settings of one decode (part of the compiled program's key)."""

    greedy: bool
    top_k: int
    top_p: float
    record_routing: bool


@dataclasses.dataclass
class SampleResult:
    """Per prompt: new token ids (stop token included), their log-probabilities, 'stop' |
    'length', and with `record_routing` the expert ids `[L_moe, prompt + new, k]`."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    finish_reasons: list[str]
    expert_ids: list[np.ndarray] | None


def prompt_bucket(prompt_len: int) -> int:
    """The padded prompt length `generate` uses for a batch whose longest prompt has this length."""
    return length_bucket(prompt_len, MIN_PROMPT_BUCKET)


def new_tokens_bucket(max_new_tokens: int) -> int:
    """The cache slots `generate` reserves for a batch whose largest budget is this."""
    return length_bucket(max_new_tokens, MIN_NEW_BUCKET)


def _decode_loop(model: Qwen3, state: DecodeState, end_step: jax.Array, temperature: jax.Array,
                 params: SamplingParams) -> DecodeState:
    num_new = state.tokens.shape[1]
    prompt_len = state.prompt_mask.shape[1]
    end_step = jnp.minimum(end_step, num_new)

    def cond(s: DecodeState):
        return (s.step < end_step) & ~jnp.all(s.done)

    def body(s: DecodeState) -> DecodeState:
        keys = jax.vmap(jax.random.fold_in)(s.keys, jnp.broadcast_to(s.step, s.keys.shape))
        token, logprob = choose_tokens(s.next_logits, keys, greedy=params.greedy,
                                       temperature=temperature, top_k=params.top_k,
                                       top_p=params.top_p)
        active = ~s.done
        token = jnp.where(active, token, 0)
        logprob = jnp.where(active, logprob, 0.0)
        is_stop = active & jnp.any(token[:, None] == s.stop_ids, axis=-1)
        lengths = s.lengths + active
        done = s.done | is_stop | (lengths >= s.max_new)
        out = model.forward(token[:, None], positions=(s.prompt_lengths + s.step)[:, None],
                            mask=AttentionMask.decode_step(s.prompt_mask, num_new,
                                                           prompt_len + s.step), cache=s.cache,
                            cache_index=prompt_len + s.step)
        experts = s.experts
        if params.record_routing:
            experts = jax.lax.dynamic_update_slice_in_dim(experts, out.expert_ids,
                                                          prompt_len + s.step, axis=2)
        return s.replace(
            cache=out.cache, next_logits=model.logits(out.hidden[:, 0]),
            tokens=jax.lax.dynamic_update_slice_in_dim(s.tokens, token[:, None], s.step, axis=1),
            logprobs=jax.lax.dynamic_update_slice_in_dim(s.logprobs, logprob[:, None], s.step, axis=1),
            experts=experts, step=s.step + 1, lengths=lengths, done=done,
            hit_stop=s.hit_stop | is_stop)

    return jax.lax.while_loop(cond, body, state)


@functools.partial(jax.jit, static_argnames=("graphdef", "num_new", "params"))
def prefill_and_decode(graphdef, weights, prompt_tokens, prompt_mask, max_new, stop_ids, keys,
                        temperature, end_step, *, num_new: int, params: SamplingParams):
    model = nnx.merge(graphdef, weights)
    batch, prompt_len = prompt_tokens.shape
    mask = AttentionMask.causal(prompt_mask, num_extra_keys=num_new)
    out = model.forward(prompt_tokens, positions=positions_from_mask(prompt_mask), mask=mask,
                        cache=model.init_cache(batch, prompt_len + num_new), cache_index=0)
    experts = None
    if params.record_routing:
        experts = jnp.pad(out.expert_ids, ((0, 0), (0, 0), (0, num_new), (0, 0)))
    state = DecodeState(
        cache=out.cache, next_logits=model.logits(out.hidden[:, -1]),
        tokens=jnp.zeros((batch, num_new), jnp.int32),
        logprobs=jnp.zeros((batch, num_new), jnp.float32), experts=experts,
        step=jnp.zeros((), jnp.int32), lengths=jnp.zeros((batch,), jnp.int32),
        done=max_new <= 0, hit_stop=jnp.zeros((batch,), bool), keys=keys,
        prompt_mask=prompt_mask.astype(bool), prompt_lengths=jnp.sum(prompt_mask, axis=1),
        max_new=max_new, stop_ids=stop_ids)
    return _decode_loop(model, state, end_step, temperature, params)


@functools.partial(jax.jit, static_argnames=("graphdef", "params"), donate_argnames=("state",))
def continue_decode(graphdef, weights, state, temperature, end_step, *, params: SamplingParams):
    return _decode_loop(nnx.merge(graphdef, weights), state, end_step, temperature, params)


def batch_shards(mesh: jax.sharding.Mesh | None) -> int:
    """How many shards the mesh's batch axes split a decode batch into (1 without a mesh)."""
    if mesh is None:
        return 1
    axes = sharding.spec_axes(sharding.logical_to_spec(("batch",))[0])
    return int(np.prod([mesh.shape[a] for a in axes]))


def batch_bucket(rows: int, multiple: int) -> int:
    """Rows of a decode batch holding `rows` sequences: a power of two, rounded up to `multiple`."""
    return -(-pow2_at_least(rows, 1) // multiple) * multiple


def _per_row(value, n: int, name: str) -> list:
    if isinstance(value, (int, np.integer)) or (name == "eos_token_ids" and (
            not value or isinstance(value[0], (int, np.integer)))):
        return [value] * n
    if len(value) != n:
        raise ValueError(f"{name}: expected one entry per prompt ({n}), got {len(value)}")
    return list(value)


def generate(model: Qwen3, prompts: Sequence[Sequence[int]], *, max_new_tokens: int | Sequence[int],
             temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
             eos_token_ids: Sequence[int] | Sequence[Sequence[int]] = (), seed: int = 0,
             sequence_seeds: Sequence[int] | None = None, record_routing: bool = False,
             mesh: jax.sharding.Mesh | None = None,
             compact_every: int | None = COMPACT_EVERY) -> SampleResult:
    """Samples continuations of `prompts` (token-id lists) with `model`'s arrays; `temperature=0`
    is greedy, budgets and stop ids may be per prompt, row i's sequence seed is
    `sequence_seeds[i]` (default: i). Every `compact_every` steps (None: never) live rows move to
    a smaller bucket."""
    if compact_every is not None and compact_every < 1:
        raise ValueError(f"compact_every: must be >= 1 or None, got {compact_every}")
    n = len(prompts)
    if n == 0:
        raise ValueError("prompts: expected at least one prompt")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("prompts: every prompt needs at least one token")
    vocab = model.config.vocab_size
    check_sampling(temperature, top_p, top_k, vocab)
    if any(t < 0 or t >= vocab for p in prompts for t in p):
        raise ValueError(f"prompts: token ids must be in [0, {vocab})")
    max_new = [int(m) for m in _per_row(max_new_tokens, n, "max_new_tokens")]
    if min(max_new) < 0:
        raise ValueError(f"max_new_tokens: must be >= 0, got {min(max_new)}")
    stops = [tuple(s) for s in _per_row(tuple(eos_token_ids), n, "eos_token_ids")]
    seeds = list(range(n)) if sequence_seeds is None else list(sequence_seeds)
    if len(seeds) != n:
        raise ValueError(f"sequence_seeds: expected {n} entries, got {len(seeds)}")

    multiple = batch_shards(mesh)
    prompt_len = prompt_bucket(max(len(p) for p in prompts))
    num_new = new_tokens_bucket(max(max_new))
    params = SamplingParams(greedy=temperature == 0, top_k=int(top_k), top_p=float(top_p),
                            record_routing=bool(record_routing) and bool(model.config.num_experts))
    size = static_rows(model.config, n, prompt_len, num_new, record_routing=params.record_routing,
                       mesh=mesh, free=_free_bytes(mesh))
    graphdef, weights = nnx.split(model)
    rows: dict[int, _Row] = {}
    for start in range(0, n, size):
        part = slice(start, start + size)
        decoded = _decode_batch(graphdef, weights, prompts[part], max_new[part], stops[part],
                                seeds[part], seed=seed, temperature=temperature,
                                shape=(prompt_len, num_new), params=params, mesh=mesh,
                                compact_every=compact_every)
        rows.update({start + i: row for i, row in decoded.items()})
    return _assemble(rows)


def static_rows(config, n: int, prompt_len: int, num_new: int, *, record_routing: bool,
                mesh: jax.sharding.Mesh | None, free: int | None) -> int:
    """Rows of one `generate` program for `n` prompts: all, or fewer where their bucket would
    take over half of `free` bytes (`batch_memory.static_row_bytes`), never fewer than the batch
    shards."""
    if free is None:
        return n
    multiple = batch_shards(mesh)
    on_cpu = (mesh.devices.flat[0] if mesh is not None else jax.devices()[0]).platform == "cpu"
    spread = 1 if on_cpu else multiple
    room = free // 2 - batch_memory.static_fixed_bytes(config, prompt_len)
    per_row = batch_memory.static_row_bytes(config, prompt_len, num_new,
                                            record_routing=record_routing)
    rows = n
    while rows > multiple and batch_bucket(rows, multiple) * per_row > room * spread:
        rows = pow2_at_least(rows, 1) // 2
    return max(rows, min(n, multiple))


def _free_bytes(mesh: jax.sharding.Mesh | None) -> int | None:
    """Bytes free for a decode batch on `mesh`: the devices' reported free memory, the host's RAM
    on CPU; None where unknown or the mesh spans several processes (which would need to agree)."""
    devices = list(mesh.devices.flat) if mesh is not None else jax.devices()[:1]
    if any(d.process_index != jax.process_index() for d in devices):
        return None
    if devices[0].platform == "cpu":
        return batch_memory.host_free_bytes()
    return batch_memory.device_free_bytes(devices)


def _decode_batch(graphdef, weights, prompts, max_new: list[int], stops: list[tuple],
                  seeds: list[int], *, seed: int, temperature: float, shape: tuple[int, int],
                  params: SamplingParams, mesh: jax.sharding.Mesh | None,
                  compact_every: int | None) -> dict[int, _Row]:
    """One program's decode of `prompts` at the whole call's padded `shape`: `_Row`s by index."""
    n, (prompt_len, num_new) = len(prompts), shape
    multiple = batch_shards(mesh)
    batch = batch_bucket(n, multiple)
    tokens = np.zeros((batch, prompt_len), np.int32)
    mask = np.zeros((batch, prompt_len), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, prompt_len - len(p):] = p
        mask[i, prompt_len - len(p):] = 1
    tokens[n:, -1], mask[n:, -1] = 0, 1           # filler rows: one token, no budget
    budget = np.zeros((batch,), np.int32)
    budget[:n] = max_new
    width = max(1, max(len(s) for s in stops))
    stop_ids = np.full((batch, width), -1, np.int32)
    for i, s in enumerate(stops):
        stop_ids[i, :len(s)] = s
    base = jax.random.key(seed)
    keys = jax.vmap(lambda s: jax.random.fold_in(base, s))(
        jnp.asarray(seeds + [0] * (batch - n), jnp.uint32))
    compacting = compact_every is not None and batch > multiple
    end = compact_every if compacting else num_new
    args = (tokens, mask, budget, stop_ids, keys)
    temp = jnp.float32(max(temperature, 1e-6))
    with _maybe_mesh(mesh):
        if mesh is not None:
            args = tuple(_batch_on_mesh(a, mesh) for a in args)
        state = prefill_and_decode(graphdef, weights, *args, temp, jnp.int32(end),
                                    num_new=num_new, params=params)
        if compacting:
            return _compacting_decode(graphdef, weights, state, temp, params, n=n,
                                      every=compact_every, multiple=multiple)
    return _host_rows(state, {i: i for i in range(n)})


def _batch_on_mesh(x, mesh: jax.sharding.Mesh) -> jax.Array:
    """Host value `x` (the same on every process) as a global array split over the batch axes."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return jax.random.wrap_key_data(_batch_on_mesh(jax.random.key_data(x), mesh),
                                        impl=jax.random.key_impl(x))
    host = np.asarray(x)
    target = sharding.named_sharding(mesh, ("batch",), host.shape)
    return jax.make_array_from_callback(host.shape, target, lambda index: host[index])


def _maybe_mesh(mesh: jax.sharding.Mesh | None):
    return sharding.use_mesh(mesh) if mesh is not None else contextlib.nullcontext()


@dataclasses.dataclass(frozen=True)
class _Row:
    """One prompt's finished decode, on the host."""

    tokens: list[int]
    logprobs: list[float]
    reason: str
    experts: np.ndarray | None


def _host_rows(state: DecodeState, rows: dict[int, int]) -> dict[int, _Row]:
    """`{prompt index: _Row}` for `rows` = `{state row: prompt index}` (a collective)."""
    tokens, logprobs, lengths, hit_stop, prompt_lengths = sharding.fetch(
        (state.tokens, state.logprobs, state.lengths, state.hit_stop, state.prompt_lengths))
    experts = None if state.experts is None else np.asarray(sharding.fetch(state.experts))
    prompt_len = state.prompt_mask.shape[1]
    out = {}
    for i, prompt in rows.items():
        length = lengths[i]
        reason = "stop" if hit_stop[i] else "length"
        routing = None if experts is None else \
            experts[:, i, prompt_len - prompt_lengths[i]:prompt_len + length]
        out[prompt] = _Row(tokens[i, :length].tolist(), logprobs[i, :length].tolist(), reason,
                           routing)
    return out


def _assemble(rows: dict[int, _Row]) -> SampleResult:
    ordered = [rows[i] for i in range(len(rows))]
    return SampleResult(
        tokens=[r.tokens for r in ordered], logprobs=[r.logprobs for r in ordered],
        finish_reasons=[r.reason for r in ordered],
        expert_ids=None if ordered[0].experts is None else [r.experts for r in ordered])


@jax.jit
def _take_rows(state: DecodeState, index: jax.Array) -> DecodeState:
    """The decode state of rows `index` (every per-row array, the KV cache included)."""
    take = lambda x, axis=0: jnp.take(x, index, axis=axis)
    return state.replace(
        cache=tuple(KVCache(take(c.k), take(c.v)) for c in state.cache),
        next_logits=take(state.next_logits), tokens=take(state.tokens),
        logprobs=take(state.logprobs),
        experts=None if state.experts is None else take(state.experts, 1),
        lengths=take(state.lengths), done=take(state.done), hit_stop=take(state.hit_stop),
        keys=take(state.keys), prompt_mask=take(state.prompt_mask),
        prompt_lengths=take(state.prompt_lengths), max_new=take(state.max_new),
        stop_ids=take(state.stop_ids))


def _compacting_decode(graphdef, weights, state: DecodeState, temperature: jax.Array,
                       params: SamplingParams, *, n: int, every: int,
                       multiple: int) -> dict[int, _Row]:
    """Runs `state` (already decoded `every` steps) to the end, `every` steps at a time, moving
    the live rows into a smaller batch bucket whenever they fit one at most half as large."""
    owner = np.arange(state.done.shape[0])           # prompt index of each state row; -1: filler
    owner[n:] = -1
    finished: dict[int, _Row] = {}
    num_new = state.tokens.shape[1]
    while True:
        done, step = sharding.fetch((state.done, state.step))
        step = int(step)
        live = np.flatnonzero(~done)
        if len(live) == 0 or step >= num_new:
            break
        target = batch_bucket(len(live), multiple)
        if target <= len(owner) // 2:
            leaving = {int(i): int(owner[i]) for i in np.flatnonzero(done) if owner[i] >= 0}
            finished.update(_host_rows(state, leaving))
            filler = np.full(target - len(live), np.flatnonzero(done)[0])
            keep = np.concatenate([live, filler])
            state = _take_rows(state, jnp.asarray(keep, jnp.int32))
            owner = np.concatenate([owner[live], np.full(len(filler), -1)])
        state = continue_decode(graphdef, weights, state, temperature,
                                 jnp.int32(step + every), params=params)
    finished.update(_host_rows(state, {int(i): int(p) for i, p in enumerate(owner) if p >= 0}))
    return finished
