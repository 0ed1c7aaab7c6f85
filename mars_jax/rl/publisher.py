"""The one path from the train state's parameters to the rollout engine's weights
(`WeightPublisher`), used by `rl.trainer` after every update."""
from __future__ import annotations

import jax
from flax import nnx

from mars_jax import weight_sync
from mars_jax.rl.streaming import StreamingRollouts


def weight_copier(params, mesh: jax.sharding.Mesh, rollout_mesh: jax.sharding.Mesh):
    """params -> (this host's engine copy, `weight_sync.Transfer`): on one process a
    `device_put` to the rollout mesh's shardings, on several `weight_sync.HostCopies`."""
    if jax.process_count() > 1:
        return weight_sync.HostCopies(params, mesh, rollout_mesh).copy
    shardings = weight_sync.rollout_shardings(params, rollout_mesh)
    return lambda current: weight_sync.copy_weights(current, shardings)


class WeightPublisher:
    """The one path from the train state's parameters to the engine's weights: the update's own
    arrays on one shared mesh, else a copy on the rollout mesh (`weight_sync`, metrics
    `sync/*`)."""

    def __init__(self, graphdef, params, mesh: jax.sharding.Mesh,
                 rollout_mesh: jax.sharding.Mesh):
        self.graphdef = graphdef
        self.copy = (weight_copier(params, mesh, rollout_mesh) if rollout_mesh is not mesh
                     else None)

    def first_model(self, params):
        """The model the engine starts with."""
        if self.copy is None:
            return nnx.merge(self.graphdef, params)
        return weight_sync.rollout_model(self.graphdef, self.copy(params)[0])

    def publish(self, stream: StreamingRollouts, params, version: int) -> dict[str, float]:
        """`stream` decodes `params`, policy `version`, from now on; returns the copy's
        metrics."""
        if self.copy is None:
            stream.weights_updated(nnx.merge(self.graphdef, params), version)
            return {}
        copied, transfer = self.copy(params)
        stream.weights_updated(weight_sync.rollout_model(self.graphdef, copied), version)
        return {"sync/seconds": transfer.seconds, "sync/bytes": transfer.bytes,
                "sync/bytes_per_device": transfer.bytes_per_device}

    def unchanged(self, stream: StreamingRollouts, params) -> None:
        """After an update that changed nothing: on a shared mesh the update donated the arrays
        the engine decodes with, so it takes the same weights in `params`' arrays."""
        if self.copy is None:
            stream.weights_moved(nnx.merge(self.graphdef, params))
