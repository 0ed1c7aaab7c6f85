"""Parameter creation with logical axis names (see `mars_jax.sharding`)."""
from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx


def normal_param(rngs: nnx.Rngs, shape: Sequence[int], logical_axes: Sequence[str | None],
                 dtype: jnp.dtype, stddev: float) -> nnx.Param:
    """A parameter drawn from N(0, stddev^2), tagged with its logical axes."""
    value = stddev * jax.random.normal(rngs.params(), tuple(shape), jnp.float32)
    return nnx.Param(value.astype(dtype), logical_axes=tuple(logical_axes))


def constant_param(shape: Sequence[int], logical_axes: Sequence[str | None], dtype: jnp.dtype,
                   value: float) -> nnx.Param:
    """A parameter filled with `value` (norm scales, biases)."""
    return nnx.Param(jnp.full(tuple(shape), value, dtype), logical_axes=tuple(logical_axes))
