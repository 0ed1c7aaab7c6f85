"""Token embedding and rotary position embedding (RoPE, the 'default' HF variant)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mars_jax.layers.params import normal_param


class Embed(nnx.Module):
    """Token id -> vector lookup; `attend` reuses the table as a tied output projection."""

    def __init__(self, vocab_size: int, dim: int, *, rngs: nnx.Rngs, param_dtype: jnp.dtype,
                 stddev: float):
        self.embedding = normal_param(rngs, (vocab_size, dim), ("vocab", "embed"), param_dtype, stddev)

    def __call__(self, ids: jax.Array, dtype: jnp.dtype) -> jax.Array:
        return jnp.take(self.embedding[...], ids, axis=0).astype(dtype)

    def attend(self, x: jax.Array) -> jax.Array:
        return jnp.einsum("...h,vh->...v", x, self.embedding[...].astype(x.dtype))


def rope_cos_sin(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos and sin tables `[..., head_dim]` for integer `positions`, in float32."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates `x [B, T, heads, D]` by per-position `cos`/`sin [B, T, D]` (rotate-half layout)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    out = x.astype(jnp.float32) * cos + rotated.astype(jnp.float32) * sin
    return out.astype(x.dtype)
