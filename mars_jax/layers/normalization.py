"""RMSNorm as Qwen3 computes it: statistics in float32, scale applied in the input dtype."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mars_jax.layers.params import constant_param


class RMSNorm(nnx.Module):
    """y = scale * (x / sqrt(mean(x^2) + eps)), normalising over the last axis."""

    def __init__(self, dim: int, *, eps: float, param_dtype: jnp.dtype):
        self.eps = eps
        self.scale = constant_param((dim,), ("norm",), param_dtype, 1.0)

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
        return self.scale[...].astype(x.dtype) * x32.astype(x.dtype)
