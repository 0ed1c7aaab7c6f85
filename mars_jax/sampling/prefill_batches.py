"""The engine's batched prefills: token sequences right-padded to their prompt bucket, batched by
bucket (rows a power of two), each batch prefilled by `engine_programs.prefill` in
`prefill_chunk`-token pieces."""
from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from mars_jax.buckets import pow2_at_least
from mars_jax.sampling import engine_programs as programs
from mars_jax.sampling.sampler import prompt_bucket

# A prefilled sequence: its batch's prompt cache, logits and routing, and its row in them.
Prefilled = tuple


def prefill_batches(graphdef, weights, sequences: list[list[int]], *, prefill_chunk: int,
                    mesh_context: Callable[[], contextlib.AbstractContextManager],
                    stats: collections.Counter) -> list[Prefilled]:
    """Per sequence: (prompt cache, logits, routing, row) of one prefill call per prompt bucket,
    run inside `mesh_context()`; counts `prefills`, `prefill_calls`, `prefill_tokens` and
    `prefill_seconds` in `stats`."""
    if not sequences:
        return []
    start_time = time.perf_counter()
    by_bucket: dict[int, list[int]] = {}
    for i, seq in enumerate(sequences):
        by_bucket.setdefault(prompt_bucket(len(seq)), []).append(i)
    out: list[Prefilled | None] = [None] * len(sequences)
    for bucket, members in by_bucket.items():
        rows = pow2_at_least(len(members), 1)
        padded = np.zeros((rows, bucket), np.int32)
        last = np.zeros((rows,), np.int32)
        for row, i in enumerate(members):
            padded[row, :len(sequences[i])] = sequences[i]
            last[row] = len(sequences[i]) - 1
        piece = min(bucket, prefill_chunk)
        cache = logits = experts = None
        with mesh_context():
            for start in range(0, int(last.max()) + 1, piece):
                cache, logits, experts = programs.prefill(
                    graphdef, weights, cache, logits, experts,
                    jnp.asarray(padded[:, start:start + piece]), jnp.int32(start),
                    jnp.asarray(last), bucket=bucket, fresh=start == 0)
        for row, i in enumerate(members):
            out[i] = (cache, logits, experts, row)
        stats["prefills"] += len(members)
        stats["prefill_calls"] += 1
        stats["prefill_tokens"] += sum(len(sequences[i]) for i in members)
    jax.block_until_ready(out[-1][1])
    stats["prefill_seconds"] += time.perf_counter() - start_time
    return out
