"""The MoE's grouped matmuls against a float64 numpy reference: the Pallas megablox kernel (TPU's,
run in interpret mode here) with `wi`'s out-by-in layout read as stored, values and gradients,
and the `mgpu` dispatch's choice and CPU fallback."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mars_jax.layers import grouped_matmul
from mars_jax.layers.moe import MoE

SIZES = np.array([5, 0, 9])  # 14 rows in groups, the last 6 of 20 in none (another chip's)


def _reference(lhs, rhs, transpose_rhs):
    """Rows in groups, float64: row r of group g times `rhs[g]` (transposed as stored)."""
    rhs = np.asarray(rhs, np.float64)
    rhs = rhs.swapaxes(1, 2) if transpose_rhs else rhs
    groups = np.repeat(np.arange(len(SIZES)), SIZES)
    return np.einsum("mk,mkn->mn", np.asarray(lhs, np.float64)[:len(groups)], rhs[groups])


@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_megablox_matches_the_reference_values_and_gradients(transpose_rhs):
    """K = 256 spans two contraction tiles, M = 20 is padded to the kernel's rows."""
    k_lhs, k_rhs, k_grad = jax.random.split(jax.random.key(0), 3)
    lhs = jax.random.normal(k_lhs, (20, 256))
    rhs = jax.random.normal(k_rhs, (3, 128, 256) if transpose_rhs else (3, 256, 128))
    cotangent = jax.random.normal(k_grad, (14, 128))

    def matmul(lhs, rhs):
        return grouped_matmul.megablox_grouped_matmul(
            lhs, rhs, jnp.asarray(SIZES, jnp.int32), transpose_rhs=transpose_rhs,
            interpret=True)[:14]

    out, vjp = jax.vjp(matmul, lhs, rhs)
    np.testing.assert_allclose(out, _reference(lhs, rhs, transpose_rhs), rtol=1e-4, atol=1e-4)
    d_lhs, d_rhs = vjp(cotangent)
    # The reference's gradients: d(sum(out * cotangent)) by the chain rule, in float64.
    c, x = np.asarray(cotangent, np.float64), np.asarray(lhs, np.float64)
    w = np.asarray(rhs, np.float64)
    w = w.swapaxes(1, 2) if transpose_rhs else w
    groups = np.repeat(np.arange(3), SIZES)
    np.testing.assert_allclose(d_lhs[:14], np.einsum("mn,mkn->mk", c, w[groups]), rtol=1e-4,
                               atol=1e-4)
    ref_rhs = np.stack([x[:14][groups == g].T @ c[groups == g] for g in range(3)])
    ref_rhs = ref_rhs.swapaxes(1, 2) if transpose_rhs else ref_rhs
    np.testing.assert_allclose(d_rhs, ref_rhs, rtol=1e-4, atol=1e-4)


def _paper_moe(impl):
    """Qwen3-30B-A3B's expert shapes (hidden 2,048, 768 hidden units), 8 experts."""
    return MoE(2048, 768, 8, 2, norm_topk_prob=True, impl=impl, block_size=128,
               dense_max_tokens=64, capacity_factor=None, rngs=nnx.Rngs(0),
               param_dtype=jnp.bfloat16, stddev=0.02)


@pytest.mark.parametrize("platform", ["gpu", "cpu", "tpu"])
def test_mgpu_runs_the_kernel_where_auto_would_not_run_dense(monkeypatch, platform):
    """Above `dense_max_tokens`, in 16-bit floats, on every platform (the kernel itself is
    picked at lowering: Mosaic GPU on cuda only); else what `auto` picks there."""
    moe = _paper_moe("mgpu")
    monkeypatch.setattr(jax, "default_backend", lambda: platform)
    auto = _paper_moe("auto")
    assert moe.backend(65, jnp.bfloat16) == "mgpu"
    assert moe.backend(64, jnp.bfloat16) == "dense"
    assert moe.backend(65, jnp.float32) == auto.backend(65, jnp.float32)


def test_mgpu_fits_only_16_bit_floats_on_whole_tiles():
    assert grouped_matmul.mgpu_fits(2048, 1536, jnp.bfloat16)
    assert grouped_matmul.mgpu_fits(768, 2048, jnp.float16)
    assert not grouped_matmul.mgpu_fits(2048, 1536, jnp.float32)
    assert not grouped_matmul.mgpu_fits(24, 32, jnp.bfloat16)


def test_mgpu_on_cpu_gives_the_dense_reference():
    """On CPU the `mgpu` dispatch's grouped matmuls are `jax.lax.ragged_dot`'s: 96 tokens of the
    paper's expert shapes, bf16, equal the all-experts dense path."""
    x = jax.random.normal(jax.random.key(3), (96, 2048), jnp.bfloat16)
    out, _, _ = _paper_moe("mgpu")(x)
    ref, _, _ = _paper_moe("dense")(x)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                               atol=2e-2, rtol=2e-2)



def test_the_mgpu_grouped_matmul_trains_on_cpu_as_the_reference():
    """Off GPU the `mgpu` grouped matmul lowers to `jax.lax.ragged_dot` and differentiates (its
    Mosaic GPU branch is traced, custom gradients included, and left out): bf16 values and
    gradients against the float64 reference."""
    k_lhs, k_rhs, k_grad = jax.random.split(jax.random.key(1), 3)
    lhs = jax.random.normal(k_lhs, (20, 256), jnp.bfloat16)
    rhs = jax.random.normal(k_rhs, (3, 128, 256), jnp.bfloat16)
    cotangent = jax.random.normal(k_grad, (14, 128), jnp.bfloat16)

    def matmul(lhs, rhs):
        return grouped_matmul.grouped_matmul(lhs, rhs, jnp.asarray(SIZES), transpose_rhs=True,
                                             mgpu=True)[:14]

    out, vjp = jax.vjp(jax.jit(matmul), lhs, rhs)
    as64 = lambda a: np.asarray(a, np.float64)
    np.testing.assert_allclose(as64(out), _reference(as64(lhs), as64(rhs), True), rtol=2e-2,
                               atol=0.5)
    _, d_rhs = vjp(cotangent)
    groups = np.repeat(np.arange(3), SIZES)
    x, c = as64(lhs)[:14], as64(cotangent)
    ref_rhs = np.stack([(x[groups == g].T @ c[groups == g]).T for g in range(3)])
    np.testing.assert_allclose(as64(d_rhs), ref_rhs, rtol=2e-2, atol=0.5)
