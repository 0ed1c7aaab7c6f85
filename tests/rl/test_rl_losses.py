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
    k3 = np.exp(-d) + d - 1.0
    return {"k1": d, "k2": 0.5 * d**2, "k3": k3, "k3+": k3}[kind]


def np_aggregate(x, mask, mode, max_len=None, kept=None):
    """One aggregation of x over mask; `kept` (default mask) zeroes tokens in the numerator only."""
    kept = mask if kept is None else kept
    if mode == "token-mean":
        return (x * kept).sum() / mask.sum()
    rows = [(x[b] * kept[b]).sum() for b in range(len(x))]
    nonempty = [b for b in range(len(x)) if mask[b].sum() > 0]
    if mode == "seq-mean-token-mean":
        return sum(rows[b] / mask[b].sum() for b in nonempty) / len(nonempty)
    return sum(rows) / len(nonempty) / max_len


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


@pytest.mark.parametrize("kind", L.KL_ESTIMATORS)
def test_kl_estimator_expected_gradients(x64, kind):
    """E_{a~pi}[d k(a) / d theta] for a categorical pi = softmax(theta), enumerated exactly,
    against the hand-derived gradients: k1 -> 0, k2 and k3+ -> grad KL(pi||ref), k3 -> grad
    KL(ref||pi) (d/dtheta KL(pi||ref) = pi (log pi - log ref - KL); KL(ref||pi) -> pi - ref)."""
    rng = np.random.default_rng(21)
    theta, ref_logits = rng.normal(0, 1.0, 6), rng.normal(0, 1.0, 6)
    log_ref = ref_logits - np.log(np.exp(ref_logits).sum())

    def expected(th):
        logp = jax.nn.log_softmax(th)
        per_action = L.kl_penalty(logp, jnp.array(log_ref), kind)  # k(a) for every action a
        return jnp.sum(jax.lax.stop_gradient(jnp.exp(logp)) * per_action)

    got = np.asarray(jax.grad(expected)(jnp.array(theta)))
    pi = np.exp(theta - np.log(np.exp(theta).sum()))
    reverse = pi * (np.log(pi) - log_ref - np.sum(pi * (np.log(pi) - log_ref)))
    want = {"k1": np.zeros(6), "k2": reverse, "k3+": reverse, "k3": pi - np.exp(log_ref)}[kind]
    np.testing.assert_allclose(got, want, atol=1e-12)


# ---------------------------------------------------------------- aggregation

def _aggregate(x, mask, mode, max_len=None):
    return jnp.sum(x * L.token_weights(mask, mode, max_len))


@pytest.mark.parametrize("mode,max_len", [("token-mean", None), ("seq-mean-token-mean", None),
                                          ("seq-mean-token-sum-norm", 32)])
def test_aggregation_modes(x64, mode, max_len):
    x, _, _, mask = _batch(9)
    x = x + 100.0 * (1 - mask)  # garbage on padding must not leak
    got = _aggregate(jnp.array(x), jnp.array(mask), mode, max_len)
    np.testing.assert_allclose(got, np_aggregate(x, mask, mode, max_len), rtol=1e-12)


