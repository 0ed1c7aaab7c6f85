"""Blockwise attention and the dense kernel by causal blocks against a float64 numpy reference,
the dense kernel's gradients, and in memory that does not grow with T x S; which kernel 'auto'
runs."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mars_jax.layers import attention
from mars_jax.layers.attention import causal_blocks, dot_product_attention, self_attention
from mars_jax.layers.attention_mask import AttentionMask
from mars_jax.layers.embeddings import rope_cos_sin
from mars_jax.layers.flash_attention import flash_attention

BATCH, HEADS, KV_HEADS, DIM = 2, 4, 2, 8


def reference(q, k, v, allowed, scale):
    """float64 softmax attention with GQA, written from the definition."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    groups = HEADS // KV_HEADS
    k, v = np.repeat(k, groups, axis=2), np.repeat(v, groups, axis=2)
    scores = np.einsum("btnd,bsnd->bnts", q, k) * scale
    scores = np.where(allowed[:, None], scores, -np.inf)
    with np.errstate(invalid="ignore"):  # rows with no visible key become NaN; callers skip them
        scores -= scores.max(-1, keepdims=True)
        probs = np.exp(scores)
        probs /= probs.sum(-1, keepdims=True)
    return np.einsum("bnts,bsnd->btnd", probs, v)


def _inputs(t, s, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(BATCH, t, HEADS, DIM)).astype(np.float32)
    k = rng.normal(size=(BATCH, s, KV_HEADS, DIM)).astype(np.float32)
    v = rng.normal(size=(BATCH, s, KV_HEADS, DIM)).astype(np.float32)
    return q, k, v


def _padded(t, left, right):
    mask = np.ones((BATCH, t), np.int32)
    mask[0, :left] = 0
    mask[1, t - right:] = 0
    return jnp.asarray(mask)


def _segments(t):
    seg = np.ones((BATCH, t), np.int32)
    seg[:, t // 3:] = 2
    seg[1, 2 * t // 3:] = 3
    seg[1, t - 4:] = 0
    return jnp.asarray(seg)


MASKS = {
    # name: (queries, keys, mask)
    "left_and_right_padding": (37, 37, lambda: AttentionMask.causal(_padded(37, 5, 6))),
    "prefill_into_cache": (37, 57, lambda: AttentionMask.causal(_padded(37, 5, 0),
                                                                num_extra_keys=20)),
    "queries_at_offset": (9, 40, lambda: AttentionMask(
        q_segments=jnp.ones((BATCH, 9), jnp.int32), kv_segments=jnp.ones((BATCH, 40), jnp.int32),
        offset=jnp.asarray(13, jnp.int32))),
    "packed_segments": (37, 37, lambda: AttentionMask.packed(_segments(37))),
}


@pytest.mark.parametrize("name", sorted(MASKS))
@pytest.mark.parametrize("blocks", [(8, 16), (16, 8), (64, 64)])
def test_forward_matches_float64_reference(name, blocks):
    t, s, make_mask = MASKS[name]
    mask = make_mask()
    q, k, v = _inputs(t, s)
    allowed = np.asarray(mask.dense())
    seen = allowed.any(-1)  # rows with no visible key have no defined value
    out = flash_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), mask, 0.3,
                          block_q=blocks[0], block_k=blocks[1])
    ref = reference(q, k, v, allowed, 0.3)
    np.testing.assert_allclose(np.asarray(out)[seen], ref[seen], atol=2e-6, rtol=1e-6)


@pytest.mark.parametrize("name", sorted(MASKS))
def test_gradients_match_dense_kernel(name):
    t, s, make_mask = MASKS[name]
    mask = make_mask()
    q, k, v = (jnp.asarray(x) for x in _inputs(t, s, seed=1))
    seen = mask.dense().any(-1)
    weights = jnp.asarray(np.random.default_rng(2).normal(size=q.shape), jnp.float32)
    weights = weights * seen[:, :, None, None]

    def loss(kernel):
        return lambda q, k, v: jnp.sum(kernel(q, k, v) * weights)

    dense = loss(lambda q, k, v: dot_product_attention(q, k, v, mask, 0.3))
    flash = loss(lambda q, k, v: flash_attention(q, k, v, mask, 0.3, block_q=8, block_k=16))
    expected = jax.grad(dense, argnums=(0, 1, 2))(q, k, v)
    got = jax.jit(jax.grad(flash, argnums=(0, 1, 2)))(q, k, v)
    for name_, e, g in zip("qkv", expected, got):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), atol=5e-6, err_msg=name_)


def _temp_bytes(kernel, t):
    q, k, v = (jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in _inputs(t, t))
    mask = jax.eval_shape(lambda: AttentionMask.causal(jnp.ones((BATCH, t), jnp.int32)))
    grad = jax.jit(jax.grad(lambda q, k, v, m: jnp.sum(kernel(q, k, v, m)), argnums=(0, 1, 2)))
    return grad.lower(q, k, v, mask).compile().memory_analysis().temp_size_in_bytes


