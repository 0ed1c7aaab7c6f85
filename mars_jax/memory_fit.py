"""Whether a training run's resident buffers fit its chips, checked before the engine is built.

Counted: the train state shard, the engine's weight copy and KV cache; not programs' temporaries
(the update's: `rl.update_fit`).
"""
from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from mars_jax.errors import ConfigError, Problem
from mars_jax.sampling.decode import EngineSettings
from mars_jax.sampling.engine import kv_bytes_per_token
from mars_jax.sharding import Mesh

GiB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Resident:
    """Bytes on the fullest chip of each part."""

    train_state: int
    engine_weights: int
    kv_cache: int

    @property
    def total(self) -> int:
        return self.train_state + self.engine_weights + self.kv_cache


def largest_shard(tree, shardings=None) -> int:
    """Bytes of `tree`'s arrays on its fullest device (in `shardings` when given)."""
    per_device: dict = {}
    leaves = jax.tree.leaves(tree)
    targets = jax.tree.leaves(shardings) if shardings is not None else [x.sharding for x in leaves]
    for x, target in zip(leaves, targets, strict=True):
        nbytes = math.prod(target.shard_shape(tuple(x.shape))) * np.dtype(x.dtype).itemsize
        for device in target.device_set:
            per_device[device] = per_device.get(device, 0) + nbytes
    return max(per_device.values(), default=0)


def engine_kv_bytes(engine: EngineSettings, model_config, shards: int) -> int:
    """The KV cache bytes of the `sampling.Engine` `engine` describes, as it allocates them."""
    per_token = kv_bytes_per_token(model_config)
    if engine.options.get("kv_pages"):
        return per_token * engine.options["page_size"] * (engine.options["kv_pages"] + shards)
    return per_token * engine.max_length * engine.slots


def resident(state, engine_weights: tuple | None, kv_bytes: int, rollout_mesh: Mesh) -> Resident:
    """The resident parts: `state`'s arrays, `engine_weights` = (params, rollout shardings) of
    a copy or None, the KV cache spread evenly over the rollout mesh's devices."""
    copy = largest_shard(*engine_weights) if engine_weights is not None else 0
    return Resident(train_state=largest_shard(state), engine_weights=copy,
                    kv_cache=-(-kv_bytes // rollout_mesh.devices.size))


def offloaded_phases(state, engine_weights: tuple | None, kv_bytes: int, rollout_mesh: Mesh, *,
                     kv_through_update: bool) -> tuple[Resident, Resident]:
    """`resident` while decoding and while updating with the optimizer state offloaded; the KV
    cache stays through the update only where `kv_through_update`."""
    decoding = resident(state.replace(opt_state=None), engine_weights, kv_bytes, rollout_mesh)
    updating = resident(state, engine_weights, kv_bytes if kv_through_update else 0,
                        rollout_mesh)
    return decoding, updating


def check(parts: Resident, limit: int | None, shared: bool) -> None:
    """Raises ConfigError naming the fields to change when `parts` exceed `limit` bytes (None:
    nothing checked); `shared`: engine and trainer on the same chips."""
    if limit is None:
        return
    need = parts.total if shared else max(parts.train_state, parts.engine_weights + parts.kv_cache)
    if need <= limit:
        return
    what = (f"train state {parts.train_state / GiB:.1f} + engine weights "
            f"{parts.engine_weights / GiB:.1f} + KV cache {parts.kv_cache / GiB:.1f} GiB"
            if shared else f"engine weights {parts.engine_weights / GiB:.1f} + KV cache "
            f"{parts.kv_cache / GiB:.1f} GiB on the rollout chips, train state "
            f"{parts.train_state / GiB:.1f} GiB on the training chips")
    raise ConfigError([Problem(
        "rollout.engine_kv_pages", f"the resident buffers need {need / GiB:.1f} GiB a chip "
        f"({what}), over the chip's {limit / GiB:.1f} GiB before any program's temporaries",
        "lower rollout.engine_kv_pages (or rollout.engine_slots with reserved slots), or give "
        "the engine more chips (mesh.rollout.devices, mesh.rollout.* sizes) or the trainer "
        "more (mesh.*); experiments/aot_compile.py reports the temporaries too")])


def device_memory() -> int | None:
    """This host's first device's memory limit, None where the backend does not say (CPU)."""
    stats = jax.local_devices()[0].memory_stats()
    return None if not stats else stats.get("bytes_limit")
