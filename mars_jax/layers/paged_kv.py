"""The KV cache as page pools plus a page table per row (vLLM's layout), and attention over it.

Pools `[shards, kv_heads, pages, page, head_dim]` (the Pallas kernels' layout) hold every layer's
pages, layer l's in the l-th block; block s of the rows owns pages of pool s only, so each chip's
pages stay on it. Page 0 of each block is a trash page for entries a row does not own. `attend` runs
`kernel`: 'gather' (XLA, pages copied per layer), 'gpu' / 'tpu' (Pallas) or 'interpret'.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import PartitionSpec

from mars_jax import sharding

# Logical axes of a pool's keys and values: pools over the rows' shards, heads split.
POOL_AXES = ("batch", "act_kv_heads", None, None, None)
KERNELS = ("gather", "gpu", "tpu", "interpret")


def _by_shard(x: jax.Array, shards: int) -> jax.Array:
    """`[B, ...]` as `[shards, B / shards, ...]`."""
    return x.reshape(shards, x.shape[0] // shards, *x.shape[1:])


def _largest_divisor(n: int, at_most: int) -> int:
    return max(d for d in range(1, min(n, at_most) + 1) if n % d == 0)


@struct.dataclass
class PagedKVCache:
    """Page pools and the rows' page tables `[B, n]` of layer `layer`, the ids offset to that
    layer's block (`layer_table`), so reads and writes address the pools in place."""

    k: jax.Array      # [shards, kv_heads, pages, page, head_dim]
    v: jax.Array      # [shards, kv_heads, pages, page, head_dim]
    table: jax.Array  # [B, n] int32 page ids in a layer's block, 0 = its trash page
    kernel: str = struct.field(pytree_node=False, default="gather")
    layer: jax.Array | int = 0
    layers: int = struct.field(pytree_node=False, default=1)

    @property
    def page_size(self) -> int:
        return self.k.shape[3]

    @property
    def layer_table(self) -> jax.Array:
        """The table as ids into the whole pool: layer `layer`'s block."""
        return self.table + self.layer * (self.k.shape[2] // self.layers)

    def write(self, k: jax.Array, v: jax.Array, index: jax.Array) -> "PagedKVCache":
        """The pools with one new key and value per row (`[B, 1, K, D]`) written at position
        `index [B]` of each row; `index` must lie inside the table's `n * page` positions."""
        shards = self.k.shape[0]
        page = jnp.take_along_axis(self.layer_table, (index // self.page_size)[:, None],
                                   axis=1)[:, 0]
        offset = index % self.page_size
        if self.kernel == "tpu":
            # One [D] vector per (row, head): a scatter whose window is the minor dimension
            # alone, which XLA:TPU lays out as the Pallas kernel reads the pool (row-major), so
            # the pool carried through the layers is updated in place, never re-laid out for
            # the kernel (a [K, D] window made it pick another layout: a copy at every layer).
            heads = jnp.arange(self.k.shape[1])[None, :]
            put = jax.vmap(lambda pool, p, o, x: pool.at[heads, p[:, None], o[:, None], :].set(
                x, unique_indices=True, mode="promise_in_bounds"))
        else:  # pool [K, pages, page, D].at[:, p, o] indexes [K, rows, D]: rows in the middle
            put = jax.vmap(lambda pool, p, o, x: pool.at[:, p, o, :].set(jnp.swapaxes(x, 0, 1)))
        page, offset = _by_shard(page, shards), _by_shard(offset, shards)
        return self.replace(
            k=put(self.k, page, offset, _by_shard(k[:, 0].astype(self.k.dtype), shards)),
            v=put(self.v, page, offset, _by_shard(v[:, 0].astype(self.v.dtype), shards)))

    def view(self) -> tuple[jax.Array, jax.Array]:
        """Each row's first `n * page` positions as one contiguous cache in `attention.KVCache`'s
        layouts."""
        rows, n = self.table.shape
        shards, heads, _, page, dim = self.k.shape
        gather = jax.vmap(lambda pool, ids: pool[:, ids])  # [S, K, B / S, n, page, D]
        to_rows = lambda x: jnp.swapaxes(x, 1, 2).reshape(rows, heads, n * page, dim)
        table = _by_shard(self.layer_table, shards)
        values = to_rows(gather(self.v, table))
        keys = jnp.swapaxes(to_rows(gather(self.k, table)), 2, 3)
        return keys, values

    def attend(self, q: jax.Array, lengths: jax.Array, scale: float) -> jax.Array:
        """softmax(q k^T * scale) v for one query per row, `q [B, 1, N, D]`, over each row's
        first `lengths [B]` positions; `[B, 1, N, D]`."""
        rows, n = self.table.shape
        shards = self.k.shape[0]
        q = (q[:, 0] * scale).astype(self.k.dtype)
        if self.kernel == "tpu":
            from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention
            attend = lambda q, k, v, t, l: paged_attention(
                q, k, v, l, t, pages_per_compute_block=_largest_divisor(n, 8))
        else:
            from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention
            attend = functools.partial(
                paged_attention, k_splits=_largest_divisor(n, 16), pages_per_compute_block=
                _largest_divisor(n // _largest_divisor(n, 16), 8),
                interpret=self.kernel == "interpret")
        run = jax.vmap(attend)
        args = (_by_shard(q, shards), self.k, self.v, _by_shard(self.layer_table, shards),
                _by_shard(lengths.astype(jnp.int32), shards))
        mesh = jax.sharding.get_abstract_mesh()
        if not mesh.empty:  # a Pallas kernel is not partitioned by XLA: each chip runs its part
            pool = sharding.fitted_spec(POOL_AXES, self.k.shape, mesh)
            pools, heads = pool[0], pool[1]  # q's heads split as the pools' KV heads
            rows_of = lambda *rest: PartitionSpec(pools, *rest)
            run = jax.shard_map(run, mesh=mesh, in_specs=(rows_of(None, heads, None), pool, pool,
                                                          rows_of(None, None), rows_of(None)),
                                out_specs=rows_of(None, heads, None), check_vma=False)
        out = run(*args)
        return out.reshape(rows, 1, *out.shape[2:])


def write_pages(pool_k: jax.Array, pool_v: jax.Array, k: jax.Array, v: jax.Array,
                page_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Pools with whole pages `[K, n, page, D]` written to pages `page_ids [shards, n]` (ids 0,
    the trash page, in pools they do not belong to), each pool on its own shard."""
    put = jax.vmap(lambda pool, ids, pages: pool.at[:, ids].set(pages), in_axes=(0, 0, None))
    return (put(pool_k, page_ids, k.astype(pool_k.dtype)),
            put(pool_v, page_ids, v.astype(pool_v.dtype)))


def default_kernel(head_dim: int, page_size: int, platform: str | None = None) -> str:
    """The Pallas kernel of `platform` (default: the default backend's) where the shapes suit it
    (TPU: head_dim a multiple of 128, page size a multiple of 8; GPU: both multiples of 16), else
    'gather'."""
    platform = platform or jax.default_backend()
    if platform == "tpu" and head_dim % 128 == 0 and page_size % 8 == 0:
        return "tpu"
    if platform in ("gpu", "cuda") and head_dim % 16 == 0 and page_size % 16 == 0:
        return "gpu"
    return "gather"
