"""SwiGLU feed-forward block: down(silu(gate(x)) * up(x))."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mars_jax import sharding
from mars_jax.layers.params import normal_param


class MLP(nnx.Module):
    """Dense SwiGLU MLP with `[hidden, intermediate]` gate/up and `[intermediate, hidden]` down."""

    def __init__(self, hidden: int, intermediate: int, *, rngs: nnx.Rngs, param_dtype: jnp.dtype,
                 stddev: float):
        self.gate_proj = normal_param(rngs, (hidden, intermediate), ("embed", "mlp"), param_dtype, stddev)
        self.up_proj = normal_param(rngs, (hidden, intermediate), ("embed", "mlp"), param_dtype, stddev)
        self.down_proj = normal_param(rngs, (intermediate, hidden), ("mlp", "embed"), param_dtype, stddev)

    def __call__(self, x: jax.Array) -> jax.Array:
        gate = x @ self.gate_proj[...].astype(x.dtype)
        up = x @ self.up_proj[...].astype(x.dtype)
        h = sharding.constrain(jax.nn.silu(gate) * up, ("batch", "length", "act_mlp"))
        return h @ self.down_proj[...].astype(x.dtype)
