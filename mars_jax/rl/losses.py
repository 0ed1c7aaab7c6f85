"""Pure, jittable policy-loss functions for the MarsRL GRPO update (the paper's Eq. 2).

Per-token arrays are ``[B, T]`` (batch, response position); ``mask`` is 0/1 of the same shape.
``policy_loss`` takes ``config`` as a static argument (``LossConfig`` is frozen, so hashable).

Normalisation: the loss is ``sum(token_weights * per_token_loss)`` with the weights of one
aggregation over the whole mini-batch; each micro-batch gets its slice of them, so the summed
gradient is the mini-batch's whatever the micro-batch size or padding (except the mastered-token
mask's entropy gate, which reads the entropy of the micro-batch it is given).

Policies: ``old_logprobs`` is pi_old, fixed for the RL step (the ratio's denominator, the clip's
centre). In the decoupled objective (AReaL) pi_old is the proximal policy recomputed at the
step's start, ``behaviour_logprobs`` the sampler's, and each token is weighted by
``min(pi_prox / pi_behav, behaviour_weight_cap)``.

With ``kl_coef == 0`` no KL term is built and ``ref_logprobs`` may be ``None``
(``LossConfig.needs_ref_logprobs``: skip the reference forward).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

KL_ESTIMATORS = ("k1", "k2", "k3", "k3+")
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")

# Log-ratios are clamped to this magnitude before ``exp`` for numerical safety.
_MAX_LOG_RATIO = 20.0


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Static configuration of ``policy_loss``; the defaults are config.loss's.

    clip_low / clip_high: ratio clip range ``[1 - clip_low, 1 + clip_high]``.
    clip_c: dual-clip constant (> 1) bounding the loss of negative advantages.
    kl_coef / kl_estimator: beta and estimator (``kl_penalty``) of the KL to the reference.
    aggregation: one of ``AGGREGATIONS`` (``token_weights``); max_response_len: the constant
        divisor of ``seq-mean-token-sum-norm`` (required there).
    behaviour_weight_cap: cap of the decoupled objective's weight; ``None``: no weight.
    mastered_mask_prob: probability threshold tau of the mastered-token mask (``None``: off);
        target_entropy: the mask acts only while the batch entropy is below it (``None``: always).
    entropy_coef: weight of the entropy bonus (subtracted from the loss).
    """

    clip_low: float = 0.2
    clip_high: float = 0.28
    clip_c: float | None = None
    kl_coef: float = 0.0
    kl_estimator: str = "k3+"
    aggregation: str = "seq-mean-token-mean"
    max_response_len: int | None = None
    behaviour_weight_cap: float | None = 2.0
    mastered_mask_prob: float | None = None
    target_entropy: float | None = None
    entropy_coef: float = 0.0

    def __post_init__(self) -> None:
        if not (0.0 <= self.clip_low < 1.0 and self.clip_high >= 0.0):
            raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got {self.clip_low}, {self.clip_high}")
        if self.clip_c is not None and self.clip_c <= 1.0:
            raise ValueError(f"clip_c must be > 1, got {self.clip_c}")
        if self.kl_coef < 0.0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {self.kl_estimator!r}")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {self.aggregation!r}")
        if self.max_response_len is not None and self.max_response_len <= 0:
            raise ValueError(f"max_response_len must be > 0, got {self.max_response_len}")
        if self.aggregation == "seq-mean-token-sum-norm" and self.max_response_len is None:
            raise ValueError("seq-mean-token-sum-norm needs max_response_len (a constant divisor)")
        if self.behaviour_weight_cap is not None and self.behaviour_weight_cap <= 0.0:
            raise ValueError(f"behaviour_weight_cap must be > 0, got {self.behaviour_weight_cap}")
        if self.mastered_mask_prob is not None and not 0.0 < self.mastered_mask_prob < 1.0:
            raise ValueError(f"mastered_mask_prob must be in (0, 1), got {self.mastered_mask_prob}")

    @property
    def needs_ref_logprobs(self) -> bool:
        """Whether the reference-model forward pass is needed (kl_coef > 0)."""
        return self.kl_coef > 0.0

    @property
    def needs_entropy(self) -> bool:
        """Whether ``policy_loss`` needs the per-token ``entropy`` input."""
        gate = self.mastered_mask_prob is not None and self.target_entropy is not None
        return self.entropy_coef > 0.0 or gate


