"""The trainer's parameters copied to the rollout mesh (`builders.build_meshes`).

With the devices split, the rollout engine decodes on its own devices with its own copy of the
weights; after each update :func:`copy_weights` puts the new parameters there (`jax.device_put`
to :func:`rollout_shardings`: the same logical axes resolved on the rollout mesh). On one shared
mesh the shardings are the trainer's own, so nothing moves and the copy is the same arrays.
"""
from __future__ import annotations

import collections
import dataclasses
import math
import time
from typing import Any

import jax
import numpy as np
from flax import nnx

from mars_jax import sharding
from mars_jax.models import Qwen3


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One copy: seconds until every array had landed, bytes written on the destination
    devices (all of them, and on the fullest one); arrays already in place count 0 bytes."""

    seconds: float
    bytes: int
    bytes_per_device: int


def rollout_shardings(params: nnx.State, mesh: jax.sharding.Mesh,
                      rules: sharding.Rules | None = None) -> nnx.State:
    """A NamedSharding on `mesh` per parameter, from each one's `logical_axes` (the layout
    `create_model` / `from_pretrained` give a model built on `mesh`)."""
    return sharding.state_shardings(params, mesh, rules)


def transfer_bytes(params: Any, shardings: Any) -> tuple[int, int]:
    """(total, largest per device) bytes that putting `params` (arrays, or ShapeDtypeStructs
    with a sharding) into `shardings` writes on the destination devices; an array whose sharding
    is already equivalent to its destination counts 0."""
    per_device: collections.Counter = collections.Counter()
    for x, target in zip(jax.tree.leaves(params), jax.tree.leaves(shardings), strict=True):
        source = getattr(x, "sharding", None)
        if source is not None and source.is_equivalent_to(target, len(x.shape)):
            continue
        shard = math.prod(target.shard_shape(tuple(x.shape))) * np.dtype(x.dtype).itemsize
        for device in target.device_set:
            per_device[device] += shard
    return sum(per_device.values()), max(per_device.values(), default=0)


def copy_weights(params: nnx.State, shardings: nnx.State) -> tuple[nnx.State, Transfer]:
    """`params` put into `shardings` (from :func:`rollout_shardings`), waited for, and what the
    copy moved. The source arrays are not donated; an array already in its destination
    sharding is returned as is (not copied), so a later donation of the source reaches it too."""
    total, per_device = transfer_bytes(params, shardings)
    start = time.perf_counter()
    copied = jax.block_until_ready(jax.device_put(params, shardings))
    return copied, Transfer(time.perf_counter() - start, total, per_device)


def rollout_model(graphdef: nnx.GraphDef, params: nnx.State) -> Qwen3:
    """The model over the copied parameters (`graphdef` from `nnx.split(model, nnx.Param)`),
    e.g. for `sampling.Engine(model, mesh=rollout_mesh)` or `Engine.update_weights`."""
    return nnx.merge(graphdef, params)
