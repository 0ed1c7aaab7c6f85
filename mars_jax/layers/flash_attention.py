"""Blockwise (flash) attention in plain JAX: memory linear in the sequence length, every backend.

An online softmax over the visible key blocks, and a `custom_vjp` backward recomputing the score
tiles from the log-sum-exp (FlashAttention-2). A query that sees no key gets a finite average.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from mars_jax.layers.attention_mask import AttentionMask

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def pad_to(x: jax.Array, axis: int, multiple: int, value=0) -> jax.Array:
    """`x` padded with `value` at the end of `axis` to a multiple of `multiple`."""
    pad = -x.shape[axis] % multiple
    if not pad:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)


def _tile_mask(q_seg, kv_seg, offset, q_start, k_start):
    """`[B, 1, 1, bq, bk]` visibility of one tile."""
    q_slots = q_start + jnp.arange(q_seg.shape[1]) + offset
    k_slots = k_start + jnp.arange(kv_seg.shape[1])
    causal = k_slots[None, :] <= q_slots[:, None]
    same = q_seg[:, :, None] == kv_seg[:, None, :]
    return (causal[None] & same)[:, None, None]


def _scores(qb, kb, scale):
    """qb `[B, bq, K, G, D]`, kb `[B, bk, K, D]` -> f32 `[B, K, G, bq, bk]`."""
    return jnp.einsum("bqkgd,bskd->bkgqs", qb, kb, preferred_element_type=jnp.float32) * scale


def _last_key_block(i, offset, block_q, block_k, num_k):
    """One past the last key block that query block `i` can see (at most `num_k`)."""
    return jnp.minimum(jnp.clip((i + 1) * block_q - 1 + offset, -1, None) // block_k + 1, num_k)


def _first_query_block(j, offset, block_q, block_k, num_q):
    """The first query block that can see key block `j` (`num_q` when none can)."""
    return jnp.clip((j * block_k - offset) // block_q, 0, num_q)


def _block(x, index, size, axis=1):
    """Block `index` (of `size` elements) along `axis` of `x`."""
    return jax.lax.dynamic_slice_in_dim(x, index * size, size, axis=axis)


def _blocks(x, axis, size):
    """Splits `axis` of `x` into `[num_blocks, ...]` leading blocks of `size`."""
    x = jnp.moveaxis(x, axis, 0)
    x = x.reshape(x.shape[0] // size, size, *x.shape[1:])
    return jnp.moveaxis(x, 1, axis + 1)


def _unblock(x, axis):
    """Inverse of `_blocks`: `[num_blocks, ..., size at axis + 1, ...]` -> joined `axis`."""
    x = jnp.moveaxis(x, axis + 1, 1)
    x = x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])
    return jnp.moveaxis(x, 0, axis)


def _forward(q, k, v, q_seg, kv_seg, offset, scale, block_q, block_k):
    """q `[B, T, K, G, D]` (T, S multiples of the blocks) -> out like q, lse f32 `[B, K, G, T]`."""
    b, _, kv_heads, groups, d = q.shape
    num_k = k.shape[1] // block_k

    def query_block(args):
        i, qb, q_seg_b = args

        def key_block(j, carry):
            m, l, acc = carry
            kb, vb, kv_seg_b = (_block(x, j, block_k) for x in (k, v, kv_seg))
            s = _scores(qb, kb, scale)
            s = jnp.where(_tile_mask(q_seg_b, kv_seg_b, offset, i * block_q, j * block_k), s,
                          MASK_VALUE)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            p = jnp.exp(s - m_new[..., None])
            correction = jnp.exp(m - m_new)
            l = l * correction + jnp.sum(p, axis=-1)
            acc = acc * correction[..., None] + jnp.einsum(
                "bkgqs,bskd->bkgqd", p.astype(v.dtype), vb, preferred_element_type=jnp.float32)
            return m_new, l, acc

        shape = (b, kv_heads, groups, block_q)
        init = (jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32),
                jnp.zeros(shape + (d,), jnp.float32))
        hi = _last_key_block(i, offset, block_q, block_k, num_k)
        m, l, acc = jax.lax.fori_loop(0, hi, key_block, init)
        l = jnp.maximum(l, jnp.finfo(jnp.float32).tiny)
        out = jnp.einsum("bkgqd->bqkgd", acc / l[..., None]).astype(q.dtype)
        return out, m + jnp.log(l)

    num_q = q.shape[1] // block_q
    out, lse = jax.lax.map(query_block, (jnp.arange(num_q), _blocks(q, 1, block_q),
                                         _blocks(q_seg, 1, block_q)))
    return _unblock(out, 1), _unblock(lse, 3)


def _backward(q, k, v, q_seg, kv_seg, offset, out, lse, dout, scale, block_q, block_k):
    """dq, dk, dv of `_forward` (FlashAttention-2: p recomputed from the saved log-sum-exp)."""
    num_q, num_k = q.shape[1] // block_q, k.shape[1] // block_k
    delta = jnp.einsum("bqkgd,bqkgd->bkgq", dout.astype(jnp.float32), out.astype(jnp.float32))

    def tile(qb, kb, vb, dob, lse_b, delta_b, q_seg_b, kv_seg_b, q_start, k_start):
        """Probabilities and score gradients of one `[bq, bk]` tile."""
        allowed = _tile_mask(q_seg_b, kv_seg_b, offset, q_start, k_start)
        s = jnp.where(allowed, _scores(qb, kb, scale), MASK_VALUE)
        p = jnp.exp(s - lse_b[..., None])
        dp = jnp.einsum("bqkgd,bskd->bkgqs", dob, vb, preferred_element_type=jnp.float32)
        ds = jnp.where(allowed, p * (dp - delta_b[..., None]), 0.0) * scale
        return p, ds

    def key_block(args):
        j, kb, vb, kv_seg_b = args

        def query_block(i, carry):
            dk, dv = carry
            qb, dob = _block(q, i, block_q), _block(dout, i, block_q)
            p, ds = tile(qb, kb, vb, dob, _block(lse, i, block_q, 3),
                         _block(delta, i, block_q, 3), _block(q_seg, i, block_q), kv_seg_b,
                         i * block_q, j * block_k)
            dv = dv + jnp.einsum("bkgqs,bqkgd->bskd", p.astype(dout.dtype), dob,
                                 preferred_element_type=jnp.float32)
            dk = dk + jnp.einsum("bkgqs,bqkgd->bskd", ds.astype(q.dtype), qb,
                                 preferred_element_type=jnp.float32)
            return dk, dv

        zeros = jnp.zeros(kb.shape, jnp.float32)
        lo = _first_query_block(j, offset, block_q, block_k, num_q)
        dk, dv = jax.lax.fori_loop(lo, num_q, query_block, (zeros, zeros))
        return dk.astype(k.dtype), dv.astype(v.dtype)

    def query_block(args):
        i, qb, dob, lse_b, delta_b, q_seg_b = args

        def key_block(j, dq):
            kb, vb = _block(k, j, block_k), _block(v, j, block_k)
            _, ds = tile(qb, kb, vb, dob, lse_b, delta_b, q_seg_b, _block(kv_seg, j, block_k),
                         i * block_q, j * block_k)
            return dq + jnp.einsum("bkgqs,bskd->bqkgd", ds.astype(k.dtype), kb,
                                   preferred_element_type=jnp.float32)

        hi = _last_key_block(i, offset, block_q, block_k, num_k)
        dq = jax.lax.fori_loop(0, hi, key_block, jnp.zeros(qb.shape, jnp.float32))
        return dq.astype(q.dtype)

    dk, dv = jax.lax.map(key_block, (jnp.arange(num_k), _blocks(k, 1, block_k),
                                     _blocks(v, 1, block_k), _blocks(kv_seg, 1, block_k)))
    dq = jax.lax.map(query_block, (jnp.arange(num_q), _blocks(q, 1, block_q),
                                   _blocks(dout, 1, block_q), _blocks(lse, 3, block_q),
                                   _blocks(delta, 3, block_q), _blocks(q_seg, 1, block_q)))
    return _unblock(dq, 1), _unblock(dk, 1), _unblock(dv, 1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _flash(q, k, v, q_seg, kv_seg, offset, scale, block_q, block_k):
    return _forward(q, k, v, q_seg, kv_seg, offset, scale, block_q, block_k)[0]


def _flash_fwd(q, k, v, q_seg, kv_seg, offset, scale, block_q, block_k):
    out, lse = _forward(q, k, v, q_seg, kv_seg, offset, scale, block_q, block_k)
    return out, (q, k, v, q_seg, kv_seg, offset, out, lse)


def _flash_bwd(scale, block_q, block_k, residuals, dout):
    q, k, v, q_seg, kv_seg, offset, out, lse = residuals
    dq, dk, dv = _backward(q, k, v, q_seg, kv_seg, offset, out, lse, dout, scale, block_q, block_k)
    return dq, dk, dv, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: AttentionMask, scale: float,
                    *, block_q: int = 512, block_k: int = 512) -> jax.Array:
    """softmax(q k^T * scale) v with GQA, blockwise. q `[B,T,N,D]`, k/v `[B,S,K,D]`."""
    b, t, n, d = q.shape
    s, kv_heads = k.shape[1], k.shape[2]
    block_q, block_k = min(block_q, t), min(block_k, s)
    q = pad_to(q.reshape(b, t, kv_heads, n // kv_heads, d), 1, block_q)
    q_seg = pad_to(mask.q_segments, 1, block_q, value=-1)
    k, v = pad_to(k, 1, block_k), pad_to(v, 1, block_k)
    kv_seg = pad_to(mask.kv_segments, 1, block_k)
    out = _flash(q, k, v, q_seg, kv_seg, mask.offset, scale, block_q, block_k)
    return out[:, :t].reshape(b, t, n, d)