def test_aggregation_modes_differ_by_hand():
    x = jnp.array([[1.0, 1.0, 1.0, 1.0], [4.0, 0.0, 0.0, 0.0]])
    m = jnp.array([[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    assert float(_aggregate(x, m, "token-mean")) == pytest.approx(8 / 5)
    assert float(_aggregate(x, m, "seq-mean-token-mean")) == pytest.approx((1 + 4) / 2)
    assert float(_aggregate(x, m, "seq-mean-token-sum-norm", 8)) == pytest.approx((4 + 4) / 2 / 8)
    with pytest.raises(ValueError, match="max_response_len"):  # never the padded length
        _aggregate(x, m, "seq-mean-token-sum-norm")


def test_token_weights_ignore_empty_rows_and_sum_to_one_by_hand():
    m = jnp.array([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0]])  # row 1: padding
    np.testing.assert_allclose(L.token_weights(m, "token-mean"), m / 3)
    np.testing.assert_allclose(L.token_weights(m, "seq-mean-token-mean"),
                               [[0.25, 0.25, 0], [0, 0, 0], [0.5, 0, 0]])
    np.testing.assert_allclose(L.token_weights(m, "seq-mean-token-sum-norm", 4),
                               np.asarray(m) / 8)
    # Leading axes are rows too: [M, b, T] gives the same weights as the flat [M * b, T].
    stacked = jnp.stack([m, m])
    np.testing.assert_allclose(L.token_weights(stacked, "seq-mean-token-mean").reshape(6, 3),
                               L.token_weights(stacked.reshape(6, 3), "seq-mean-token-mean"))


# ---------------------------------------------------------------- behaviour weights

def test_behaviour_weights_truncate_and_stop_gradient(x64):
    new, old, _, _ = _batch(10, spread=1.0)
    sampler = old + np.random.default_rng(11).normal(0, 0.5, (B, T))
    w = L.behaviour_weights(jnp.array(old), jnp.array(sampler), 1.5)
    np.testing.assert_allclose(w, np.minimum(np.exp(old - sampler), 1.5), rtol=1e-12)
    assert np.any(np.asarray(w) == 1.5) and np.any(np.asarray(w) < 1.0)
    g_old, g_s = jax.grad(lambda o, s: jnp.sum(L.behaviour_weights(o, s, 1.5)), argnums=(0, 1))(
        jnp.array(old), jnp.array(sampler))
    assert not np.any(np.asarray(g_old)) and not np.any(np.asarray(g_s))


@pytest.mark.parametrize("decoupled", [False, True])
def test_ppo_surrogate_on_a_categorical_policy_matches_numpy(x64, decoupled):
    """A tiny categorical policy (hand-set logits per position): per-token losses, clip masks and
    the gradient w.r.t. the logits against a float64 numpy derivation:
    d loss / d theta_t = w_t bw_t (-A r_t) (onehot(a_t) - pi_t) where no clip acts, else 0."""
    theta = np.array([[2.5, 0.0, -1.0], [0.5, 0.5, 0.0], [-1.0, 1.0, 0.2], [0.0, 0.3, 0.0]])
    theta_old = np.array([[1.0, 0.0, -1.0], [0.5, 0.9, 0.0], [-1.0, 0.2, 0.2], [0.0, 0.3, 0.4]])
    theta_behav = theta_old + np.array([[0.3, 0, 0], [0, -0.4, 0], [0, 0, 0.5], [0.2, 0, 0]])
    actions = np.array([0, 1, 1, 2])
    adv = np.array([1.0, -1.0])  # row 0: positions 0, 1; row 1: positions 2, 3
    rows = lambda x: x.reshape(2, 2)  # noqa: E731
    logsm = lambda z: z - np.log(np.exp(z).sum(-1, keepdims=True))  # noqa: E731
    pick = lambda z: logsm(z)[np.arange(4), actions]  # noqa: E731
    old, behav = pick(theta_old), pick(theta_behav)
    cfg = L.LossConfig(clip_low=0.2, clip_high=0.28, aggregation="seq-mean-token-mean",
                       behaviour_weight_cap=1.2 if decoupled else None)
    mask = np.ones((2, 2))

    def loss_fn(th):
        logp = jnp.take_along_axis(jax.nn.log_softmax(th), jnp.array(actions)[:, None], 1)[:, 0]
        return L.policy_loss(rows(logp), jnp.array(rows(old)), jnp.array(adv), jnp.array(mask),
                             cfg, behaviour_logprobs=jnp.array(rows(behav)) if decoupled else None)

    (loss, metrics), grad = jax.value_and_grad(loss_fn, has_aux=True)(jnp.array(theta))
    r = np.exp(pick(theta) - old)
    a = np.repeat(adv, 2)
    bw = np.minimum(np.exp(old - behav), 1.2) if decoupled else np.ones(4)
    clipped = ((a > 0) & (r > 1.28)) | ((a < 0) & (r < 0.8))
    assert clipped.any() and not clipped.all()  # the hand-set logits reach both regimes
    per_token = bw * np.maximum(-a * r, -a * np.clip(r, 0.8, 1.28))
    w = np.full(4, 0.25)  # seq-mean-token-mean: 2 rows of 2 tokens
    np.testing.assert_allclose(loss, np.sum(w * per_token), rtol=1e-12)
    pi = np.exp(logsm(theta))
    want = (w * bw * -a * r * ~clipped)[:, None] * (np.eye(3)[actions] - pi)
    np.testing.assert_allclose(grad, want, atol=1e-12)
    np.testing.assert_allclose(metrics["clip_frac_high"], np.mean((a > 0) & (r > 1.28)))
    np.testing.assert_allclose(metrics["clip_frac_low"], np.mean((a < 0) & (r < 0.8)))
    np.testing.assert_allclose(metrics["ratio_mean"], r.mean(), rtol=1e-12)


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


# ---------------------------------------------------------------- policy_loss

def np_policy_loss(new, old, adv, mask, cfg, ref=None, sampler=None, entropy=None):
    per = np_surrogate(new, old, adv, cfg.clip_low, cfg.clip_high, cfg.clip_c)
    if cfg.behaviour_weight_cap is not None:
        per = per * np.minimum(np.exp(old - sampler), cfg.behaviour_weight_cap)
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
    return (np_aggregate(per, mask, cfg.aggregation, cfg.max_response_len, loss_mask),
            np_aggregate(pg, mask, cfg.aggregation, cfg.max_response_len, loss_mask), loss_mask)


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
    L.LossConfig(aggregation="token-mean", behaviour_weight_cap=None),
    L.LossConfig(clip_c=3.0, kl_coef=0.05, kl_estimator="k1", aggregation="seq-mean-token-mean",
                 behaviour_weight_cap=None),
    L.LossConfig(kl_coef=0.1, kl_estimator="k2", aggregation="seq-mean-token-sum-norm",
                 max_response_len=16, behaviour_weight_cap=2.0),
    L.LossConfig(kl_coef=0.1, kl_estimator="k3+", aggregation="token-mean",
                 behaviour_weight_cap=1.2, mastered_mask_prob=0.99, target_entropy=5.0,
                 entropy_coef=0.01),
    L.LossConfig(aggregation="token-mean", behaviour_weight_cap=None, mastered_mask_prob=0.99,
                 target_entropy=0.01),  # entropy above target: off
], ids=["default", "token-mean", "dual-k1-seqmean", "k2-sumnorm-decoupled", "all-on",
        "mask-gated-off"])