def test_backward_memory_is_linear_in_length():
    """Forward + backward at 4,096 tokens: the dense kernel's temporaries hold the [T, S] scores
    (here 2 x 4 x 4096^2 x 4 B = 512 MiB); the blockwise kernel's stay below 1/20 of that."""
    t = 4096
    scores_bytes = BATCH * HEADS * t * t * 4
    dense = _temp_bytes(lambda q, k, v, m: dot_product_attention(q, k, v, m, 0.3), t)
    flash = _temp_bytes(lambda q, k, v, m: flash_attention(q, k, v, m, 0.3, block_q=256,
                                                             block_k=256), t)
    assert dense >= scores_bytes
    assert flash < scores_bytes / 20


@pytest.mark.parametrize("t", [256, 192, 100])
@pytest.mark.parametrize("make_mask", [lambda t: AttentionMask.causal(_padded(t, 5, 7)),
                                       lambda t: AttentionMask.packed(_segments(t))],
                         ids=["padding", "packed"])
def test_self_attention_by_causal_blocks_matches_float64_reference(t, make_mask):
    """256 and 192 queries run as 4 and 3 blocks of 64, 100 as one (`causal_blocks`)."""
    assert causal_blocks(t) == {256: 4, 192: 3, 100: 1}[t]
    mask = make_mask(t)
    q, k, v = _inputs(t, t, seed=t)
    allowed = np.asarray(mask.dense())
    seen = allowed.any(-1)
    out = self_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), mask, 0.3)
    np.testing.assert_allclose(np.asarray(out)[seen], reference(q, k, v, allowed, 0.3)[seen],
                               atol=2e-6, rtol=1e-6)


@pytest.mark.parametrize("budget, expect_flash", [(None, False), (0, True)],
                         ids=["scores_fit", "over_budget"])
def test_auto_runs_flash_only_when_the_dense_scores_exceed_the_budget(monkeypatch, budget,
                                                                     expect_flash):
    """12 queries over blocks of 4: 'auto' keeps the dense kernel while the `[B, heads, 12, 12]`
    scores fit `AUTO_DENSE_MAX_SCORE_BYTES`, and runs the blockwise one once they do not; both
    give the same output."""
    if budget is not None:
        monkeypatch.setattr(attention, "AUTO_DENSE_MAX_SCORE_BYTES", budget)
    calls = []
    monkeypatch.setattr(attention, "flash_attention",
                        lambda *args, **kw: calls.append(1) or flash_attention(*args, **kw))
    t, hidden = 12, 16
    layer = attention.Attention(hidden=hidden, heads=HEADS, kv_heads=KV_HEADS, head_dim=DIM,
                                bias=False, eps=1e-6, rngs=nnx.Rngs(0), param_dtype=jnp.float32,
                                stddev=0.5, impl="auto", block=4)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(BATCH, t, hidden)), jnp.float32)
    mask = AttentionMask.causal(jnp.ones((BATCH, t), jnp.int32))
    cos, sin = rope_cos_sin(jnp.broadcast_to(jnp.arange(t), (BATCH, t)), DIM, 10000.0)
    out, _ = layer(x, cos, sin, mask)
    assert bool(calls) == expect_flash
    layer.impl = "dense" if expect_flash else "flash"
    other, _ = layer(x, cos, sin, mask)
    np.testing.assert_allclose(np.asarray(out), np.asarray(other), atol=2e-6, rtol=1e-6)


def test_fresh_prefill_attends_over_its_own_keys_by_causal_blocks(monkeypatch):
    """A prompt of 128 left-padded queries written at the static index 0 of a cache with 64
    more slots: the output and cache equal those of the same call at a traced index 0 (which
    reads every cache slot), and the queries run as two causal blocks over their own 128 keys."""
    t, extra, hidden = 128, 64, 16
    layer = attention.Attention(hidden=hidden, heads=HEADS, kv_heads=KV_HEADS, head_dim=DIM,
                                bias=False, eps=1e-6, rngs=nnx.Rngs(0), param_dtype=jnp.float32,
                                stddev=0.5, impl="dense")
    x = jnp.asarray(np.random.default_rng(1).normal(size=(BATCH, t, hidden)), jnp.float32)
    prompt = _padded(t, 5, 0)
    mask = AttentionMask.causal(prompt, num_extra_keys=extra)
    cos, sin = rope_cos_sin(jnp.broadcast_to(jnp.arange(t), (BATCH, t)), DIM, 10000.0)
    empty = attention.KVCache(*(jnp.zeros(shape) for shape, _ in attention.cache_layout(
        BATCH, t + extra, KV_HEADS, DIM)))
    keys_seen = []
    monkeypatch.setattr(attention, "dot_product_attention",
                        lambda q, k, *a: keys_seen.append(k.shape[1])
                        or dot_product_attention(q, k, *a))
    out, cache = layer(x, cos, sin, mask, cache=empty, cache_index=0)
    assert keys_seen == [64, 128]
    full, full_cache = jax.jit(lambda i: layer(x, cos, sin, mask, cache=empty, cache_index=i))(
        jnp.int32(0))
    seen = np.asarray(prompt, bool)
    np.testing.assert_allclose(np.asarray(out)[seen], np.asarray(full)[seen], atol=2e-6, rtol=1e-6)
    for got, want in zip(cache, full_cache):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=1e-6)
