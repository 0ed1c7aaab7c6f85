"""Whether one micro-batch's update program fits a chip, checked at start-up before anything is
collected: `update.micro_batch_gradients` compiled (nothing runs) for micro-batches of the
longest rows the run trains (`update_shape`: the mini-batch's micro-batch count is estimated from
the Solver rows of a step, so a step with more trained rows passes more argument bytes), its
per-chip bytes (`memory_analysis()`) plus what the trainer holds beside it.

The abstract inputs (`abstract_batch`, `update_shape`) are those experiments/aot_compile.py
compiles the update with.
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from mars_jax import memory_fit, sharding
from mars_jax.buckets import pow2_at_least
from mars_jax.errors import ConfigError, Problem
from mars_jax.rl.learner import LearnerConfig
from mars_jax.rl.rollout import RolloutConfig
from mars_jax.rl.streaming import ROLES_TRAINED, StreamSettings
from mars_jax.rl.update import UpdateConfig, micro_batch_gradients
from mars_jax.types import TrainBatch

GiB = memory_fit.GiB
# A compiler error saying the program does not fit the chip (TPU: RESOURCE_EXHAUSTED).
OOM = re.compile(r"RESOURCE_EXHAUSTED|[Rr]an out of memory")


@dataclasses.dataclass(frozen=True)
class UpdateShape:
    """The largest mini-batch of a step: `num_micro` micro-batches of `micro_batch` rows (over
    the whole training mesh) of `length` tokens."""

    micro_batch: int
    num_micro: int
    length: int


def update_shape(learner: LearnerConfig, rollout: RolloutConfig, stream: StreamSettings
                 ) -> UpdateShape:
    """One of `learner.mini_batches` mini-batches of the step's `prompts_per_step x group_size`
    rows, in micro-batches of `learner.micro_batch_size` rows of the longest prompt + output of
    the trained roles, bucketed as `batching.make_batch` buckets them (powers of two, at least
    `learner.min_length` columns and `learner.min_micro_batches` micro-batches)."""
    rows = stream.prompts_per_step * rollout.group_size
    micro = learner.micro_batch_size
    longest = max(rollout.max_new_tokens[role] for role in ROLES_TRAINED[stream.roles_trained])
    return UpdateShape(
        micro_batch=micro,
        num_micro=pow2_at_least(-(-rows // (micro * learner.mini_batches)),
                                learner.min_micro_batches),
        length=pow2_at_least(rollout.max_prompt_tokens + longest, learner.min_length))


def abstract(tree: Any, shardings: Any = None) -> Any:
    """`tree`'s arrays as `jax.ShapeDtypeStruct`s placed by `shardings` (default: their own)."""
    if shardings is None:
        shardings = jax.tree.map(lambda x: x.sharding, tree)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        tree, shardings)


def sharded(mesh: jax.sharding.Mesh, shape: Sequence[int], dtype,
            names: Sequence[str | None]) -> jax.ShapeDtypeStruct:
    """An abstract array of `shape` placed by the current rules' logical axis `names`."""
    return jax.ShapeDtypeStruct(tuple(shape), dtype,
                                sharding=sharding.named_sharding(mesh, names, shape))


def scalar(mesh: jax.sharding.Mesh, dtype) -> jax.ShapeDtypeStruct:
    """An abstract scalar replicated over `mesh`."""
    return jax.ShapeDtypeStruct((), dtype, sharding=NamedSharding(mesh, PartitionSpec()))


def abstract_batch(mesh: jax.sharding.Mesh, shape: UpdateShape, *, pack: bool, recompute: bool,
                   experts: tuple[int, int] | None, spread: bool) -> TrainBatch:
    """An abstract `TrainBatch` of `shape` as the trainer hands it to the update: with `spread`
    split over the mesh's batch axes (`distributed.global_train_batch`, several processes),
    else replicated on every device (one process passes its numpy batch); per-token advantages
    and segments where `pack`, pi_old's log-probabilities where `recompute`, routing of
    `experts` = (MoE layers, experts per token) where replayed."""
    m, b, length = shape.num_micro, shape.micro_batch, shape.length
    replicated = NamedSharding(mesh, PartitionSpec())

    def array(dims: tuple[int, ...], names: tuple[str | None, ...], dtype=jnp.int32):
        if spread:
            return sharded(mesh, dims, dtype, names)
        return jax.ShapeDtypeStruct(dims, dtype, sharding=replicated)

    rows = lambda dtype=jnp.int32: array((m, b, length), (None, "batch", None), dtype)
    routing = None
    if experts is not None:
        layers, k = experts
        routing = array((m, layers, b, length, k), (None, None, "batch", None, None))
    return TrainBatch(
        tokens=rows(), attention_mask=rows(), loss_mask=rows(jnp.float32),
        advantages=(rows(jnp.float32) if pack
                    else array((m, b), (None, "batch"), jnp.float32)),
        sampler_logprobs=rows(jnp.float32), expert_ids=routing,
        segments=rows() if pack else None,
        old_logprobs=rows(jnp.float32) if recompute else None)


