"""What the engine's KV cache takes and what device memory holds beside it, and how many prompts one
prefill may take at once (`prefill_parts`). Arithmetic only; the engine decides with it.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from mars_jax.buckets import pow2_at_least
from mars_jax.sampling.batch_memory import device_free_bytes, kv_bytes_per_token  # noqa: F401 (the engine's)
from mars_jax.sampling.sampler import prompt_bucket


def bytes_per_row(tree: Any, rows: int) -> float:
    """Bytes one of the `rows` rows of `tree`'s arrays takes on the fullest device."""
    return sum(max(shard.data.nbytes for shard in leaf.addressable_shards)
               for leaf in jax.tree.leaves(tree)) / rows


def prefill_parts(lengths: Sequence[int], *, free: int | None, devices: int,
                  bytes_per_token: int) -> list[list[int]]:
    """Indices of sequences of `lengths` in parts, longest first: a part grows while its prompt
    cache, spread over `devices`, takes at most half of `free` (None: one part); at least one
    sequence each."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    if free is None:
        return [order] if order else []
    parts: list[list[int]] = []
    for i in order:
        part = parts[-1] if parts else None
        if part and (pow2_at_least(len(part) + 1, 1) * prompt_bucket(lengths[part[0]])
                     * bytes_per_token / devices <= free / 2):
            part.append(i)
        else:
            parts.append([i])
    return parts
