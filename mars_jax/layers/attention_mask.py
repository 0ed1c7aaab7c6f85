"""Which keys each query may see, described without a `[batch, queries, keys]` array.

Query `t` sits at key slot `t + offset` and sees slot `s` iff `s <= t + offset` and both carry the
same segment id (0: padding, empty cache slots); blockwise kernels read it block by block.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class AttentionMask:
    """Causal-with-offset, segment-matched visibility (see the module docstring)."""

    q_segments: jax.Array   # [B, T] int32, >= 1 for real queries
    kv_segments: jax.Array  # [B, S] int32, 0 for padding / empty cache slots
    offset: jax.Array       # () int32: key slot of query 0

    @classmethod
    def causal(cls, mask: jax.Array, *, num_extra_keys: int = 0) -> "AttentionMask":
        """Causal attention over a `[B, T]` 0/1 padding mask (left or right padding); with
        `num_extra_keys`, that many cache slots follow the sequence (visible once written)."""
        return cls(q_segments=jnp.ones(mask.shape, jnp.int32),
                   kv_segments=_cache_segments(mask, num_extra_keys),
                   offset=jnp.zeros((), jnp.int32))

    @classmethod
    def decode_step(cls, prompt_mask: jax.Array, num_new: int, slot: jax.Array | int
                    ) -> "AttentionMask":
        """One new query per row, written at cache slot `slot` of a cache holding the `[B, P]`
        left-padded prompt followed by `num_new` generated slots."""
        return cls(q_segments=jnp.ones((prompt_mask.shape[0], 1), jnp.int32),
                   kv_segments=_cache_segments(prompt_mask, num_new),
                   offset=jnp.asarray(slot, jnp.int32))

    @classmethod
    def filled(cls, visible: jax.Array, length: int) -> "AttentionMask":
        """One new query per row that sees the first `visible[b]` of `length` cache slots (its
        own, just written, included): the engine's slots, each at its own position."""
        kv = (jnp.arange(length)[None, :] < visible[:, None]).astype(jnp.int32)
        return cls(q_segments=jnp.ones((visible.shape[0], 1), jnp.int32), kv_segments=kv,
                   offset=jnp.asarray(length - 1, jnp.int32))

    @classmethod
    def packed(cls, segments: jax.Array) -> "AttentionMask":
        """Causal attention within each packed example: `segments [B, T]`, 0 for padding."""
        segments = segments.astype(jnp.int32)
        return cls(q_segments=segments, kv_segments=segments, offset=jnp.zeros((), jnp.int32))

    def first_keys(self, count: int) -> "AttentionMask":
        """The same visibility over key slots `0..count` only."""
        if self.kv_segments.shape[1] == count:
            return self
        return self.replace(kv_segments=self.kv_segments[:, :count])

    def dense(self) -> jax.Array:
        """The `[B, T, S]` boolean array these vectors describe (for the reference kernel)."""
        t, s = self.q_segments.shape[1], self.kv_segments.shape[1]
        causal = jnp.arange(s)[None, :] <= jnp.arange(t)[:, None] + self.offset
        same = self.q_segments[:, :, None] == self.kv_segments[:, None, :]
        return causal[None] & same


def _cache_segments(mask: jax.Array, num_extra_keys: int) -> jax.Array:
    kv = mask.astype(jnp.int32)
    return jnp.pad(kv, ((0, 0), (0, num_extra_keys)), constant_values=1) if num_extra_keys else kv
