"""Grouped matmuls for the MoE's `ragged` dispatch: rows of `lhs [M, K]`, in consecutive groups of
`group_sizes`, times their group's matrix of `rhs` (out-by-in `[G, N, K]` or in-by-out `[G, K, N]`).
The kernel is chosen per platform at lowering (so an AOT compile gets the target's): TPU megablox
where `megablox_fits` (reading out-by-in weights as stored), Mosaic GPU with `mgpu` (untested on a
GPU), else `jax.lax.ragged_dot_general`. Rows past the groups' sum come out unspecified.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

# Mosaic GPU tiles (rows, output columns, contraction) and pipeline depth: 2 x 4 stages of
# 128 x 64 bf16 operand tiles plus a 128 x 128 output tile, 160 KiB of a Hopper SM's 227 KiB.
MGPU_BLOCK_M, MGPU_BLOCK_N, MGPU_BLOCK_K, MGPU_STAGES = 128, 128, 64, 4
MGPU_DTYPES = (jnp.bfloat16, jnp.float16)
# megablox tiles (rows, contraction, output columns), each cut to the dimension when smaller
# (rows to a multiple of 16, a bf16 tile's).
GMM_TILE, GMM_ROWS = 128, 16


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
                   transpose_rhs: bool, mgpu: bool = False) -> jax.Array:
    """`[M, N]` in `lhs`'s dtype: row r of group g is `lhs[r] @ rhs[g]` (`rhs[g].T` with
    `transpose_rhs`); the platform's kernel as the module says (`mgpu`: Mosaic GPU on cuda)."""
    args = (lhs, rhs, group_sizes.astype(jnp.int32))
    xla = functools.partial(xla_grouped_matmul, transpose_rhs=transpose_rhs)
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    tpu = (_manual(functools.partial(megablox_grouped_matmul, transpose_rhs=transpose_rhs))
           if megablox_fits(lhs.shape[1], n) else xla)
    if mgpu:
        cuda = _manual(functools.partial(mgpu_grouped_matmul, transpose_rhs=transpose_rhs))
        return jax.lax.platform_dependent(*args, tpu=tpu, cuda=cuda, default=xla)
    return jax.lax.platform_dependent(*args, tpu=tpu, default=xla)


def _manual(kernel):
    """`kernel` in a `shard_map` over the automatic mesh axes: XLA cannot partition it."""
    mesh = jax.sharding.get_abstract_mesh()
    auto = {name for name, kind in zip(mesh.axis_names, mesh.axis_types)
            if kind != jax.sharding.AxisType.Manual}
    if mesh.empty or not auto:
        return kernel
    return jax.shard_map(kernel, mesh=mesh, in_specs=PartitionSpec(), out_specs=PartitionSpec(),
                         axis_names=auto, check_vma=False)


def xla_grouped_matmul(lhs, rhs, group_sizes, *, transpose_rhs: bool) -> jax.Array:
    """`grouped_matmul` through `jax.lax.ragged_dot_general` (XLA's lowering)."""
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((1,), (2 if transpose_rhs else 1,)), ((), ())),
        lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
    return jax.lax.ragged_dot_general(lhs, rhs, group_sizes, dims)


def _pad_rows(x: jax.Array, multiple: int) -> jax.Array:
    return jnp.pad(x, ((0, -x.shape[0] % multiple), (0, 0)))


def megablox_fits(k: int, n: int) -> bool:
    """Whether megablox's TPU lowering takes a contraction of `k` and `n` output columns: its
    blocks (and its backward's) must span whole 128-lane tiles; other shapes take XLA's."""
    return k % GMM_TILE == 0 and n % GMM_TILE == 0