def test_policy_loss_matches_numpy(x64, cfg):
    new, old, adv, mask, ref, sampler, entropy = _full_inputs()
    fn = jax.jit(L.policy_loss, static_argnames="config")
    loss, metrics = fn(jnp.array(new), jnp.array(old), jnp.array(adv), jnp.array(mask), cfg,
                       ref_logprobs=jnp.array(ref) if cfg.kl_coef else None,
                       behaviour_logprobs=jnp.array(sampler), entropy=jnp.array(entropy))
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
    assert ("behaviour_weight_mean" in metrics) == (cfg.behaviour_weight_cap is not None)
    if cfg.mastered_mask_prob is not None and cfg.target_entropy > 1.0:
        assert float(metrics["masked_frac"]) > 0
    if cfg.kl_coef:
        np.testing.assert_allclose(metrics["kl"], mean(np_kl(new, ref, cfg.kl_estimator)), rtol=1e-12)


def test_policy_loss_gradient_respects_masks(x64):
    new, old, adv, mask, *_ = _full_inputs()
    cfg = L.LossConfig(aggregation="token-mean", mastered_mask_prob=0.99)
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
    with pytest.raises(ValueError, match="entropy"):
        L.policy_loss(z, z, adv, z, L.LossConfig(mastered_mask_prob=0.9, target_entropy=0.3))
    for bad in [dict(kl_estimator="k4"), dict(aggregation="sum"), dict(clip_c=0.5),
                dict(behaviour_weight_cap=0.0), dict(aggregation="seq-mean-token-sum-norm")]:
        with pytest.raises(ValueError):
            L.LossConfig(**bad)
    assert not L.LossConfig().needs_ref_logprobs and L.LossConfig(kl_coef=0.1).needs_ref_logprobs
    with pytest.raises(dataclasses.FrozenInstanceError):
        L.LossConfig().kl_coef = 1.0  # type: ignore[misc]
