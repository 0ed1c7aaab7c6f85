"""The policy update: one jitted, sharded optimizer step over a mini-batch, with gradient
accumulation over its micro-batches, and the forward-only log-probabilities of pi_old.

Log-probabilities are taken at the sampling temperature (`log_softmax(logits / T)`, the sampler's
convention). pi_old is `TrainBatch.old_logprobs` (`policy_logprobs` at the step's start) when
present, else the sampler's log-probabilities. A mini-batch's loss is one aggregation over all
its rows (`losses.token_weights` over the whole `[M, b, L]` batch: `losses`, "Normalisation").
Logits are formed chunk by chunk under `jax.checkpoint`, so no `[batch, length, vocab]` array is
materialised, forward or backward. A non-finite loss, gradient or update leaves parameters and
optimizer state unchanged (`finite` = 0).
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct

from mars_jax.layers.attention_mask import AttentionMask
from mars_jax.models.qwen3 import Qwen3, positions_from_mask, positions_from_segments
from mars_jax.rl.losses import LossConfig, policy_loss, token_weights
from mars_jax.types import TrainBatch


@struct.dataclass
class TrainState:
    """Parameters (shared with the sampler), optimizer state and the update counter."""

    params: Any
    opt_state: Any
    step: jax.Array


@dataclasses.dataclass(frozen=True)
class UpdateConfig:
    """Static settings of the update program; the defaults are config.loss's and
    config.learner's (experiments/configs/common.py)."""

    loss: LossConfig = LossConfig()
    temperature: float = 1.0
    logits_chunk: int = 256
    routing_replay: bool = False
    # A micro-batch runs at the shortest of L, L/2, .., L/2**length_halvings (`cut_lengths`) that
    # holds its longest row, one branch per length; fine_cuts adds 3L/4, 3L/8, ..: above the
    # shortest cut at most 1.5x the longest row instead of under 2x, for twice the branches.
    length_halvings: int = 2
    fine_cuts: bool = False


def token_logprobs(model: Qwen3, tokens: jax.Array, attention_mask: jax.Array, *,
                   temperature: float, chunk: int, expert_ids: jax.Array | None = None,
                   segments: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """log p(tokens[t] | tokens[<t]) / T-scaled, and the token entropy, both `[B, L]` (0 at t=0).
    With `segments` (packed rows) the context is the token's own segment; the value at a
    segment's first token is then meaningless (mask it out)."""
    if segments is None:
        positions, mask = positions_from_mask(attention_mask), AttentionMask.causal(attention_mask)
    else:
        positions, mask = positions_from_segments(segments), AttentionMask.packed(segments)
    out = model.forward(tokens, positions=positions, mask=mask, expert_ids=expert_ids)
    hidden, targets = out.hidden[:, :-1], tokens[:, 1:]
    batch, length = targets.shape
    chunk = min(chunk, length)
    pad = -length % chunk
    hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets, ((0, 0), (0, pad)))
    num = (length + pad) // chunk
    hidden = hidden.reshape(batch, num, chunk, -1).swapaxes(0, 1)
    targets = targets.reshape(batch, num, chunk).swapaxes(0, 1)

    @jax.checkpoint
    def one_chunk(h, t):
        logp = jax.nn.log_softmax(model.logits(h) / temperature, axis=-1)
        chosen = jnp.take_along_axis(logp, t[..., None], axis=-1)[..., 0]
        entropy = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
        return chosen, entropy

    chosen, entropy = jax.lax.map(lambda xs: one_chunk(*xs), (hidden, targets))
    unchunk = lambda x: jnp.pad(x.swapaxes(0, 1).reshape(batch, -1)[:, :length], ((0, 0), (1, 0)))
    return unchunk(chosen), unchunk(entropy)


def opt_state_shardings(optimizer: optax.GradientTransformation, params: Any) -> Any:
    """The shardings of `optimizer.init(params)` for (abstract) sharded `params`: moments shard
    like their parameter, the rest is replicated (a jitted init without them may replicate all)."""
    replicated = jax.sharding.NamedSharding(jax.tree.leaves(params)[0].sharding.mesh,
                                            jax.sharding.PartitionSpec())
    return optax.tree_map_params(
        optimizer, lambda _, p: p.sharding, jax.eval_shape(optimizer.init, params), params,
        transform_non_params=lambda _: replicated)


