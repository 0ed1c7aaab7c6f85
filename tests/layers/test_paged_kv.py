"""PagedKVCache against a dense numpy cache written position by position."""
import jax.numpy as jnp
import numpy as np

from mars_jax.layers.paged_kv import PagedKVCache, write_pages


def test_writes_and_views_match_a_dense_cache_and_unowned_entries_hit_the_trash_page():
    rng = np.random.default_rng(0)
    heads, dim, page = 2, 4, 4
    # Two pools of 6 pages (rows 0-1 in pool 0, rows 2-3 in pool 1). Row 0 owns pages 5, 1, 3
    # (12 positions); row 1 owns none; row 2 owns pool 1's 2 and 4 (8 positions; its third
    # entry is the trash page 0); row 3 owns pool 1's 5, 1, 3: the same ids as row 0's.
    table = np.array([[5, 1, 3], [0, 0, 0], [2, 4, 0], [5, 1, 3]], np.int32)
    cache = PagedKVCache(jnp.zeros((2, 6, heads, dim, page)), jnp.zeros((2, 6, heads, page, dim)),
                         jnp.asarray(table))
    dense_k, dense_v = np.zeros((4, heads, dim, 12)), np.zeros((4, heads, 12, dim))
    for position in (0, 3, 4, 7, 9, 11):
        k, v = rng.normal(size=(2, 4, 1, heads, dim))
        index = np.array([position, position, min(position, 7), position])
        cache = cache.write(jnp.asarray(k), jnp.asarray(v), jnp.asarray(index))
        for b in (0, 2, 3):
            dense_k[b, :, :, index[b]], dense_v[b, :, index[b]] = k[b, 0], v[b, 0]
        trash = k[1, 0], v[1, 0], position % page  # row 1's write: pool 0's trash page
    keys, values = map(np.asarray, cache.view())
    for b, owned in ((0, 12), (2, 8), (3, 12)):
        np.testing.assert_allclose(keys[b, ..., :owned], dense_k[b, ..., :owned], atol=1e-6)
        np.testing.assert_allclose(values[b, :, :owned], dense_v[b, :, :owned], atol=1e-6)
    k1, v1, offset = trash
    np.testing.assert_allclose(np.asarray(cache.k)[0, 0, :, :, offset], k1, atol=1e-6)
    np.testing.assert_allclose(np.asarray(cache.v)[0, 0, :, offset], v1, atol=1e-6)


def test_whole_pages_land_in_one_pool_and_the_others_trash_page():
    rng = np.random.default_rng(1)
    pool_k, pool_v = jnp.zeros((2, 5, 2, 3, 4)), jnp.zeros((2, 5, 2, 4, 3))
    k, v = rng.normal(size=(2, 2, 3, 4)), rng.normal(size=(2, 2, 4, 3))
    new_k, new_v = write_pages(pool_k, pool_v, jnp.asarray(k), jnp.asarray(v),
                               jnp.asarray([[0, 0], [3, 1]]))  # pool 1's pages 3 and 1
    np.testing.assert_allclose(np.asarray(new_k)[1, [3, 1]], k, atol=1e-6)
    np.testing.assert_allclose(np.asarray(new_v)[1, [3, 1]], v, atol=1e-6)
    assert not np.asarray(new_k)[0, 1:].any() and not np.asarray(new_k)[1, [0, 2, 4]].any()