class Surrogate(NamedTuple):
    """Per-token clipped surrogate loss and the masks of where clipping is active."""

    loss: jax.Array  # [B, T]
    ratio: jax.Array  # [B, T]
    clipped_low: jax.Array  # [B, T] bool: A < 0 and ratio < 1 - clip_low
    clipped_high: jax.Array  # [B, T] bool: A > 0 and ratio > 1 + clip_high
    dual_clipped: jax.Array  # [B, T] bool: A < 0 and ratio > clip_c


def masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
    """Mean of ``x`` over positions where ``mask`` is 1 (0 if the mask is empty)."""
    return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def _log_ratio(logp: jax.Array, other_logp: jax.Array) -> jax.Array:
    return jnp.clip(logp - other_logp, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)


def clipped_surrogate(
    logprobs: jax.Array,
    old_logprobs: jax.Array,
    advantages: jax.Array,
    *,
    clip_low: float,
    clip_high: float,
    clip_c: float | None = None,
) -> Surrogate:
    """PPO/GRPO clipped surrogate with asymmetric ("clip-higher") and dual clip.

    ``loss = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))``, ``r = exp(logprobs -
    old_logprobs)``; with ``clip_c`` the loss of ``A < 0`` tokens is capped at ``-A clip_c``.
    Where a clip acts the loss is constant (zero gradient). ``advantages``: ``[B]`` or ``[B, T]``.
    """
    adv = advantages[:, None] if advantages.ndim == 1 else advantages
    adv = jnp.broadcast_to(adv, logprobs.shape)
    ratio = jnp.exp(_log_ratio(logprobs, old_logprobs))
    unclipped = -adv * ratio
    clipped = -adv * jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    clipped_low = (adv < 0) & (ratio < 1.0 - clip_low)
    clipped_high = (adv > 0) & (ratio > 1.0 + clip_high)
    loss = jnp.where(clipped_low | clipped_high, clipped, unclipped)
    if clip_c is None:
        dual_clipped = jnp.zeros_like(clipped_low)
    else:
        dual_clipped = (adv < 0) & (ratio > clip_c)
        loss = jnp.where(dual_clipped, -adv * clip_c, loss)
    return Surrogate(loss, ratio, clipped_low, clipped_high, dual_clipped)


def kl_penalty(logprobs: jax.Array, ref_logprobs: jax.Array, estimator: str = "k3") -> jax.Array:
    """Per-token estimate of KL(pi || pi_ref) from tokens sampled from pi.

    With ``log_r = ref_logprobs - logprobs``: ``k1 = -log_r``, ``k2 = log_r**2 / 2``,
    ``k3 = exp(log_r) - 1 - log_r`` (Schulman's unbiased, low-variance, non-negative
    estimator). Their expected gradients through ``logprobs`` differ:

    * k1: zero (``E_pi[grad log pi] = 0``): it penalises nothing on-policy.
    * k2: the gradient of the reverse KL(pi || pi_ref).
    * k3: the gradient of the forward KL(pi_ref || pi).
    * k3+: k3's value with k2's gradient (straight-through; verl's ``low_var_kl+``).
    """
    log_r = _log_ratio(ref_logprobs, logprobs)
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * jnp.square(log_r)
    if estimator == "k3":
        return jnp.expm1(log_r) - log_r
    if estimator == "k3+":
        k2 = 0.5 * jnp.square(log_r)
        return jax.lax.stop_gradient(jnp.expm1(log_r) - log_r - k2) + k2
    raise ValueError(f"estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")


