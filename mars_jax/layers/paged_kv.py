"""A layer's KV cache as a pool of fixed-size pages plus a page table per row (vLLM's layout).

Pages hold keys and values in the layouts a decode step's matmuls read (`KVCache`'s, one page
of `page` positions each): `k [pages, kv_heads, head_dim, page]`, `v [pages, kv_heads, page,
head_dim]`. Row b's position p lives in page `table[b, p // page]` at offset `p % page`. Page 0
is the trash page: table entries a row does not own are 0, so writes through them land there and
reads from them are masked out by the caller's `AttentionMask`.

`view` gathers a row's pages into one contiguous `[B, K, D, n * page]` / `[B, K, n * page, D]`
cache for attention: the copy is per layer and transient, so memory holds the pool plus one
layer's view, not a `max_length` cache per row.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class PagedKVCache(NamedTuple):
    """One layer's page pool and the rows' page tables `[B, n]` (n pages per row visible)."""

    k: jax.Array      # [pages, kv_heads, head_dim, page]
    v: jax.Array      # [pages, kv_heads, page, head_dim]
    table: jax.Array  # [B, n] int32 page ids, 0 = the trash page

    @property
    def page_size(self) -> int:
        return self.k.shape[-1]

    def write(self, k: jax.Array, v: jax.Array, index: jax.Array) -> "PagedKVCache":
        """The pool with one new key and value per row (`[B, 1, K, D]`) written at position
        `index [B]` of each row; `index` must lie inside the table's `n * page` positions."""
        page = jnp.take_along_axis(self.table, (index // self.page_size)[:, None], axis=1)[:, 0]
        offset = index % self.page_size
        new_k = self.k.at[page, :, :, offset].set(k[:, 0].astype(self.k.dtype))
        new_v = self.v.at[page, :, offset, :].set(v[:, 0].astype(self.v.dtype))
        return self._replace(k=new_k, v=new_v)

    def view(self) -> tuple[jax.Array, jax.Array]:
        """Each row's first `n * page` positions as one contiguous cache, keys `[B, K, D, S]`
        and values `[B, K, S, D]` (`attention.KVCache`'s layouts), S = n * page."""
        rows, n = self.table.shape
        k = jnp.transpose(self.k[self.table], (0, 2, 3, 1, 4))  # [B, K, D, n, page]
        v = jnp.transpose(self.v[self.table], (0, 2, 1, 3, 4))  # [B, K, n, page, D]
        return (k.reshape(*k.shape[:3], n * self.page_size),
                v.reshape(rows, v.shape[1], n * self.page_size, v.shape[-1]))


POOL_AXES = (None, "act_kv_heads", None, None)  # logical axes of a pool's keys and values
