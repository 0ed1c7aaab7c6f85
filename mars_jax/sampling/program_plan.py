"""The engine's device programs as calls to lower, written once for `precompile` (an engine's
concrete state) and `experiments/aot_compile.py` (abstract, sharded arguments for a topology).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from mars_jax import sharding
from mars_jax.sampling import engine_programs as programs

# The programs serving runs, by the name their jitted function (and its builder here) has.
PROGRAMS = ("prefill", "insert", "decode_chunk", "take_slots", "put_slots", "deactivate")
IN_MESH = ("prefill", "insert", "decode_chunk")  # serving calls these inside the engine's mesh


class Args(Protocol):
    """Arguments of a program that are not engine state; `names` are logical axis names."""

    def scalar(self, dtype) -> Any: ...

    def array(self, shape: Sequence[int], dtype, names: Sequence[str | None]) -> Any: ...

    def host(self, shape: Sequence[int], dtype, names: Sequence[str | None]) -> Any:
        """An array serving builds on the host (page tables), outside the engine's mesh."""


class ServingArgs:
    """Zeros made as serving makes its arguments: scalars and arrays in the current context
    (inside the engine's mesh for a program that runs in it), host arrays as numpy."""

    def scalar(self, dtype) -> jax.Array:
        return jnp.zeros((), dtype)

    def array(self, shape, dtype, names) -> jax.Array:
        del names
        return jnp.zeros(tuple(shape), dtype)

    def host(self, shape, dtype, names) -> np.ndarray:
        del names
        return np.zeros(tuple(shape), dtype)


@dataclasses.dataclass(frozen=True)
class Program:
    """One call of a jitted program of `engine_programs`."""

    fn: Callable
    args: tuple
    kwargs: dict = dataclasses.field(default_factory=dict)

    def lower(self) -> jax.stages.Lowered:
        return self.fn.lower(*self.args, **self.kwargs)


def prefill(args: Args, graphdef, weights, previous: tuple | None, *, rows: int, bucket: int,
            width: int) -> Program:
    """A prefill piece `width` tokens wide of a `[rows, bucket]` batch: the first (`previous`
    None) or a later one (`previous`: the prompt cache, logits and routing so far)."""
    cache, logits, experts = previous or (None, None, None)
    return Program(programs.prefill, (
        graphdef, weights, cache, logits, experts,
        args.array((rows, width), jnp.int32, ("batch", None)), args.scalar(jnp.int32),
        args.array((rows,), jnp.int32, ("batch",))),
        dict(bucket=bucket, fresh=previous is None))


def insert(args: Args, state, pool, prefilled: tuple, *, pages: int, shards: int,
           max_stop_ids: int) -> Program:
    """A prefilled row (`prefilled`: prompt cache, logits, routing) copied into a slot of
    `state`; paged (`pool` not None), into `pages` pages of each of the `shards` pools."""
    cache, logits, experts = prefilled
    page_ids = None if pool is None else args.host((shards, pages), jnp.int32, (None, None))
    i32, u32, f32 = (args.scalar(jnp.int32), args.scalar(jnp.uint32), args.scalar(jnp.float32))
    return Program(programs.insert, (
        state, pool, page_ids, i32, cache, logits, experts, i32, i32, i32, i32, u32, u32, f32,
        i32, f32, args.array((max_stop_ids,), jnp.int32, (None,))))


def decode_chunk(args: Args, graphdef, weights, state, pool, *, steps: int, span: int,
                 kernel: str, page_size: int) -> Program:
    """A decode chunk of up to `steps` steps over `state` attending over `span` positions."""
    table = None
    if pool is not None:
        table = args.host((state.length.shape[0], span // page_size), jnp.int32, (None, None))
    return Program(programs.decode_chunk, (
        graphdef, weights, state, pool, table, args.scalar(jnp.int32)),
        dict(steps=steps, span=span, kernel=kernel))


def take_slots(args: Args, state, rows: int) -> Program:
    """`rows` rows of `state` gathered into a smaller slot bucket."""
    return Program(programs.take_slots, (
        state, args.array((rows,), jnp.int32, (None,)), args.array((rows,), jnp.bool_, (None,))))


def put_slots(args: Args, full, part) -> Program:
    """The rows of `part` (a smaller slot bucket) written back into `full`."""
    rows = part.length.shape[0]
    index = args.array((rows,), jnp.int32, (None,))
    return Program(programs.put_slots, (full, part, index, index, args.scalar(jnp.int32)))


def deactivate(args: Args, state) -> Program:
    """A preempted row of `state` stopped."""
    return Program(programs.deactivate, (state, args.scalar(jnp.int32)))


class AbstractArgs:
    """Abstract arrays on `mesh` placed by their logical axis names; scalars replicated."""

    def __init__(self, mesh: jax.sharding.Mesh):
        self.mesh = mesh

    def scalar(self, dtype) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((), dtype, sharding=NamedSharding(self.mesh, PartitionSpec()))

    def array(self, shape, dtype, names) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(tuple(shape), dtype,
                                    sharding=sharding.named_sharding(self.mesh, names, shape))

    host = array