def megablox_grouped_matmul(lhs, rhs, group_sizes, *, transpose_rhs: bool,
                            interpret: bool = False) -> jax.Array:
    """`grouped_matmul` through Pallas megablox `gmm` (TPU; `interpret` runs it anywhere)."""
    from jax.experimental.pallas.ops.tpu.megablox import gmm  # Pallas TPU: imported on use

    m, k = lhs.shape
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    tm = min(GMM_TILE, -(-m // GMM_ROWS) * GMM_ROWS)
    tiling = (tm, min(GMM_TILE, k), min(GMM_TILE, n))
    out = gmm(_pad_rows(lhs, tm), rhs, group_sizes, lhs.dtype, tiling, None, None,
              transpose_rhs, interpret)
    return out[:m]


def mgpu_fits(k: int, n: int, dtype) -> bool:
    """Whether the Mosaic GPU kernels take a `[M, K] x [G, K, N]` grouped matmul, forward and
    backward: 16-bit floats, K and N whole multiples of every tile that spans them."""
    tile = max(MGPU_BLOCK_M, MGPU_BLOCK_N, MGPU_BLOCK_K)  # a multiple of the other two
    return (jnp.dtype(dtype) in [jnp.dtype(d) for d in MGPU_DTYPES]
            and not k % tile and not n % tile)


def _mgpu_forward(lhs, rhs, group_sizes, transpose_rhs: bool):
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu  # Mosaic GPU: imported on use

    m = lhs.shape[0]
    out = ragged_dot_mgpu.ragged_dot(
        _pad_rows(lhs, MGPU_BLOCK_M), rhs, group_sizes=group_sizes, block_m=MGPU_BLOCK_M,
        block_n=MGPU_BLOCK_N, block_k=MGPU_BLOCK_K, max_concurrent_steps=MGPU_STAGES,
        grid_block_n=1, transpose_rhs=transpose_rhs)
    return out[:m]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _mgpu(lhs, rhs, group_sizes, transpose_rhs: bool):
    return _mgpu_forward(lhs, rhs, group_sizes, transpose_rhs)


def _mgpu_fwd(lhs, rhs, group_sizes, transpose_rhs):
    return _mgpu_forward(lhs, rhs, group_sizes, transpose_rhs), (lhs, rhs, group_sizes)


def _mgpu_bwd(transpose_rhs, residuals, grad):
    lhs, rhs, group_sizes = residuals
    grad_lhs = _mgpu_forward(grad, rhs, group_sizes, not transpose_rhs)
    grad_rhs = _rhs_gradient(lhs, grad, group_sizes)
    grad_rhs = grad_rhs.swapaxes(1, 2) if transpose_rhs else grad_rhs
    return grad_lhs, grad_rhs.astype(rhs.dtype), None


def _rhs_gradient(lhs, grad, group_sizes):
    """Per group, its rows' `lhs^T @ grad` (`[G, K, N]`): Mosaic GPU's kernel where this
    process's first device is a GPU (it sizes its grid by that device), else XLA's."""
    if jax.devices()[0].platform != "gpu":
        dims = jax.lax.RaggedDotDimensionNumbers(
            dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=[0],
            rhs_group_dimensions=[])
        return jax.lax.ragged_dot_general(lhs, grad, group_sizes, dims)
    from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu

    return transposed_ragged_dot_mgpu.transposed_ragged_dot(
        _pad_rows(lhs, MGPU_BLOCK_K), _pad_rows(grad, MGPU_BLOCK_K), group_sizes=group_sizes,
        block_m=MGPU_BLOCK_M, block_n=MGPU_BLOCK_N, block_k=MGPU_BLOCK_K,
        max_concurrent_steps=MGPU_STAGES, grid_block_n=1)


_mgpu.defvjp(_mgpu_fwd, _mgpu_bwd)


def mgpu_grouped_matmul(lhs, rhs, group_sizes, *, transpose_rhs: bool) -> jax.Array:
    """`grouped_matmul` through Pallas Mosaic GPU (Hopper), with its own gradients."""
    return _mgpu(lhs, rhs, group_sizes, transpose_rhs)