def token_weights(mask: jax.Array, mode: str, max_response_len: int | None = None, *,
                  segments: jax.Array | None = None) -> jax.Array:
    """Per-token weights (shaped like ``mask``, ``[..., T]``) of one aggregation over every
    sequence of ``mask``: a row, or with ``segments`` (packed rows, ids >= 1) a segment of a row.

    token-mean: ``1 / (response tokens of all sequences)``.
    seq-mean-token-mean (the paper's Eq. 2): ``1 / (|o_i| * non-empty sequences)``: each
        sequence's token mean, averaged over sequences.
    seq-mean-token-sum-norm (Dr.GRPO): ``1 / (max_response_len * non-empty sequences)``.
    All-zero sequences (padding, filtered samples) weigh 0 and count in no denominator.
    """
    mask = mask.astype(jnp.promote_types(mask.dtype, jnp.float32))
    if mode == "token-mean":
        return mask / jnp.maximum(jnp.sum(mask), 1.0)
    if segments is None:
        lengths = jnp.sum(mask, axis=-1, keepdims=True)
        sequences = jnp.sum(lengths > 0)
    else:
        num_rows, width = mask.size // mask.shape[-1], mask.shape[-1] + 1  # segment ids < width
        rows = jnp.arange(num_rows).reshape(*mask.shape[:-1], 1)
        keys = (rows * width + segments).reshape(-1)  # one key per (row, segment)
        per_key = jax.ops.segment_sum(mask.reshape(-1), keys, num_segments=num_rows * width)
        lengths = per_key[keys].reshape(mask.shape)
        sequences = jnp.sum(per_key > 0)
    sequences = jnp.maximum(sequences, 1).astype(mask.dtype)
    if mode == "seq-mean-token-mean":
        return mask / (jnp.maximum(lengths, 1.0) * sequences)
    if mode == "seq-mean-token-sum-norm":
        if max_response_len is None:
            raise ValueError("seq-mean-token-sum-norm needs max_response_len")
        return mask / (max_response_len * sequences)
    raise ValueError(f"mode must be one of {AGGREGATIONS}, got {mode!r}")


def behaviour_weights(old_logprobs: jax.Array, behaviour_logprobs: jax.Array,
                      cap: float) -> jax.Array:
    """The decoupled objective's ``min(exp(old - behaviour), cap)``, gradient-free: corrects
    for tokens decoded by a policy (the sampler, possibly versions ago) other than pi_old."""
    weights = jnp.minimum(jnp.exp(_log_ratio(old_logprobs, behaviour_logprobs)), cap)
    return jax.lax.stop_gradient(weights)


