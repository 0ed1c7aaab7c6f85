"""mars_jax.rl.losses against independent float64 numpy references."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mars_jax.rl import losses as L

B, T = 6, 9


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


def _batch(seed=0, spread=0.6):
    """Random float64 inputs; log-ratios span both clip sides."""
    rng = np.random.default_rng(seed)
    old = -rng.uniform(0.05, 3.0, (B, T))
    new = old + rng.uniform(-spread, spread, (B, T))
    adv = rng.choice([-1.0, 1.0], B) * rng.uniform(0.3, 1.5, B)
    mask = np.ones((B, T))
    for b, n in enumerate([9, 5, 1, 7, 0, 3]):
        mask[b, n:] = 0.0
    return new, old, adv, mask


# ---------------------------------------------------------------- numpy references

def np_surrogate(new, old, adv, lo, hi, c=None):
    a = adv[:, None] if adv.ndim == 1 else adv
    r = np.exp(new - old)
    loss = np.maximum(-a * r, -a * np.clip(r, 1 - lo, 1 + hi))
    if c is not None:
        loss = np.where(a < 0, np.minimum(loss, -a * c), loss)
    return loss


def np_kl(new, ref, kind):
    d = new - ref  # log p - log p_ref
    return {"k1": d, "k2": 0.5 * d**2, "k3": np.exp(-d) + d - 1.0}[kind]


def np_aggregate(x, mask, mode, max_len=None):
    if mode == "token-mean":
        return (x * mask).sum() / mask.sum()
    rows = [(x[b] * mask[b]).sum() for b in range(len(x))]
    if mode == "seq-mean-token-mean":
        means = [rows[b] / mask[b].sum() for b in range(len(x)) if mask[b].sum() > 0]
        return sum(means) / len(means)
    return sum(rows) / len(rows) / (max_len or x.shape[1])


def np_entropy(logits):
    z = logits - logits.max(-1, keepdims=True)
    p = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
    return -(p * np.log(p)).sum(-1)


# ---------------------------------------------------------------- surrogate

@pytest.mark.parametrize("clip_c", [None, 3.0])
@pytest.mark.parametrize("adv_2d", [False, True])
def test_surrogate_matches_numpy(x64, clip_c, adv_2d):
    new, old, adv, _ = _batch(1, spread=1.5)
    if adv_2d:
        adv = adv[:, None] * np.random.default_rng(2).uniform(0.5, 1.5, (B, T))
    out = L.clipped_surrogate(jnp.array(new), jnp.array(old), jnp.array(adv),
                              clip_low=0.2, clip_high=0.28, clip_c=clip_c)
    assert out.loss.dtype == jnp.float64
    np.testing.assert_allclose(out.loss, np_surrogate(new, old, adv, 0.2, 0.28, clip_c), rtol=1e-12)
    np.testing.assert_allclose(out.ratio, np.exp(new - old), rtol=1e-12)


def test_surrogate_float32_close_to_float64_reference():
    new, old, adv, _ = _batch(3)
    out = L.clipped_surrogate(jnp.array(new, jnp.float32), jnp.array(old, jnp.float32),
                              jnp.array(adv, jnp.float32), clip_low=0.2, clip_high=0.28)
    assert out.loss.dtype == jnp.float32
    np.testing.assert_allclose(out.loss, np_surrogate(new, old, adv, 0.2, 0.28), rtol=2e-5, atol=1e-6)


def test_surrogate_gradient_zero_exactly_where_clipped(x64):
    new, old, adv, _ = _batch(4, spread=0.8)
    lo, hi = 0.2, 0.28
    grad = jax.grad(lambda lp: jnp.sum(L.clipped_surrogate(
        lp, jnp.array(old), jnp.array(adv), clip_low=lo, clip_high=hi).loss))(jnp.array(new))
    grad = np.asarray(grad)
    a, r = adv[:, None] * np.ones((B, T)), np.exp(new - old)
    active = ((a > 0) & (r > 1 + hi)) | ((a < 0) & (r < 1 - lo))
    inactive_outside = ((a > 0) & (r < 1 - lo)) | ((a < 0) & (r > 1 + hi))
    assert active.sum() > 0 and inactive_outside.sum() > 0 and (~active).sum() > 0
    assert np.all(grad[active] == 0.0)
    assert np.all(grad[~active] != 0.0)
    # d(-A r)/d logp = -A r wherever the clip is inactive (including outside the range).
    np.testing.assert_allclose(grad[~active], (-a * r)[~active], rtol=1e-12)


def test_dual_clip_caps_negative_advantages(x64):
    new, old, adv, _ = _batch(5, spread=2.0)
    c = 2.0
    a, r = adv[:, None] * np.ones((B, T)), np.exp(new - old)
    dual = (a < 0) & (r > c)
    assert dual.sum() > 0 and ((a > 0) & (r > c)).sum() > 0

    def f(lp, clip_c):
        return L.clipped_surrogate(lp, jnp.array(old), jnp.array(adv),
                                   clip_low=0.2, clip_high=0.28, clip_c=clip_c)

    with_c, without_c = f(jnp.array(new), c), f(jnp.array(new), None)
    np.testing.assert_allclose(np.asarray(with_c.loss)[dual], (-a * c)[dual], rtol=1e-12)
    assert np.all(np.asarray(without_c.loss)[dual] > np.asarray(with_c.loss)[dual])
    np.testing.assert_array_equal(np.asarray(with_c.loss)[~dual], np.asarray(without_c.loss)[~dual])
    np.testing.assert_array_equal(with_c.dual_clipped, dual)
    grad = np.asarray(jax.grad(lambda lp: jnp.sum(f(lp, c).loss))(jnp.array(new)))
    assert np.all(grad[dual] == 0.0)
    assert np.all(grad[(a > 0) & (r > c)] == 0.0)  # positive side: ordinary high clip


# ---------------------------------------------------------------- KL

@pytest.mark.parametrize("kind", L.KL_ESTIMATORS)
def test_kl_estimators_match_formula(x64, kind):
    new, _, _, _ = _batch(6)
    ref = new + np.random.default_rng(7).normal(0, 0.7, (B, T))
    got = L.kl_penalty(jnp.array(new), jnp.array(ref), kind)
    np.testing.assert_allclose(got, np_kl(new, ref, kind), rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("kind", ["k1", "k3"])
def test_unbiased_kl_estimators_average_to_exact_kl(x64, kind):
    rng = np.random.default_rng(8)
    p, q = rng.dirichlet(np.ones(7)), rng.dirichlet(np.ones(7))
    exact = np.sum(p * np.log(p / q))
    est = np.asarray(L.kl_penalty(jnp.log(jnp.array(p)), jnp.log(jnp.array(q)), kind))
    np.testing.assert_allclose(np.sum(p * est), exact, rtol=1e-10)
    if kind == "k3":
        assert np.all(est >= 0)


def test_kl_unknown_estimator():
    with pytest.raises(ValueError, match="k1"):
        L.kl_penalty(jnp.zeros(2), jnp.zeros(2), "k4")


# ---------------------------------------------------------------- aggregation

@pytest.mark.parametrize("mode,max_len", [("token-mean", None), ("seq-mean-token-mean", None),
                                          ("seq-mean-token-sum-norm", None),
                                          ("seq-mean-token-sum-norm", 32)])
def test_aggregation_modes(x64, mode, max_len):
    x, _, _, mask = _batch(9)
    x = x + 100.0 * (1 - mask)  # garbage on padding must not leak
    got = L.aggregate_loss(jnp.array(x), jnp.array(mask), mode, max_len)
    np.testing.assert_allclose(got, np_aggregate(x, mask, mode, max_len), rtol=1e-12)


def test_aggregation_modes_differ_by_hand():
    x = jnp.array([[1.0, 1.0, 1.0, 1.0], [4.0, 0.0, 0.0, 0.0]])
    m = jnp.array([[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    assert float(L.aggregate_loss(x, m, "token-mean")) == pytest.approx(8 / 5)
    assert float(L.aggregate_loss(x, m, "seq-mean-token-mean")) == pytest.approx((1 + 4) / 2)
    assert float(L.aggregate_loss(x, m, "seq-mean-token-sum-norm")) == pytest.approx((4 + 4) / 2 / 4)
    assert float(L.aggregate_loss(x, m, "seq-mean-token-sum-norm", 8)) == pytest.approx((4 + 4) / 2 / 8)


# ---------------------------------------------------------------- TIS

def test_tis_weights_truncate_and_stop_gradient(x64):
    new, old, _, _ = _batch(10, spread=1.0)
    sampler = old + np.random.default_rng(11).normal(0, 0.5, (B, T))
    w = L.tis_weights(jnp.array(old), jnp.array(sampler), 1.5)
    np.testing.assert_allclose(w, np.minimum(np.exp(old - sampler), 1.5), rtol=1e-12)
    assert np.any(np.asarray(w) == 1.5) and np.any(np.asarray(w) < 1.0)
    g_old, g_s = jax.grad(lambda o, s: jnp.sum(L.tis_weights(o, s, 1.5)), argnums=(0, 1))(
        jnp.array(old), jnp.array(sampler))
    assert not np.any(np.asarray(g_old)) and not np.any(np.asarray(g_s))


# ---------------------------------------------------------------- mastered-token mask

def _mastered_inputs():
    probs = np.array([[0.995, 0.5, 0.999, 0.2], [0.999, 0.999, 0.1, 0.998], [0.999, 0.3, 0.999, 0.9]])
    mask = np.array([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1]], dtype=np.float64)
    positive = np.array([True, False, True])
    return np.log(probs), mask, positive


@pytest.mark.parametrize("entropy,active", [(0.1, True), (0.9, False)])
def test_mastered_mask_gated_by_entropy(x64, entropy, active):
    logp, mask, positive = _mastered_inputs()
    new_mask, frac = L.mastered_token_mask(jnp.array(logp), jnp.array(mask), jnp.array(positive),
                                           0.99, jnp.array(entropy), target_entropy=0.5)
    expected = mask.copy()
    if active:  # positive rows 0 and 2, prob > .99: (0,0), (0,2), (2,0), (2,2); row 1 is negative
        expected[[0, 0, 2, 2], [0, 2, 0, 2]] = 0.0
    np.testing.assert_array_equal(new_mask, expected)
    assert float(frac) == pytest.approx(4 / 11 if active else 0.0)


def test_mastered_mask_without_target_is_always_on(x64):
    logp, mask, positive = _mastered_inputs()
    new_mask, frac = L.mastered_token_mask(jnp.array(logp), jnp.array(mask), jnp.array(positive), 0.99)
    assert float(np.sum(mask - np.asarray(new_mask))) == 4.0 and float(frac) == pytest.approx(4 / 11)
    with pytest.raises(ValueError, match="batch_entropy"):
        L.mastered_token_mask(jnp.array(logp), jnp.array(mask), jnp.array(positive), 0.99,
                              target_entropy=0.5)


# ---------------------------------------------------------------- entropy

def test_token_entropy_matches_numpy(x64):
    logits = np.random.default_rng(12).normal(0, 3.0, (B, T, 50))
    np.testing.assert_allclose(L.token_entropy(jnp.array(logits)), np_entropy(logits), rtol=1e-6)
    got32 = L.token_entropy(jnp.array(logits, jnp.bfloat16))
    assert got32.dtype == jnp.float32
    np.testing.assert_allclose(got32, np_entropy(np.asarray(jnp.array(logits, jnp.bfloat16), np.float64)),
                               rtol=1e-5)
    assert float(L.token_entropy(jnp.zeros((1, 50)))[0]) == pytest.approx(np.log(50))


# ---------------------------------------------------------------- policy_loss

def np_policy_loss(new, old, adv, mask, cfg, ref=None, sampler=None, entropy=None, logits_ent_mean=None):
    per = np_surrogate(new, old, adv, cfg.clip_low, cfg.clip_high, cfg.clip_c)
    if cfg.tis_cap is not None:
        per = per * np.minimum(np.exp(old - sampler), cfg.tis_cap)
    pg = per
    if cfg.kl_coef > 0:
        per = per + cfg.kl_coef * np_kl(new, ref, cfg.kl_estimator)
    if cfg.entropy_coef > 0:
        per = per - cfg.entropy_coef * entropy
    loss_mask = mask.copy()
    if cfg.mastered_mask_prob is not None:
        ent = (entropy * mask).sum() / mask.sum()
        if cfg.target_entropy is None or ent < cfg.target_entropy:
            pos = (adv > 0)[:, None] & (np.exp(new) > cfg.mastered_mask_prob)
            loss_mask = np.where(pos, 0.0, mask)
    return (np_aggregate(per, loss_mask, cfg.aggregation, cfg.max_response_len),
            np_aggregate(pg, loss_mask, cfg.aggregation, cfg.max_response_len), loss_mask)


def _full_inputs(seed=13):
    new, old, adv, mask = _batch(seed, spread=1.0)
    new = np.minimum(new, -1e-4)
    new[0, :4] = np.log(0.999)  # mastered candidates in a positive row
    adv[0] = abs(adv[0])
    rng = np.random.default_rng(seed)
    ref = new + rng.normal(0, 0.3, (B, T))
    sampler = old + rng.normal(0, 0.3, (B, T))
    entropy = rng.uniform(0.0, 2.0, (B, T))
    return new, old, adv, mask, ref, sampler, entropy


@pytest.mark.parametrize("cfg", [
    L.LossConfig(),
    L.LossConfig(clip_c=3.0, kl_coef=0.05, kl_estimator="k1", aggregation="seq-mean-token-mean"),
    L.LossConfig(kl_coef=0.1, kl_estimator="k2", aggregation="seq-mean-token-sum-norm",
                 max_response_len=16, tis_cap=2.0),
    L.LossConfig(kl_coef=0.1, tis_cap=1.2, mastered_mask_prob=0.99, target_entropy=5.0,
                 entropy_coef=0.01),
    L.LossConfig(mastered_mask_prob=0.99, target_entropy=0.01),  # entropy above target: off
], ids=["default", "dual-k1-seqmean", "k2-sumnorm-tis", "all-on", "mask-gated-off"])
def test_policy_loss_matches_numpy(x64, cfg):
    new, old, adv, mask, ref, sampler, entropy = _full_inputs()
    fn = jax.jit(L.policy_loss, static_argnames="config")
    loss, metrics = fn(jnp.array(new), jnp.array(old), jnp.array(adv), jnp.array(mask), cfg,
                       ref_logprobs=jnp.array(ref) if cfg.kl_coef else None,
                       sampler_logprobs=jnp.array(sampler), entropy=jnp.array(entropy))
    want, want_pg, loss_mask = np_policy_loss(new, old, adv, mask, cfg, ref, sampler, entropy)
    np.testing.assert_allclose(loss, want, rtol=1e-12)
    np.testing.assert_allclose(metrics["loss"], want, rtol=1e-12)
    np.testing.assert_allclose(metrics["pg_loss"], want_pg, rtol=1e-12)

    n = mask.sum()
    a, r = adv[:, None], np.exp(new - old)
    mean = lambda v: (v * mask).sum() / n  # noqa: E731
    np.testing.assert_allclose(metrics["clip_frac_low"], mean((a < 0) & (r < 1 - cfg.clip_low)))
    np.testing.assert_allclose(metrics["clip_frac_high"], mean((a > 0) & (r > 1 + cfg.clip_high)))
    np.testing.assert_allclose(metrics["ratio_mean"], mean(r), rtol=1e-12)
    np.testing.assert_allclose(metrics["approx_kl"], mean(r - 1 - np.log(r)), rtol=1e-12)
    np.testing.assert_allclose(metrics["entropy"], mean(entropy), rtol=1e-12)
    np.testing.assert_allclose(metrics["masked_frac"], (mask - loss_mask).sum() / n, rtol=1e-12)
    assert ("kl" in metrics) == (cfg.kl_coef > 0)
    assert ("tis_weight_mean" in metrics) == (cfg.tis_cap is not None)
    if cfg.mastered_mask_prob is not None and cfg.target_entropy > 1.0:
        assert float(metrics["masked_frac"]) > 0
    if cfg.kl_coef:
        np.testing.assert_allclose(metrics["kl"], mean(np_kl(new, ref, cfg.kl_estimator)), rtol=1e-12)


def test_policy_loss_gradient_respects_masks(x64):
    new, old, adv, mask, *_ = _full_inputs()
    cfg = L.LossConfig(mastered_mask_prob=0.99)
    grad = jax.grad(lambda lp: L.policy_loss(lp, jnp.array(old), jnp.array(adv),
                                             jnp.array(mask), cfg)[0])(jnp.array(new))
    grad = np.asarray(grad)
    assert np.all(grad[mask == 0] == 0.0)
    assert np.all(grad[0, :4] == 0.0)  # mastered positive tokens
    assert np.count_nonzero(grad) > 0


def test_policy_loss_requires_inputs_and_validates_config():
    z = jnp.zeros((2, 3))
    adv = jnp.ones(2)
    with pytest.raises(ValueError, match="ref_logprobs"):
        L.policy_loss(z, z, adv, z, L.LossConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="sampler_logprobs"):
        L.policy_loss(z, z, adv, z, L.LossConfig(tis_cap=2.0))
    with pytest.raises(ValueError, match="entropy"):
        L.policy_loss(z, z, adv, z, L.LossConfig(mastered_mask_prob=0.9, target_entropy=0.3))
    for bad in [dict(kl_estimator="k4"), dict(aggregation="sum"), dict(clip_c=0.5), dict(tis_cap=0.0)]:
        with pytest.raises(ValueError):
            L.LossConfig(**bad)
    assert not L.LossConfig().needs_ref_logprobs and L.LossConfig(kl_coef=0.1).needs_ref_logprobs
    with pytest.raises(dataclasses.FrozenInstanceError):
        L.LossConfig().kl_coef = 1.0  # type: ignore[misc]


def test_token_entropy_materialises_no_vocab_sized_temporary():
    shape = (2, 64, 4096)
    compiled = jax.jit(L.token_entropy).lower(jax.ShapeDtypeStruct(shape, jnp.float32)).compile()
    analysis = compiled.memory_analysis()
    if analysis is None:
        pytest.skip("backend reports no memory analysis")
    assert analysis.temp_size_in_bytes < 4 * np.prod(shape) // 100
