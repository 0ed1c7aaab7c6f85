"""Grouped-query attention with per-head q/k RMSNorm, RoPE and an optional KV cache.

Two kernels compute softmax(q k^T) v under an `AttentionMask`: `dot_product_attention` forms the
`[B, heads, T, S]` scores at once (fast for short sequences and one-token decode steps);
`flash_attention` works block by block in memory linear in the length. `impl='auto'` picks flash
when the queries span more than one block.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from mars_jax import sharding
from mars_jax.layers.attention_mask import AttentionMask
from mars_jax.layers.embeddings import apply_rope
from mars_jax.layers.flash_attention import MASK_VALUE, flash_attention
from mars_jax.layers.normalization import RMSNorm
from mars_jax.layers.params import constant_param, normal_param

class KVCache(NamedTuple):
    """One layer's cache: keys and values `[batch, cache_length, kv_heads, head_dim]`."""

    k: jax.Array
    v: jax.Array


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: AttentionMask,
                          scale: float) -> jax.Array:
    """softmax(q k^T * scale) v with GQA. q `[B,T,N,D]`, k/v `[B,S,K,D]`. Masked scores get a
    finite `MASK_VALUE`, so a query with no visible key (left padding) averages instead of NaN."""
    allowed = mask.dense()
    b, t, n, d = q.shape
    kv_heads = k.shape[2]
    q = q.reshape(b, t, kv_heads, n // kv_heads, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(allowed[:, None, None, :, :], scores, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
    return out.reshape(b, t, n, d)


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

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, mask: AttentionMask,
                 cache: KVCache | None = None, cache_index: jax.Array | int = 0,
                 ) -> tuple[jax.Array, KVCache | None]:
        """x `[B,T,H]`; `mask` says which keys each query sees (S = T, or the cache length when
        `cache` is given, in which case the new keys are written at `cache_index`)."""
        q = sharding.constrain(self.q_norm(self._project(x, "q")), ("batch", "length", "act_heads", None))
        k = sharding.constrain(self.k_norm(self._project(x, "k")), ("batch", "length", "act_kv_heads", None))
        v = sharding.constrain(self._project(x, "v"), ("batch", "length", "act_kv_heads", None))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            start = (0, cache_index, 0, 0)
            cache = KVCache(jax.lax.dynamic_update_slice(cache.k, k.astype(cache.k.dtype), start),
                            jax.lax.dynamic_update_slice(cache.v, v.astype(cache.v.dtype), start))
            k, v = cache.k.astype(x.dtype), cache.v.astype(x.dtype)
        scale = self.head_dim ** -0.5
        if self.impl == "flash" or (self.impl == "auto" and q.shape[1] > self.block):
            out = flash_attention(q, k, v, mask, scale, block_q=self.block, block_k=self.block)
        else:
            out = dot_product_attention(q, k, v, mask, scale)
        out = jnp.einsum("btnd,ndh->bth", out, self.o_proj[...].astype(x.dtype))
        if self.bias:
            out = out + self.o_bias[...].astype(x.dtype)
        return out, cache
