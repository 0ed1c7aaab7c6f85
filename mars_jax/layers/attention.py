"""Grouped-query attention with per-head q/k RMSNorm, RoPE and an optional KV cache.

`dot_product_attention` forms all scores at once; `flash_attention` works blockwise in memory linear
in the length. `impl='auto'` picks flash only when the dense scores would exceed
`AUTO_DENSE_MAX_SCORE_BYTES` (where they fit, dense is faster); one-query decode steps always run
dense, reading the cache in its own layouts. Self-attention and fresh prefills split the queries
into `causal_blocks`, so scores above the causal diagonal's blocks are never formed.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx, struct

from mars_jax import sharding
from mars_jax.layers.attention_mask import AttentionMask
from mars_jax.layers.embeddings import apply_rope
from mars_jax.layers.flash_attention import MASK_VALUE, flash_attention
from mars_jax.layers.normalization import RMSNorm
from mars_jax.layers.paged_kv import PagedKVCache
from mars_jax.layers.params import constant_param, normal_param

class KVCache(NamedTuple):
    """One layer's cache as a decode step's matmuls read it: `k [B, K, D, S]`, `v [B, K, S, D]`."""

    k: jax.Array
    v: jax.Array


def cache_layout(batch: int, length: int, kv_heads: int, head_dim: int) -> KVCache:
    """One layer's cache as (shape, logical axes) of its keys and of its values (see `KVCache`)."""
    return KVCache(
        k=((batch, kv_heads, head_dim, length), ("batch", "act_kv_heads", None, "cache_length")),
        v=((batch, kv_heads, length, head_dim), ("batch", "act_kv_heads", "cache_length", None)))


def stacked_cache_layout(layers: int, batch: int, length: int, kv_heads: int, head_dim: int
                         ) -> KVCache:
    """`cache_layout` of a cache stacked over `layers` (a leading layer axis, unsharded)."""
    return KVCache(*(((layers,) + shape, (None,) + names)
                     for shape, names in cache_layout(batch, length, kv_heads, head_dim)))


@struct.dataclass
class LayerKVCache:
    """Layer `layer` of a cache stacked over layers, read and written in place."""

    k: jax.Array
    v: jax.Array
    layer: jax.Array | int = 0

    def read(self, keys: int) -> tuple[jax.Array, jax.Array]:
        """The layer's first `keys` positions: keys `[B, K, D, keys]`, values `[B, K, keys, D]`."""
        _, b, heads, d, _ = self.k.shape
        k = jax.lax.dynamic_slice(self.k, (self.layer, 0, 0, 0, 0), (1, b, heads, d, keys))
        v = jax.lax.dynamic_slice(self.v, (self.layer, 0, 0, 0, 0), (1, b, heads, keys, d))
        return k[0], v[0]

    def write(self, k: jax.Array, v: jax.Array, index: jax.Array | int) -> "LayerKVCache":
        """New keys and values `[B, T, K, D]` written at `index` (one position, or one per row)."""
        at = self.layer
        if jnp.ndim(index) == 1:  # one scatter into the stacks (no transposed copy of them)
            rows = jnp.arange(k.shape[0])[:, None]
            where = index[:, None] + jnp.arange(k.shape[1])  # [B, T]
            put = dict(unique_indices=True, mode="promise_in_bounds")
            return self.replace(  # both index [B, T, K, D] (numpy's advanced-index order)
                k=self.k.at[at, rows, :, :, where].set(k.astype(self.k.dtype), **put),
                v=self.v.at[at, rows, :, where, :].set(v.astype(self.v.dtype), **put))
        k, v = _to_cache_layout(k, v)
        k, v = k.astype(self.k.dtype), v.astype(self.v.dtype)
        return self.replace(
            k=jax.lax.dynamic_update_slice(self.k, k[None], (at, 0, 0, 0, index)),
            v=jax.lax.dynamic_update_slice(self.v, v[None], (at, 0, 0, index, 0)))