def init_train_state(model: Qwen3, optimizer: optax.GradientTransformation) -> TrainState:
    """Train state over the model's own parameter arrays (no copy)."""
    params = nnx.state(model, nnx.Param)
    return TrainState(params=params, opt_state=optimizer.init(params), step=jnp.zeros((), jnp.int32))


def _micro_loss(params, graphdef, micro: TrainBatch, weights: jax.Array, ref_params,
                config: UpdateConfig):
    model = nnx.merge(graphdef, params)
    replay = micro.expert_ids if config.routing_replay else None
    logprobs, entropy = token_logprobs(model, micro.tokens, micro.attention_mask,
                                       temperature=config.temperature, chunk=config.logits_chunk,
                                       expert_ids=replay, segments=micro.segments)
    ref_logprobs = None
    if config.loss.needs_ref_logprobs:
        ref_model = nnx.merge(graphdef, jax.lax.stop_gradient(ref_params))
        ref_logprobs, _ = token_logprobs(ref_model, micro.tokens, micro.attention_mask,
                                         temperature=config.temperature,
                                         chunk=config.logits_chunk, expert_ids=replay,
                                         segments=micro.segments)
    mask = micro.loss_mask.astype(jnp.float32)
    decoupled = micro.old_logprobs is not None
    old = micro.old_logprobs if decoupled else micro.sampler_logprobs
    loss, metrics = policy_loss(
        logprobs, old, micro.advantages, mask, config.loss, weights=weights,
        ref_logprobs=ref_logprobs, behaviour_logprobs=micro.sampler_logprobs if decoupled else None,
        entropy=entropy if config.loss.needs_entropy else jax.lax.stop_gradient(entropy))
    metrics = dict(metrics, tokens=jnp.sum(mask))
    metrics["sampler_logprob_diff"] = (jnp.sum(jnp.abs(micro.sampler_logprobs - logprobs) * mask)
                                       / jnp.maximum(jnp.sum(mask), 1.0))
    return loss, metrics


def cut_lengths(length: int, halvings: int, fine: bool = False) -> tuple[int, ...]:
    """The row lengths a micro-batch of `length` columns may be cut to, ascending: length / 2**k
    for k = halvings .. 0, with `fine` also 3 * length / 2**(k + 2) for k = halvings - 1 .. 0
    (whole numbers of at least 16 only; `length` itself always)."""
    cuts = {length >> k for k in range(halvings + 1) if length % (1 << k) == 0}
    if fine:
        cuts |= {3 * length >> (k + 2) for k in range(halvings)
                 if (3 * length) % (1 << (k + 2)) == 0}
    return tuple(sorted(c for c in cuts if c >= 16 or c == length))


def _cut(x: jax.Array | None, length: int, axis: int = 1) -> jax.Array | None:
    """`x` without its columns from `length` on along `axis` (None stays None)."""
    return None if x is None else jax.lax.slice_in_dim(x, 0, length, axis=axis)


def _cut_micro(micro: TrainBatch, length: int) -> TrainBatch:
    """`micro` without the token columns from `length` on."""
    per_token_advantages = micro.advantages.ndim == 2
    return micro.replace(tokens=_cut(micro.tokens, length),
                         attention_mask=_cut(micro.attention_mask, length),
                         loss_mask=_cut(micro.loss_mask, length),
                         advantages=(_cut(micro.advantages, length) if per_token_advantages
                                     else micro.advantages),
                         sampler_logprobs=_cut(micro.sampler_logprobs, length),
                         old_logprobs=_cut(micro.old_logprobs, length),
                         expert_ids=_cut(micro.expert_ids, length, axis=2),
                         segments=_cut(micro.segments, length))


