"""The trainer's parameters copied to the rollout mesh (`builders.build_meshes`).

`copy_weights` after each update (nothing moves on one shared mesh); with several processes,
`HostCopies` gives every host's engine a whole copy on its own devices.
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
from mars_jax.distributed import CompiledTogether
from mars_jax.sharding import MESH_AXES, Mesh, NamedSharding
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
    """A NamedSharding on `mesh` per parameter, from its `logical_axes`."""
    return sharding.state_shardings(params, mesh, rules)


def transfer_bytes(params: Any, shardings: Any) -> tuple[int, int]:
    """(total, largest per device) bytes putting `params` into `shardings` writes."""
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
    """`params` put into `shardings`, waited for, and what the copy moved. An array already in
    place is returned as is, not copied: donating the source later donates it too."""
    total, per_device = transfer_bytes(params, shardings)
    start = time.perf_counter()
    copied = jax.block_until_ready(jax.device_put(params, shardings))
    return copied, Transfer(time.perf_counter() - start, total, per_device)


def rollout_model(graphdef: nnx.GraphDef, params: nnx.State) -> Qwen3:
    """The model over the copied parameters (`graphdef` from `nnx.split(model, nnx.Param)`),
    e.g. for `sampling.Engine(model, mesh=rollout_mesh)` or `Engine.update_weights`."""
    return nnx.merge(graphdef, params)


class HostCopies:
    """The trainer's parameters on every host's own rollout mesh (a collective: all call `copy`
    together): one program reshards them into a per-host layout, whose local shards then move to
    this host's rollout shardings."""

    def __init__(self, params: nnx.State, train_mesh: Mesh, rollout_mesh: Mesh,
                 rules: sharding.Rules | None = None):
        self.target = rollout_shardings(params, rollout_mesh, rules)
        blocks = sharding.devices_by_process(list(train_mesh.devices.flat))
        meshes = {p: self._staging_mesh(sorted(devices, key=lambda d: d.id), rollout_mesh)
                  for p, devices in blocks.items()}
        local = meshes[jax.process_index()]
        grid = np.stack([meshes[p].devices for p in sorted(meshes)])
        staging = Mesh(grid, ("hosts",) + MESH_AXES,
                       axis_types=(jax.sharding.AxisType.Auto,) * (1 + len(MESH_AXES)))
        local_shardings = jax.tree.leaves(rollout_shardings(params, local, rules))
        self._local = local_shardings
        self._reshard = CompiledTogether(jax.jit(lambda leaves: leaves, out_shardings=[
            NamedSharding(staging, s.spec) for s in local_shardings]), "weight_copy")

    @staticmethod
    def _staging_mesh(devices: list[jax.Device], rollout_mesh: Mesh) -> Mesh:
        if len(devices) == rollout_mesh.devices.size:
            return sharding.make_mesh(dict(rollout_mesh.shape), devices)
        return sharding.make_mesh({"data": 1, "fsdp": -1}, devices)

    def copy(self, params: nnx.State) -> tuple[nnx.State, Transfer]:
        """`params` on this host's rollout shardings, waited for, and the bytes written here."""
        leaves, treedef = jax.tree.flatten(params)
        start = time.perf_counter()
        staged = self._reshard(leaves)
        targets = jax.tree.leaves(self.target)
        local = [jax.make_array_from_single_device_arrays(
            x.shape, s, [shard.data for shard in x.addressable_shards])
            for x, s in zip(staged, self._local, strict=True)]
        copied = jax.block_until_ready(jax.device_put(local, targets))
        seconds = time.perf_counter() - start
        per_device: collections.Counter = collections.Counter()
        for x, target in zip(copied, targets):
            for device in target.device_set:
                per_device[device] += (math.prod(target.shard_shape(tuple(x.shape)))
                                       * np.dtype(x.dtype).itemsize)
        return (jax.tree.unflatten(treedef, copied),
                Transfer(seconds, sum(per_device.values()), max(per_device.values(), default=0)))
