"""PagedKVCache against a dense numpy cache written position by position, and its attention
(the gather path and the Pallas GPU kernel in the interpreter) against float64 numpy."""
import jax.numpy as jnp
import numpy as np
import pytest

from mars_jax.layers.paged_kv import PagedKVCache, default_kernel, write_pages

HEADS, DIM, PAGE = 2, 16, 4
# Two pools of 6 pages (rows 0-1 in pool 0, rows 2-3 in pool 1). Row 0 owns pages 5, 1, 3
# (12 positions); row 1 owns none; row 2 owns pool 1's 2 and 4 (8 positions; its third entry
# is the trash page 0); row 3 owns pool 1's 5, 1, 3: the same ids as row 0's.
TABLE = np.array([[5, 1, 3], [0, 0, 0], [2, 4, 0], [5, 1, 3]], np.int32)
OWNED = {0: 12, 2: 8, 3: 12}


def _written(kernel="gather"):
    """The cache after six steps of writes, and the dense `[rows, positions, K, D]` keys and
    values each owned row holds."""
    rng = np.random.default_rng(0)
    shape = (2, HEADS, 6, PAGE, DIM)
    cache = PagedKVCache(jnp.zeros(shape), jnp.zeros(shape), jnp.asarray(TABLE), kernel)
    dense_k, dense_v = np.zeros((4, 12, HEADS, DIM)), np.zeros((4, 12, HEADS, DIM))
    for position in (0, 3, 4, 7, 9, 11):
        k, v = rng.normal(size=(2, 4, 1, HEADS, DIM))
        index = np.array([position, position, min(position, 7), position])
        cache = cache.write(jnp.asarray(k), jnp.asarray(v), jnp.asarray(index))
        for b in OWNED:
            dense_k[b, index[b]], dense_v[b, index[b]] = k[b, 0], v[b, 0]
        trash = k[1, 0], v[1, 0], position % PAGE  # row 1's write: pool 0's trash page
    return cache, dense_k, dense_v, trash


def test_writes_and_views_match_a_dense_cache_and_unowned_entries_hit_the_trash_page():
    cache, dense_k, dense_v, (k1, v1, offset) = _written()
    keys, values = map(np.asarray, cache.view())  # [B, K, D, S], [B, K, S, D]
    for b, owned in OWNED.items():
        np.testing.assert_allclose(keys[b, ..., :owned],
                                   dense_k[b, :owned].transpose(1, 2, 0), atol=1e-6)
        np.testing.assert_allclose(values[b, :, :owned],
                                   dense_v[b, :owned].transpose(1, 0, 2), atol=1e-6)
    np.testing.assert_allclose(np.asarray(cache.k)[0, :, 0, offset], k1, atol=1e-6)
    np.testing.assert_allclose(np.asarray(cache.v)[0, :, 0, offset], v1, atol=1e-6)


@pytest.mark.parametrize("kernel", ["gather", "interpret"])
def test_attention_over_pages_equals_float64_attention_over_the_dense_cache(kernel):
    """Rows 0, 2, 3 see their first 10, 6 and 12 positions; 4 query heads over 2 KV heads."""
    from mars_jax.layers.attention import _cached_attention
    from mars_jax.layers.attention_mask import AttentionMask

    cache, dense_k, dense_v, _ = _written(kernel)
    q = np.random.default_rng(1).normal(size=(4, 1, 4, DIM))
    lengths = np.array([10, 1, 6, 12])
    scale = DIM ** -0.5
    if kernel == "gather":
        keys, values = cache.view()
        mask = AttentionMask.filled(jnp.asarray(lengths), keys.shape[-1])
        out = _cached_attention(jnp.asarray(q, jnp.float32), keys, values, mask, scale)
    else:
        out = cache.attend(jnp.asarray(q, jnp.float32), jnp.asarray(lengths), scale)
    for b in OWNED:
        n = lengths[b]
        qb = q[b, 0].reshape(HEADS, 2, DIM)  # query heads 2h, 2h + 1 read KV head h
        scores = np.einsum("kgd,skd->kgs", qb, dense_k[b, :n]) * scale
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        want = np.einsum("kgs,skd->kgd", probs, dense_v[b, :n]).reshape(4, DIM)
        np.testing.assert_allclose(np.asarray(out)[b, 0], want, atol=2e-5)


def test_whole_pages_land_in_one_pool_and_the_others_trash_page():
    rng = np.random.default_rng(1)
    pools = jnp.zeros((2, 2, 5, 4, 3))
    k, v = rng.normal(size=(2, 2, 2, 4, 3))  # [K, n, page, D]
    new_k, new_v = write_pages(pools, pools, jnp.asarray(k), jnp.asarray(v),
                               jnp.asarray([[0, 0], [3, 1]]))  # pool 1's pages 3 and 1
    np.testing.assert_allclose(np.asarray(new_k)[1][:, [3, 1]], k, atol=1e-6)
    np.testing.assert_allclose(np.asarray(new_v)[1][:, [3, 1]], v, atol=1e-6)
    assert not np.asarray(new_k)[0, :, 1:].any() and not np.asarray(new_k)[1][:, [0, 2, 4]].any()


def test_auto_picks_a_kernel_only_where_the_backend_has_one_that_fits_the_shapes():
    assert default_kernel(128, 64, "tpu") == "tpu" and default_kernel(64, 64, "tpu") == "gather"
    assert default_kernel(128, 64, "cuda") == "gpu" and default_kernel(128, 8, "gpu") == "gather"
    assert default_kernel(128, 64, "cpu") == "gather"
