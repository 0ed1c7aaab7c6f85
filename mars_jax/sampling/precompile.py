"""Compiling an `Engine`'s programs ahead of serving, on a thread pool (XLA compiles without the
GIL; each compile holds its own memory).

Serving compiles a program when it first meets its shapes: a decode chunk per (slot bucket, KV
span), a prefill per (prompt bucket, piece, batch bucket), a slot insert per (prompt bucket, batch
bucket), the gathers between slot buckets and, paged, a preempted row's deactivation per slot
bucket. `compile_ahead` lowers each of them with the arguments serving passes (made inside or
outside the engine's mesh as serving makes them, so that the compiled programs are the ones
serving looks up); a program whose input is another's output is lowered on the shapes and
shardings the first one returns.
"""
from __future__ import annotations

import concurrent.futures
import functools
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from mars_jax.sampling.engine_programs import (SlotState, _deactivate, _decode_chunk, _insert,
                                               _prefill, _put_slots, _take_slots, span_bucket)
from mars_jax.sampling.sampler import prompt_bucket
from mars_jax.sampling.scheduler import slot_buckets

if TYPE_CHECKING:
    from mars_jax.sampling.engine import Engine


def compile_ahead(engine: Engine, prompt_lengths: Sequence[int], *, threads: int | None = None
                  ) -> int:
    """Compiles, `threads` at a time (default: one per host CPU, at most 16), the programs
    `engine` reaches serving requests whose prompts (for a recomputed request, prompt + tokens
    so far) have `prompt_lengths` tokens (module docstring); returns how many."""
    full = engine._state if engine._full is None else engine._full
    buckets = slot_buckets(engine.num_slots, pools=engine._pools(), shards=engine._multiple)
    committed = engine._committed()
    threads = threads or min(16, os.cpu_count() or 1)
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        run = lambda jobs: list(pool.map(lambda job: job(), jobs))
        smaller = buckets[1:]
        states = dict(zip(smaller, run([functools.partial(_compile_take, full, rows, committed)
                                        for rows in smaller])))
        states[engine.num_slots] = full
        jobs = [functools.partial(_compile_take, states[a], b, committed)
                for a in smaller for b in smaller if b <= a // 2]
        index = {b: jnp.zeros((b,), jnp.int32) for b in smaller}
        jobs += [functools.partial(_compile, _put_slots, full, states[b], index[b], index[b],
                                   jnp.int32(0)) for b in smaller]
        if engine._pool is not None:
            jobs += [functools.partial(_compile, _deactivate, states[b], jnp.int32(0))
                     for b in buckets]
        jobs += [functools.partial(_compile_decode, engine, states[b], span)
                 for b in buckets for span in _spans(engine)]
        shapes = [(bucket, rows)
                  for bucket in sorted({prompt_bucket(n) for n in prompt_lengths})
                  for rows in _prefill_rows(engine)]
        count = len(smaller) + len(jobs)
        firsts = run([functools.partial(_compile_prefill, engine, None, b, r, min(
            b, engine.prefill_chunk)) for b, r in shapes] + jobs)[:len(shapes)]
        later = [(first, bucket, rows, width) for (bucket, rows), first in zip(shapes, firsts)
                 for width in _later_pieces(bucket, engine.prefill_chunk)]
        run([functools.partial(_compile_prefill, engine, *piece) for piece in later])
        run([functools.partial(_compile_insert, engine, full, first) for first in firsts])
    return count + 2 * len(shapes) + len(later)


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


def _spans(engine: Engine) -> list[int]:
    """Every KV span `Engine._span` can give a decode chunk."""
    spans, needed = set(), 1
    while needed <= engine.max_length:
        spans.add(engine._chunk_span(needed))
        needed = span_bucket(needed, engine.max_length, engine.min_span) + 1
    return sorted(spans)


def _prefill_rows(engine: Engine) -> list[int]:
    """Batch buckets of a prefill: powers of two up to the slots (or `prefill_ahead`)."""
    most = max(engine.num_slots, engine.prefill_ahead)
    return [1 << k for k in range((most - 1).bit_length() + 1)]


def _later_pieces(bucket: int, prefill_chunk: int) -> set[int]:
    """Widths of the prefill pieces after the first of a prompt bucket (`Engine._prefill`)."""
    piece = min(bucket, prefill_chunk)
    return {min(piece, bucket - start) for start in range(piece, bucket, piece)}


def _compile_take(state: SlotState, rows: int, committed: bool) -> SlotState:
    """Compiles the gather of `rows` rows from `state`; returns its output's shapes."""
    lowered = _take_slots.lower(state, jnp.zeros((rows,), jnp.int32), jnp.zeros((rows,), bool))
    return _abstract_outputs(lowered, committed)


def _compile_decode(engine: Engine, state: SlotState, span: int) -> None:
    table = None
    if engine._pool is not None:
        table = jnp.zeros((state.length.shape[0], span // engine.page_size), jnp.int32)
    with engine._mesh():
        _decode_chunk.lower(engine._graphdef, engine._weights, state, engine._pool, table,
                            jnp.int32(0), steps=engine.chunk_steps, span=span,
                            kernel=engine.paged_attention).compile()


def _compile_prefill(engine: Engine, previous: tuple | None, bucket: int, rows: int, width: int
                     ) -> tuple:
    """Compiles a prefill piece `width` tokens wide of a `[rows, bucket]` batch, the first
    (`previous` None) or a later one (`previous`: the first's outputs, shaped as every
    piece's); returns its outputs' shapes."""
    cache, logits, experts = previous or (None, None, None)
    with engine._mesh():
        return _abstract_outputs(_prefill.lower(
            engine._graphdef, engine._weights, cache, logits, experts,
            jnp.zeros((rows, width), jnp.int32), jnp.int32(0),
            jnp.zeros((rows,), jnp.int32), bucket=bucket, fresh=previous is None),
            engine._committed())


def _compile_insert(engine: Engine, full: SlotState, prefilled: tuple) -> None:
    cache, logits, experts = prefilled
    page_ids = None
    if engine._pool is not None:
        page_ids = jnp.zeros((engine._multiple, engine._pages.pages_for(cache.v.shape[3])),
                             jnp.int32)
    with engine._mesh():
        i32, f32, u32 = jnp.int32(0), jnp.float32(0), jnp.uint32(0)
        _insert.lower(full, engine._pool, page_ids, i32, cache, logits, experts, i32, i32, i32,
                      i32, u32, u32, f32, i32, f32,
                      jnp.zeros((engine.max_stop_ids,), jnp.int32)).compile()