def _to_cache_layout(k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Keys and values `[B, S, K, D]` in the cache's layouts `[B, K, D, S]` and `[B, K, S, D]`."""
    return jnp.transpose(k, (0, 2, 3, 1)), jnp.swapaxes(v, 1, 2)


def _is_fresh_prefill(cache_index) -> bool:
    """Whether keys are written at a static position 0. Its callers' masks then have offset 0
    (query t at key slot t), so every cache slot after the queries' own is invisible to them."""
    return isinstance(cache_index, int) and cache_index == 0


def _write_cache(cache: KVCache, k: jax.Array, v: jax.Array, index: jax.Array | int) -> KVCache:
    """`cache` with new keys and values `[B, T, K, D]` written at positions index.. index+T;
    `index` is one position for every row, or one per row (`[B]`, the engine's slots)."""
    k, v = _to_cache_layout(k, v)
    k, v = k.astype(cache.k.dtype), v.astype(cache.v.dtype)
    if jnp.ndim(index) == 1:
        row_k = lambda c, x, i: jax.lax.dynamic_update_slice(c, x, (0, 0, i))
        row_v = lambda c, x, i: jax.lax.dynamic_update_slice(c, x, (0, i, 0))
        return KVCache(jax.vmap(row_k)(cache.k, k, index), jax.vmap(row_v)(cache.v, v, index))
    return KVCache(jax.lax.dynamic_update_slice(cache.k, k, (0, 0, 0, index)),
                   jax.lax.dynamic_update_slice(cache.v, v, (0, 0, index, 0)))


MAX_CAUSAL_BLOCKS, MIN_CAUSAL_BLOCK = 4, 64
# float32 scores of one call, [B, heads, T, S]; a backward keeps every layer's unless `remat`.
AUTO_DENSE_MAX_SCORE_BYTES = 1 << 29


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: AttentionMask,
                          scale: float) -> jax.Array:
    """softmax(q k^T * scale) v with GQA. q `[B,T,N,D]`, k/v `[B,S,K,D]`. Masked scores get a
    finite `MASK_VALUE`, so a query with no visible key (left padding) averages instead of NaN."""
    return _cached_attention(q, *_to_cache_layout(k, v), mask, scale)


