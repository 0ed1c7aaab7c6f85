"""PagedKVCache against a dense numpy cache written position by position."""
import jax.numpy as jnp
import numpy as np

from mars_jax.layers.paged_kv import PagedKVCache


def test_writes_and_views_match_a_dense_cache_and_unowned_entries_hit_the_trash_page():
    rng = np.random.default_rng(0)
    heads, dim, page = 2, 4, 4
    # Row 0 owns pages 5, 1, 3 (12 positions); row 1 owns 2, 4 (8; its third entry is the
    # trash page 0); row 2 owns none.
    table = np.array([[5, 1, 3], [2, 4, 0], [0, 0, 0]], np.int32)
    cache = PagedKVCache(jnp.zeros((6, heads, dim, page)), jnp.zeros((6, heads, page, dim)),
                         jnp.asarray(table))
    dense_k, dense_v = np.zeros((2, heads, dim, 12)), np.zeros((2, heads, 12, dim))
    last = None
    for position in (0, 3, 4, 7, 9, 11):
        k, v = rng.normal(size=(2, 3, 1, heads, dim))
        index = np.array([position, min(position, 7), position])
        cache = cache.write(jnp.asarray(k), jnp.asarray(v), jnp.asarray(index))
        for b in (0, 1):
            dense_k[b, :, :, index[b]], dense_v[b, :, index[b]] = k[b, 0], v[b, 0]
        last = k[2, 0], v[2, 0], position % page
    keys, values = map(np.asarray, cache.view())
    np.testing.assert_allclose(keys[0], dense_k[0], atol=1e-6)
    np.testing.assert_allclose(values[0], dense_v[0], atol=1e-6)
    np.testing.assert_allclose(keys[1, ..., :8], dense_k[1, ..., :8], atol=1e-6)
    np.testing.assert_allclose(values[1, :, :8], dense_v[1, :, :8], atol=1e-6)
    k2, v2, offset = last  # row 2's last write landed in the trash page
    np.testing.assert_allclose(np.asarray(cache.k)[0, :, :, offset], k2, atol=1e-6)
    np.testing.assert_allclose(np.asarray(cache.v)[0, :, offset], v2, atol=1e-6)
