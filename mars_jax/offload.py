"""The update's state in host memory while the engine decodes: on one shared mesh the optimizer
state and KL reference are read only by the update.

`to_host` / `to_device` move a pytree's arrays to their devices' `pinned_host` memory and back, bit
for bit, shardings kept.
"""
from __future__ import annotations

from typing import Any

import jax

HOST, DEVICE = "pinned_host", "device"


def _move(tree: Any, kind: str) -> Any:
    arrays = [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]
    if not arrays:
        return tree
    leaves, treedef = jax.tree.flatten(tree)
    copies = jax.block_until_ready(
        jax.device_put(arrays, [x.sharding.with_memory_kind(kind) for x in arrays]))
    for x in arrays:  # donation across memory kinds is not implemented (jax 0.10.2)
        x.delete()
    moved = iter(copies)
    return jax.tree.unflatten(treedef, [next(moved) if isinstance(x, jax.Array) else x
                                        for x in leaves])


def to_host(tree: Any) -> Any:
    """`tree` with every array in pinned host memory (the device buffers are freed)."""
    return _move(tree, HOST)


def to_device(tree: Any) -> Any:
    """`tree` with every array back in device memory (the host buffers are freed)."""
    return _move(tree, DEVICE)



def move_update_state(state: Any, ref_params: Any, to: str) -> tuple[Any, Any]:
    """(`state` with its `opt_state` moved, `ref_params` moved) `to` 'host' or 'device'
    (`state`: an `rl.update.TrainState`; its parameters stay where they are)."""
    move = {"host": to_host, "device": to_device}[to]
    opt_state, ref_params = move((state.opt_state, ref_params))
    return state.replace(opt_state=opt_state), ref_params
