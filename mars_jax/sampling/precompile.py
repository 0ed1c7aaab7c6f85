"""Compiling an `Engine`'s programs ahead of serving on a thread pool, each lowered as serving calls
it (`program_plan`), so serving finds them compiled.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import os
from collections.abc import Sequence
from typing import Any

import jax

from mars_jax.sampling import program_plan as plan
from mars_jax.sampling.engine import Engine
from mars_jax.sampling.engine_programs import span_bucket
from mars_jax.sampling.sampler import prompt_bucket

ARGS = plan.ServingArgs()


def compile_ahead(engine: Engine, prompt_lengths: Sequence[int], *, threads: int | None = None
                  ) -> int:
    """Compiles, `threads` at a time, the programs `engine` reaches serving prompts of
    `prompt_lengths` tokens; returns how many."""
    prompt_lengths = list(prompt_lengths)
    if any(n < 1 or n > engine.max_length for n in prompt_lengths):
        raise ValueError(f"prompt_lengths: each must be in [1, max_length={engine.max_length}]")
    full, buckets = engine.full_state, engine.slot_buckets()
    threads = threads or min(16, os.cpu_count() or 1)
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        run = lambda jobs: list(pool.map(lambda job: job(), jobs))
        compile_ = lambda *a, **k: functools.partial(_compile, engine, *a, **k)
        outputs = lambda *a, **k: functools.partial(_outputs, engine, *a, **k)
        smaller = buckets[1:]
        states = dict(zip(smaller, run([outputs(plan.take_slots, full, rows)
                                        for rows in smaller])))
        states[engine.num_slots] = full
        jobs = [outputs(plan.take_slots, states[a], b) for a in smaller for b in smaller
                if b <= a // 2]
        jobs += [compile_(plan.put_slots, full, states[b]) for b in smaller]
        if engine.pool is not None:
            jobs += [compile_(plan.deactivate, states[b]) for b in buckets]
        jobs += [compile_(plan.decode_chunk, engine.graphdef, engine.weights, states[b],
                          engine.pool, steps=engine.chunk_steps, span=span,
                          kernel=engine.paged_attention, page_size=engine.page_size)
                 for b in buckets for span in _spans(engine)]
        shapes = [(bucket, rows)
                  for bucket in sorted({prompt_bucket(n) for n in prompt_lengths})
                  for rows in _prefill_rows(engine)]
        count = len(smaller) + len(jobs)
        prefill = lambda previous, bucket, rows, width: outputs(
            plan.prefill, engine.graphdef, engine.weights, previous, rows=rows, bucket=bucket,
            width=width)
        firsts = run([prefill(None, b, r, min(b, engine.prefill_chunk)) for b, r in shapes]
                     + jobs)[:len(shapes)]
        later = [(first, bucket, rows, width) for (bucket, rows), first in zip(shapes, firsts)
                 for width in _later_pieces(bucket, engine.prefill_chunk)]
        run([prefill(*piece) for piece in later])
        run([compile_(plan.insert, full, engine.pool, first,
                      pages=engine.pages_for(first[0].v.shape[3]), shards=engine.batch_shards,
                      max_stop_ids=engine.max_stop_ids) for first in firsts])
    return count + 2 * len(shapes) + len(later)


def _lower(engine: Engine, build, *args, **kwargs) -> jax.stages.Lowered:
    """The program `build(ServingArgs, *args, **kwargs)` (`program_plan`) lowered, its arguments
    made inside the engine's mesh where serving makes them there."""
    inside = build.__name__ in plan.IN_MESH
    with engine.mesh_context() if inside else contextlib.nullcontext():
        return build(ARGS, *args, **kwargs).lower()


def _compile(engine: Engine, build, *args, **kwargs) -> None:
    _lower(engine, build, *args, **kwargs).compile()


def _outputs(engine: Engine, build, *args, **kwargs) -> Any:
    """Compiles a program (as `_lower`); returns its outputs as arguments of a later lowering:
    shapes, dtypes and, for committed arrays, shardings."""
    lowered = _lower(engine, build, *args, **kwargs)
    compiled, committed = lowered.compile(), engine.committed
    return jax.tree.map(lambda out, where: jax.ShapeDtypeStruct(
        out.shape, out.dtype, sharding=where if committed else None, weak_type=out.weak_type),
        lowered.out_info, compiled.output_shardings)


def _spans(engine: Engine) -> list[int]:
    """Every KV span `Engine` can give a decode chunk."""
    spans, needed = set(), 1
    while needed <= engine.max_length:
        spans.add(engine.chunk_span(needed))
        needed = span_bucket(needed, engine.max_length, engine.min_span) + 1
    return sorted(spans)


def _prefill_rows(engine: Engine) -> list[int]:
    """Batch buckets of a prefill: powers of two up to the slots (or `prefill_ahead`)."""
    most = max(engine.num_slots, engine.prefill_ahead)
    return [1 << k for k in range((most - 1).bit_length() + 1)]


def _later_pieces(bucket: int, prefill_chunk: int) -> set[int]:
    """Widths of the prefill pieces after the first of a prompt bucket (`prefill.prefill`)."""
    piece = min(bucket, prefill_chunk)
    return {min(piece, bucket - start) for start in range(piece, bucket, piece)}