def mastered_token_mask(
    logprobs: jax.Array,
    mask: jax.Array,
    positive: jax.Array,
    prob_threshold: float,
    batch_entropy: jax.Array | None = None,
    target_entropy: float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """UloRL/MarsRL dynamic masking of well-mastered positive tokens: tokens of ``positive``
    samples (``[B]`` or ``[B, T]``) with ``exp(logprobs) > prob_threshold`` leave the mask while
    ``batch_entropy < target_entropy`` (always if it is ``None``). Returns ``(new_mask, fraction of
    response tokens masked)``, both gradient-free."""
    pos = positive[:, None] if positive.ndim == 1 else positive
    probs = jnp.exp(jax.lax.stop_gradient(logprobs))
    mastered = pos & (probs > prob_threshold) & (mask > 0)
    if target_entropy is not None:
        if batch_entropy is None:
            raise ValueError("batch_entropy is required when target_entropy is set")
        mastered = mastered & (jax.lax.stop_gradient(batch_entropy) < target_entropy)
    new_mask = jnp.where(mastered, jnp.zeros_like(mask), mask)
    return new_mask, masked_mean(mastered.astype(mask.dtype), mask)


def policy_loss(
    logprobs: jax.Array,
    old_logprobs: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    config: LossConfig,
    *,
    weights: jax.Array | None = None,
    ref_logprobs: jax.Array | None = None,
    behaviour_logprobs: jax.Array | None = None,
    entropy: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Loss ``sum(weights * (bw * pg + kl_coef * kl - entropy_coef * entropy))`` and metrics.

    weights: ``token_weights`` of ``config.aggregation`` over the whole mini-batch (default: of
        this batch alone); the mastered-token mask zeroes its tokens' weights in every term.
    advantages: ``[B]`` or ``[B, T]``; ``A > 0`` marks the mastered-token mask's positives.
    ref_logprobs: required iff ``config.kl_coef > 0``. entropy: required iff
        ``config.needs_entropy``, else only reported.
    behaviour_logprobs: the sampler's, when they are not pi_old; with
        ``config.behaviour_weight_cap`` they give ``bw``, else ``bw = 1``.

    Metrics (fractions and means over ``mask``): ``loss``, ``pg_loss``, the clip fractions,
    ``ratio_mean``, ``approx_kl`` (k3 estimate of KL(old || new)), ``masked_frac``, and ``kl``,
    ``behaviour_weight_mean``, ``entropy`` when those inputs are used.
    """
    if config.needs_ref_logprobs and ref_logprobs is None:
        raise ValueError("ref_logprobs is required when kl_coef > 0")
    if config.needs_entropy and entropy is None:
        raise ValueError("entropy is required when entropy_coef > 0 or target_entropy is set")
    mask = mask.astype(logprobs.dtype)
    if weights is None:
        weights = token_weights(mask, config.aggregation, config.max_response_len)
    metrics: dict[str, jax.Array] = {}

    sur = clipped_surrogate(
        logprobs, old_logprobs, advantages,
        clip_low=config.clip_low, clip_high=config.clip_high, clip_c=config.clip_c,
    )
    per_token = sur.loss
    if behaviour_logprobs is not None and config.behaviour_weight_cap is not None:
        bw = behaviour_weights(old_logprobs, behaviour_logprobs, config.behaviour_weight_cap)
        per_token = per_token * bw
        metrics["behaviour_weight_mean"] = masked_mean(bw, mask)
    pg_per_token = per_token

    if config.needs_ref_logprobs:
        kl = kl_penalty(logprobs, ref_logprobs, config.kl_estimator)
        per_token = per_token + config.kl_coef * kl
        metrics["kl"] = masked_mean(jax.lax.stop_gradient(kl), mask)
    batch_entropy = None
    if entropy is not None:
        batch_entropy = masked_mean(jax.lax.stop_gradient(entropy), mask)
        metrics["entropy"] = batch_entropy
        if config.entropy_coef > 0.0:
            per_token = per_token - config.entropy_coef * entropy

    masked_frac = jnp.zeros((), logprobs.dtype)
    if config.mastered_mask_prob is not None:
        kept, masked_frac = mastered_token_mask(
            logprobs, mask, advantages > 0, config.mastered_mask_prob,
            batch_entropy, config.target_entropy,
        )
        weights = weights * kept
    stats = jax.lax.stop_gradient
    loss = jnp.sum(per_token * weights)
    log_ratio = stats(_log_ratio(logprobs, old_logprobs))
    metrics.update(
        loss=stats(loss),
        pg_loss=stats(jnp.sum(pg_per_token * weights)),
        clip_frac_low=masked_mean(sur.clipped_low.astype(mask.dtype), mask),
        clip_frac_high=masked_mean(sur.clipped_high.astype(mask.dtype), mask),
        dual_clip_frac=masked_mean(sur.dual_clipped.astype(mask.dtype), mask),
        ratio_mean=masked_mean(stats(sur.ratio), mask),
        approx_kl=masked_mean(jnp.expm1(log_ratio) - log_ratio, mask),
        masked_frac=masked_frac,
    )
    return loss, metrics
