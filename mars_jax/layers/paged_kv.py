"""A layer's KV cache as page pools plus a page table per row (vLLM's layout), one pool per
shard of the rows.

Pages hold keys and values in the layouts a decode step's matmuls read (`KVCache`'s, one page
of `page` positions each): `k [shards, pages, kv_heads, head_dim, page]`, `v [shards, pages,
kv_heads, page, head_dim]`. The B rows split into `shards` equal blocks (as an array sharded
over its rows splits them), and block s's rows own pages of pool s only, so a mesh that splits
the rows over chips keeps each chip's pages on that chip. Row b's position p lives in its
pool's page `table[b, p // page]` at offset `p % page`. Page 0 of every pool is its trash page:
table entries a row does not own are 0, so writes through them land there and reads from them
are masked out by the caller's `AttentionMask`.

`view` gathers a row's pages into one contiguous `[B, K, D, n * page]` / `[B, K, n * page, D]`
cache for attention: the copy is per layer and transient, so memory holds the pools plus one
layer's view, not a `max_length` cache per row.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

# Logical axes of a pool's keys and values: pools over the rows' shards, heads split.
POOL_AXES = ("batch", None, "act_kv_heads", None, None)


def _by_shard(x: jax.Array, shards: int) -> jax.Array:
    """`[B, ...]` as `[shards, B / shards, ...]`."""
    return x.reshape(shards, x.shape[0] // shards, *x.shape[1:])


class PagedKVCache(NamedTuple):
    """One layer's page pools and the rows' page tables `[B, n]` (n pages per row visible,
    ids into the row's own pool)."""

    k: jax.Array      # [shards, pages, kv_heads, head_dim, page]
    v: jax.Array      # [shards, pages, kv_heads, page, head_dim]
    table: jax.Array  # [B, n] int32 page ids, 0 = the trash page

    @property
    def page_size(self) -> int:
        return self.k.shape[-1]

    def write(self, k: jax.Array, v: jax.Array, index: jax.Array) -> "PagedKVCache":
        """The pools with one new key and value per row (`[B, 1, K, D]`) written at position
        `index [B]` of each row; `index` must lie inside the table's `n * page` positions."""
        shards = self.k.shape[0]
        page = jnp.take_along_axis(self.table, (index // self.page_size)[:, None], axis=1)[:, 0]
        offset = index % self.page_size
        set_k = lambda pool, p, o, x: pool.at[p, :, :, o].set(x)
        set_v = lambda pool, p, o, x: pool.at[p, :, o, :].set(x)
        page, offset = _by_shard(page, shards), _by_shard(offset, shards)
        new_k = jax.vmap(set_k)(self.k, page, offset,
                                _by_shard(k[:, 0].astype(self.k.dtype), shards))
        new_v = jax.vmap(set_v)(self.v, page, offset,
                                _by_shard(v[:, 0].astype(self.v.dtype), shards))
        return self._replace(k=new_k, v=new_v)

    def view(self) -> tuple[jax.Array, jax.Array]:
        """Each row's first `n * page` positions as one contiguous cache, keys `[B, K, D, S]`
        and values `[B, K, S, D]` (`attention.KVCache`'s layouts), S = n * page."""
        rows, n = self.table.shape
        table = _by_shard(self.table, self.k.shape[0])
        gather = jax.vmap(lambda pool, ids: pool[ids])
        k = gather(self.k, table).reshape(rows, n, *self.k.shape[2:])  # [B, n, K, D, page]
        v = gather(self.v, table).reshape(rows, n, *self.v.shape[2:])  # [B, n, K, page, D]
        k = jnp.transpose(k, (0, 2, 3, 1, 4))  # [B, K, D, n, page]
        v = jnp.transpose(v, (0, 2, 1, 3, 4))  # [B, K, n, page, D]
        return (k.reshape(*k.shape[:3], n * self.page_size),
                v.reshape(rows, v.shape[1], n * self.page_size, v.shape[-1]))


def write_pages(pool_k: jax.Array, pool_v: jax.Array, k: jax.Array, v: jax.Array,
                page_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Pools with whole pages `k [n, K, D, page]` / `v [n, K, page, D]` written to pages
    `page_ids [shards, n]` of every pool (a pool the pages do not belong to gets ids 0: its
    trash page), each pool updated on its own shard."""
    put = jax.vmap(lambda pool, ids, pages: pool.at[ids].set(pages), in_axes=(0, 0, None))
    return (put(pool_k, page_ids, k.astype(pool_k.dtype)),
            put(pool_v, page_ids, v.astype(pool_v.dtype)))