def _length_branch(micro: TrainBatch, cuts: Sequence[int]) -> jax.Array:
    """0 for a micro-batch without loss tokens, else 1 + the index of the shortest of `cuts`
    holding its longest row (rows are right-padded)."""
    longest = jnp.max(jnp.sum(micro.attention_mask, axis=-1))
    fitting = 1 + jnp.searchsorted(jnp.asarray(cuts), longest)
    return jnp.where(jnp.any(micro.loss_mask > 0), fitting, 0)


def _micro_gradients(params: Any, micro: TrainBatch, micro_weights: jax.Array, ref_params: Any,
                     cuts: Sequence[int], *, graphdef: nnx.GraphDef, config: UpdateConfig
                     ) -> tuple[Any, dict[str, jax.Array]]:
    """One micro-batch's share of the mini-batch's gradient, and its metrics with its `loss`."""
    grad_fn = jax.value_and_grad(_micro_loss, has_aux=True)
    compute = lambda n: lambda: grad_fn(params, graphdef, _cut_micro(micro, n),
                                        _cut(micro_weights, n), ref_params, config)
    # A micro-batch without loss tokens (the padding up to a power of two of micro-batches)
    # adds exactly zero to the loss and the gradient: its branch skips the forward and
    # backward. Columns past a micro-batch's longest row are padding: cutting them changes
    # nothing (causal attention; zero masks), so it runs at the shortest length that fits.
    zero = lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                                jax.eval_shape(compute(cuts[-1])))
    (loss, metrics), g = jax.lax.switch(_length_branch(micro, cuts),
                                        [zero] + [compute(n) for n in cuts])
    return g, dict(metrics, loss=loss)


def _batch_summary(metrics: dict[str, jax.Array], batch: TrainBatch) -> dict[str, jax.Array]:
    """A mini-batch's metrics from its micro-batches' (stacked along axis 0): token-weighted
    means, its `loss`, `tokens` and `fill`."""
    tokens = jnp.maximum(jnp.sum(metrics["tokens"]), 1.0)
    summary = {k: jnp.sum(v * metrics["tokens"]) / tokens for k, v in metrics.items()
               if k not in ("tokens", "loss")}
    summary.update(loss=jnp.sum(metrics["loss"]), tokens=jnp.sum(metrics["tokens"]),
                   fill=jnp.mean(batch.attention_mask.astype(jnp.float32)))
    return summary


def _batch_weights(batch: TrainBatch, config: UpdateConfig) -> jax.Array:
    return token_weights(batch.loss_mask, config.loss.aggregation, config.loss.max_response_len,
                         segments=batch.segments)


def batch_gradients(params: Any, batch: TrainBatch, ref_params: Any, *, graphdef: nnx.GraphDef,
                    config: UpdateConfig) -> tuple[Any, dict[str, jax.Array]]:
    """Gradient of the whole mini-batch's loss, accumulated micro-batch by micro-batch; metrics
    are token-weighted means except `loss`, `tokens` (response tokens) and `fill` (the fraction of
    positions that hold tokens)."""
    cuts = cut_lengths(batch.tokens.shape[-1], config.length_halvings, config.fine_cuts)

    def accumulate(grads, inputs):
        g, metrics = _micro_gradients(params, *inputs, ref_params, cuts, graphdef=graphdef,
                                      config=config)
        return jax.tree.map(jnp.add, grads, g), metrics

    zeros = jax.tree.map(jnp.zeros_like, params)
    grads, metrics = jax.lax.scan(accumulate, zeros, (batch, _batch_weights(batch, config)))
    return grads, _batch_summary(metrics, batch)


def _apply(state: TrainState, grads: Any, summary: dict[str, jax.Array],
           optimizer: optax.GradientTransformation) -> tuple[TrainState, dict[str, jax.Array]]:
    """`state` after the optimizer's update by `grads` where finite (`train_step`)."""
    grad_norm = optax.global_norm(grads)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    finite = (jnp.isfinite(grad_norm) & jnp.isfinite(summary["loss"])
              & jnp.isfinite(optax.global_norm(updates)))
    params = optax.apply_updates(state.params, updates)
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
    summary = dict(summary, grad_norm=grad_norm, finite=finite.astype(jnp.float32))
    new_state = TrainState(params=keep(params, state.params),
                           opt_state=keep(opt_state, state.opt_state),
                           step=state.step + finite.astype(jnp.int32))
    return new_state, summary


