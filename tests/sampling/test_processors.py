"""Empirical token frequencies against the analytically truncated, renormalised distribution."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mars_jax.sampling import choose_tokens

LOGITS = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
DRAWS = 40_000


def _expected(temperature, top_k, top_p):
    """Reference in float64: scale, keep top-k, keep the smallest prefix with mass >= top_p."""
    scaled = LOGITS / temperature
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    order = np.argsort(-probs)
    keep = np.zeros_like(probs, bool)
    mass = 0.0
    for rank, token in enumerate(order):
        if (top_k and rank >= top_k) or mass >= top_p:
            break
        keep[token] = True
        mass += probs[token]
    truncated = np.where(keep, probs, 0.0)
    return truncated / truncated.sum()


@pytest.mark.parametrize("temperature, top_k, top_p", [
    (1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 3, 1.0), (1.0, 0, 0.8), (0.85, 5, 0.9), (1.0, 0, 0.3),
])
def test_frequencies_match_truncated_distribution(temperature, top_k, top_p):
    keys = jax.random.split(jax.random.key(0), DRAWS)
    logits = jnp.broadcast_to(jnp.asarray(LOGITS, jnp.float32), (DRAWS, LOGITS.size))
    tokens, logprobs = jax.jit(choose_tokens, static_argnames=("greedy", "top_k", "top_p"))(
        logits, keys, greedy=False, temperature=jnp.float32(temperature), top_k=top_k, top_p=top_p)
    freq = np.bincount(np.asarray(tokens), minlength=LOGITS.size) / DRAWS
    expected = _expected(temperature, top_k, top_p)
    # 5 standard errors per token, and nothing at all outside the truncated support.
    bound = 5 * np.sqrt(expected * (1 - expected) / DRAWS) + 1e-12
    assert np.all(np.abs(freq - expected) <= bound), (freq, expected)
    assert np.all(freq[expected == 0] == 0)
    # Log-probabilities: temperature-scaled, untruncated (the documented convention).
    scaled = LOGITS / temperature
    log_z = np.log(np.exp(scaled - scaled.max()).sum()) + scaled.max()
    np.testing.assert_allclose(logprobs, (scaled - log_z)[np.asarray(tokens)], atol=1e-5)


def test_greedy_picks_argmax_with_plain_log_softmax():
    logits = jnp.asarray([LOGITS, LOGITS[::-1]], jnp.float32)
    tokens, logprobs = choose_tokens(logits, jax.random.split(jax.random.key(0), 2), greedy=True,
                                     temperature=jnp.float32(1.0), top_k=0, top_p=1.0)
    assert tokens.tolist() == [0, 7]
    log_z = np.log(np.exp(LOGITS).sum())
    np.testing.assert_allclose(logprobs, [LOGITS[0] - log_z] * 2, atol=1e-6)
