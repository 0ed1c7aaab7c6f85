"""Next-token choice from logits: temperature, top-k, top-p, greedy.

A token's log-probability is taken before truncation, `log_softmax(logits / temperature)`, as the
trainer recomputes it.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = -jnp.inf


def check_sampling(temperature: float, top_p: float, top_k: int, vocab_size: int) -> None:
    """Raises ValueError unless temperature >= 0, 0 < top_p <= 1, 0 <= top_k <= vocab_size."""
    if not (temperature >= 0 and 0 < top_p <= 1 and 0 <= top_k <= vocab_size):
        raise ValueError(f"sampling: need temperature >= 0, 0 < top_p <= 1, 0 <= top_k <= "
                         f"vocab ({vocab_size}); got {temperature}, {top_p}, {top_k}")


def truncate_logits(scaled: jax.Array, top_k: int, top_p: float) -> jax.Array:
    """Logits outside the top-k and the smallest nucleus of mass >= top_p set to -inf per row
    (ties with the last kept are kept); `top_k=0`, `top_p=1.0` disable each."""
    if top_k > 0:
        kth = jax.lax.top_k(scaled, top_k)[0][:, -1:]
        scaled = jnp.where(scaled < kth, NEG_INF, scaled)
    if top_p < 1.0:
        sorted_desc = -jnp.sort(-scaled, axis=-1)
        probs = jax.nn.softmax(sorted_desc, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        kept = jnp.where(mass_before < top_p, sorted_desc, jnp.inf)
        threshold = jnp.min(kept, axis=-1, keepdims=True)
        scaled = jnp.where(scaled < threshold, NEG_INF, scaled)
    return scaled


def choose_tokens(logits: jax.Array, keys: jax.Array, *, greedy: bool, temperature: jax.Array,
                  top_k: int, top_p: float) -> tuple[jax.Array, jax.Array]:
    """Chosen tokens `[B]` and their log-probabilities, each row drawn with its own PRNG key."""
    logits = logits.astype(jnp.float32)
    if greedy:
        tokens = jnp.argmax(logits, axis=-1)
        logprobs = jax.nn.log_softmax(logits, axis=-1)
    else:
        scaled = logits / temperature
        logprobs = jax.nn.log_softmax(scaled, axis=-1)
        truncated = truncate_logits(scaled, top_k, top_p)
        tokens = jax.vmap(jax.random.categorical)(keys, truncated)
    chosen = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    return tokens.astype(jnp.int32), chosen


def truncate_logits_per_row(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """`truncate_logits` with a top-k `[B]` and a top-p `[B]` per row; a row with `top_k=0` and
    `top_p=1.0` is returned unchanged, and every row gets the values `truncate_logits` gives it."""
    sorted_desc = -jnp.sort(-scaled, axis=-1)
    kth = jnp.take_along_axis(sorted_desc, jnp.maximum(top_k - 1, 0)[:, None], axis=-1)
    kth = jnp.where(top_k[:, None] > 0, kth, NEG_INF)
    scaled = jnp.where(scaled < kth, NEG_INF, scaled)
    sorted_desc = jnp.where(sorted_desc < kth, NEG_INF, sorted_desc)
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    kept = jnp.where(mass_before < top_p[:, None], sorted_desc, jnp.inf)
    threshold = jnp.min(kept, axis=-1, keepdims=True)
    threshold = jnp.where(top_p[:, None] < 1.0, threshold, NEG_INF)
    return jnp.where(scaled < threshold, NEG_INF, scaled)


def choose_tokens_per_row(logits: jax.Array, keys: jax.Array, *, temperature: jax.Array,
                          top_k: jax.Array, top_p: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`choose_tokens` with settings per row (`[B]` each; temperature 0 = greedy). The sort
    behind top-k / top-p runs only when some row uses them, the draw only when some row samples."""
    logits = logits.astype(jnp.float32)
    greedy = temperature <= 0
    scaled = logits / jnp.where(greedy, 1.0, temperature)[:, None]
    logprobs = jax.nn.log_softmax(scaled, axis=-1)
    truncated = jax.lax.cond(jnp.any((top_k > 0) | (top_p < 1.0)),
                             lambda x: truncate_logits_per_row(x, top_k, top_p), lambda x: x,
                             scaled)
    sampled = jax.lax.cond(jnp.all(greedy), lambda: jnp.zeros(keys.shape, jnp.int32),
                           lambda: jax.vmap(jax.random.categorical)(keys, truncated).astype(
                               jnp.int32))
    tokens = jnp.where(greedy, jnp.argmax(logits, axis=-1).astype(jnp.int32), sampled)
    chosen = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    return tokens.astype(jnp.int32), chosen