def causal_blocks(length: int) -> int:
    """How many query blocks `self_attention` splits `length` queries into: the most, up to
    `MAX_CAUSAL_BLOCKS`, that divide it into blocks of at least `MIN_CAUSAL_BLOCK`."""
    return next((n for n in range(MAX_CAUSAL_BLOCKS, 1, -1)
                 if length % n == 0 and length // n >= MIN_CAUSAL_BLOCK), 1)


def self_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: AttentionMask,
                   scale: float) -> jax.Array:
    """`dot_product_attention` of a sequence over itself, by `causal_blocks(T)` query blocks."""
    length = q.shape[1]
    blocks = causal_blocks(length)
    size = length // blocks
    outs = []
    for i in range(blocks):
        end = (i + 1) * size
        part = AttentionMask(q_segments=mask.q_segments[:, i * size:end],
                             kv_segments=mask.kv_segments[:, :end], offset=mask.offset + i * size)
        outs.append(dot_product_attention(q[:, i * size:end], k[:, :end], v[:, :end], part, scale))
    return outs[0] if blocks == 1 else jnp.concatenate(outs, axis=1)


def _cached_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: AttentionMask,
                      scale: float) -> jax.Array:
    """`dot_product_attention` on keys and values in the cache's layouts (`KVCache`). Both
    matmuls are plain [rows, D] x [D, S] and [rows, S] x [S, D] products batched over (B, K)."""
    allowed = mask.dense()
    b, t, n, d = q.shape
    kv_heads, groups = k.shape[1], n // k.shape[1]
    q = jnp.transpose(q.reshape(b, t, kv_heads, groups, d), (0, 2, 3, 1, 4))  # [B, K, G, T, D]
    scores = jnp.einsum("bkgtd,bkds->bkgts", q, k, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(allowed[:, None, None, :, :], scores, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bksd->bkgtd", probs, v)
    return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, t, n, d)


class Attention(nnx.Module):
    """Qwen3 self-attention: q/k/v projections, q/k RMSNorm per head, RoPE, GQA, output projection."""

    def __init__(self, *, hidden: int, heads: int, kv_heads: int, head_dim: int, bias: bool,
                 eps: float, rngs: nnx.Rngs, param_dtype: jnp.dtype, stddev: float,
                 impl: str = "auto", block: int = 512):
        self.head_dim = head_dim
        self.impl, self.block = impl, block
        self.q_proj = normal_param(rngs, (hidden, heads, head_dim), ("embed", "heads", "head_dim"),
                                   param_dtype, stddev)
        self.k_proj = normal_param(rngs, (hidden, kv_heads, head_dim),
                                   ("embed", "kv_heads", "head_dim"), param_dtype, stddev)
        self.v_proj = normal_param(rngs, (hidden, kv_heads, head_dim),
                                   ("embed", "kv_heads", "head_dim"), param_dtype, stddev)
        self.o_proj = normal_param(rngs, (heads, head_dim, hidden), ("heads", "head_dim", "embed"),
                                   param_dtype, stddev)
        if bias:
            self.q_bias = constant_param((heads, head_dim), ("heads", "head_dim"), param_dtype, 0.0)
            self.k_bias = constant_param((kv_heads, head_dim), ("kv_heads", "head_dim"), param_dtype, 0.0)
            self.v_bias = constant_param((kv_heads, head_dim), ("kv_heads", "head_dim"), param_dtype, 0.0)
            self.o_bias = constant_param((hidden,), ("embed",), param_dtype, 0.0)
        self.bias = bias
        self.q_norm = RMSNorm(head_dim, eps=eps, param_dtype=param_dtype)
        self.k_norm = RMSNorm(head_dim, eps=eps, param_dtype=param_dtype)

    def _project(self, x: jax.Array, name: str) -> jax.Array:
        y = jnp.einsum("bth,hnd->btnd", x, getattr(self, f"{name}_proj")[...].astype(x.dtype))
        if self.bias:
            y = y + getattr(self, f"{name}_bias")[...].astype(x.dtype)
        return y

    def _use_flash(self, q: jax.Array, keys: int) -> bool:
        """Whether `impl` runs the blockwise kernel for queries `q` over `keys` keys."""
        batch, length, heads, _ = q.shape
        if self.impl != "auto":
            return self.impl == "flash" and length > 1
        return length > self.block and batch * heads * length * keys * 4 > AUTO_DENSE_MAX_SCORE_BYTES

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, mask: AttentionMask,
                 cache: KVCache | LayerKVCache | PagedKVCache | None = None,
                 cache_index: jax.Array | int = 0,
                 ) -> tuple[jax.Array, KVCache | LayerKVCache | PagedKVCache | None]:
        """x `[B,T,H]`; `mask` says which keys each query sees. With `cache`, new keys are
        written at `cache_index` (one position, or one per row); a `PagedKVCache` takes one
        decode step."""
        q = sharding.constrain(self.q_norm(self._project(x, "q")), ("batch", "length", "act_heads", None))
        k = sharding.constrain(self.k_norm(self._project(x, "k")), ("batch", "length", "act_kv_heads", None))
        v = sharding.constrain(self._project(x, "v"), ("batch", "length", "act_kv_heads", None))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        scale = self.head_dim ** -0.5
        if isinstance(cache, PagedKVCache):  # each row sees positions 0 .. cache_index
            cache = cache.write(k, v, cache_index)
            if cache.kernel == "gather":
                keys, values = cache.view()
                out = _cached_attention(q, keys.astype(x.dtype), values.astype(x.dtype), mask,
                                        scale)
            else:
                out = cache.attend(q, cache_index + 1, scale).astype(x.dtype)
            return self._output(out, x.dtype), cache
        from_cache = cache is not None and not _is_fresh_prefill(cache_index)
        if isinstance(cache, LayerKVCache):
            cache = cache.write(k, v, cache_index)
        elif cache is not None:
            cache = _write_cache(cache, k, v, cache_index)
        if not from_cache:  # the queries see only their own keys (module docstring)
            mask = mask.first_keys(k.shape[1])
            if self._use_flash(q, k.shape[1]):
                out = flash_attention(q, k, v, mask, scale, block_q=self.block,
                                      block_k=self.block)
            else:
                out = self_attention(q, k, v, mask, scale)
            return self._output(out, x.dtype), cache
        # Only the first keys the mask covers are read (the engine's decode chunk attends over a
        # span of a longer cache, updated in place).
        keys = mask.kv_segments.shape[1]
        if isinstance(cache, LayerKVCache):
            k, v = cache.read(keys)
        else:
            k, v = cache.k[..., :keys], cache.v[:, :, :keys]
        k, v = k.astype(x.dtype), v.astype(x.dtype)
        if self._use_flash(q, keys):  # back to [B, S, K, D]
            out = flash_attention(q, jnp.transpose(k, (0, 3, 1, 2)), jnp.swapaxes(v, 1, 2), mask,
                                  scale, block_q=self.block, block_k=self.block)
        else:
            out = _cached_attention(q, k, v, mask, scale)
        return self._output(out, x.dtype), cache

    def _output(self, out: jax.Array, dtype: jnp.dtype) -> jax.Array:
        """The output projection of attention outputs `[B, T, N, D]`."""
        # One [B*T, N*D] x [N*D, H] matmul: an einsum over (n, d) contracts them in (d, n) order,
        # which made XLA:CPU transpose the whole weight at every decode step.
        o_proj = self.o_proj[...].astype(dtype)
        out = out.reshape(*out.shape[:2], -1) @ o_proj.reshape(-1, o_proj.shape[-1])
        if self.bias:
            out = out + self.o_bias[...].astype(dtype)
        return out