@functools.partial(jax.jit, static_argnames=("graphdef", "optimizer", "config"),
                   donate_argnames=("state",))
def train_step(state: TrainState, batch: TrainBatch, ref_params: Any, *, graphdef: nnx.GraphDef,
               optimizer: optax.GradientTransformation, config: UpdateConfig
               ) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer update on the mini-batch `batch` (`batch_gradients`), applied whenever it is
    finite: one without loss tokens has a zero gradient, on which AdamW's momentum still moves the
    weights, as in verl and TRL. `ref_params` is read only for a KL term (else pass None).
    `micro_batch_gradients` then `apply_gradients` make this update one program per micro-batch."""
    grads, summary = batch_gradients(state.params, batch, ref_params, graphdef=graphdef,
                                     config=config)
    return _apply(state, grads, summary, optimizer)


@functools.partial(jax.jit, static_argnames=("graphdef", "config"), donate_argnames=("grads",))
def micro_batch_gradients(grads: Any, params: Any, batch: TrainBatch, index: jax.Array,
                          ref_params: Any, *, graphdef: nnx.GraphDef, config: UpdateConfig
                          ) -> tuple[Any, dict[str, jax.Array]]:
    """`grads` plus micro-batch `index` of `batch`'s share of the mini-batch's gradient (as in
    `batch_gradients`), and that micro-batch's metrics; start from zeros like `params`."""
    cuts = cut_lengths(batch.tokens.shape[-1], config.length_halvings, config.fine_cuts)
    micro, weights = jax.tree.map(lambda x: x[index], (batch, _batch_weights(batch, config)))
    g, metrics = _micro_gradients(params, micro, weights, ref_params, cuts, graphdef=graphdef,
                                  config=config)
    return jax.tree.map(jnp.add, grads, g), metrics


@functools.partial(jax.jit, static_argnames=("optimizer",), donate_argnames=("state",))
def apply_gradients(state: TrainState, grads: Any, metrics: Sequence[dict[str, jax.Array]],
                    batch: TrainBatch, *, optimizer: optax.GradientTransformation
                    ) -> tuple[TrainState, dict[str, jax.Array]]:
    """`train_step`'s update and metrics from the mini-batch `batch`'s gradient `grads` and its
    micro-batches' `metrics` (`micro_batch_gradients`, in order)."""
    stacked = {k: jnp.stack([m[k] for m in metrics]) for k in metrics[0]}
    return _apply(state, grads, _batch_summary(stacked, batch), optimizer)


@functools.partial(jax.jit, static_argnames=("graphdef", "config"))
def policy_logprobs(params: Any, batch: TrainBatch, *, graphdef: nnx.GraphDef,
                    config: UpdateConfig) -> jax.Array:
    """Forward-only `[M, b, L]` log-probabilities of `batch`'s tokens under `params`, 0 outside
    `loss_mask` (pi_old recomputed at the start of a step; verl's `old_log_prob`)."""
    model = nnx.merge(graphdef, params)

    length = batch.tokens.shape[-1]
    cuts = cut_lengths(length, config.length_halvings, config.fine_cuts)

    def one(micro: TrainBatch) -> jax.Array:
        def compute(n):
            def run():
                part = _cut_micro(micro, n)
                replay = part.expert_ids if config.routing_replay else None
                logprobs, _ = token_logprobs(model, part.tokens, part.attention_mask,
                                             temperature=config.temperature,
                                             chunk=config.logits_chunk, expert_ids=replay,
                                             segments=part.segments)
                return jnp.pad(logprobs * part.loss_mask, ((0, 0), (0, length - n)))
            return run

        zero = lambda: jnp.zeros_like(micro.loss_mask, jnp.float32)
        return jax.lax.switch(_length_branch(micro, cuts), [zero] + [compute(n) for n in cuts])

    return jax.lax.map(one, batch)