@dataclasses.dataclass(frozen=True)
class UpdateBytes:
    """Per-chip bytes of one `micro_batch_gradients` (arguments + outputs - donated + temporaries
    + code) and of what the trainer holds beside it (`beside`)."""

    program: int
    temp: int
    beside: int

    @property
    def total(self) -> int:
        return self.program + self.beside


def update_bytes(state: Any, ref_params: Any, batch: TrainBatch, mesh: jax.sharding.Mesh, *,
                 graphdef: nnx.GraphDef, config: UpdateConfig, held: int = 0) -> UpdateBytes:
    """`micro_batch_gradients` compiled for `batch` over `state`'s parameters (arrays or
    abstract ones; nothing runs); beside it the optimizer state and step, and `held` bytes (a
    chip's share of the engine's KV cache kept through the update). Raises the compiler's
    error where it refuses the program (RESOURCE_EXHAUSTED on TPU)."""
    params = abstract(state.params)
    ref = None if ref_params is None else abstract(ref_params)
    with sharding.use_mesh(mesh):
        compiled = micro_batch_gradients.lower(
            params, params, batch, scalar(mesh, jnp.int32), ref, graphdef=graphdef,
            config=config).compile()
    memory = compiled.memory_analysis()
    program = (memory.argument_size_in_bytes + memory.output_size_in_bytes
               - memory.alias_size_in_bytes + memory.temp_size_in_bytes
               + memory.generated_code_size_in_bytes)
    beside = memory_fit.largest_shard((state.opt_state, state.step)) + held
    return UpdateBytes(program=program, temp=memory.temp_size_in_bytes, beside=beside)


def _refusal(shape: UpdateShape, limit: int, used: UpdateBytes | None, error: str) -> ConfigError:
    what = (f"{used.total / GiB:.1f} GiB a chip (the program {used.program / GiB:.1f}, of "
            f"which temporaries {used.temp / GiB:.1f}, + the optimizer state and what stays "
            f"beside it {used.beside / GiB:.1f})" if used is not None
            else f"more than the compiler could place ({error[:200]})")
    return ConfigError([Problem(
        "learner.micro_batch_size",
        f"one micro-batch's update ({shape.micro_batch} rows x {shape.length} tokens, "
        f"`micro_batch_gradients`) needs {what}, over the chip's {limit / GiB:.1f} GiB",
        f"halve learner.micro_batch_size (to {shape.micro_batch // 2}), or train on more chips "
        "(mesh.*); experiments/aot_compile.py reports the update's programs per topology")])


def check(shape: UpdateShape, learner: LearnerConfig, state: Any, ref_params: Any,
          mesh: jax.sharding.Mesh, *, graphdef: nnx.GraphDef, update_config: UpdateConfig,
          experts: tuple[int, int] | None, limit: int | None, held: int = 0
          ) -> UpdateBytes | None:
    """Raises ConfigError naming `learner.micro_batch_size` where one micro-batch of `shape`
    (`update_shape`; placed as this run's processes place it), its
    optimizer state and `held` bytes exceed `limit` bytes a chip, or the compiler refuses the
    program for lack of memory; returns the bytes counted (None: no `limit`, nothing checked)."""
    if limit is None:
        return None
    with sharding.use_mesh(mesh):
        batch = abstract_batch(mesh, shape, pack=learner.pack,
                               recompute=learner.pi_old == "recompute", experts=experts,
                               spread=jax.process_count() > 1)
    try:
        used = update_bytes(state, ref_params, batch, mesh, graphdef=graphdef,
                            config=update_config, held=held)
    except jax.errors.JaxRuntimeError as e:
        if not OOM.search(str(e)):
            raise
        raise _refusal(shape, limit, None, str(e)) from e
    if used.total > limit:
        raise _refusal(shape, limit, used, "")
    return used
