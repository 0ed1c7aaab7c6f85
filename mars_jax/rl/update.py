"""The policy update: one jitted, sharded step with gradient accumulation over micro-batches.

Log-probabilities are recomputed by the trainer on the same parameter arrays the sampler used,
at the sampling temperature (`log_softmax(logits / T)`, the sampler's convention). With one
optimizer step per rollout batch the behaviour policy *is* the current parameters, so
`old_logprobs = stop_gradient(logprobs)`; the sampler's own log-probabilities enter only through
truncated importance sampling (`LossConfig.tis_cap`), correcting sampler/trainer mismatch and
the staleness of segments resumed across policy versions.

Logits are formed chunk by chunk along the sequence under `jax.checkpoint`, so no
`[batch, length, vocab]` array is ever materialised, forward or backward.
A non-finite loss, gradient or update leaves parameters and optimizer state unchanged (`finite` = 0).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct

from mars_jax.layers.attention_mask import AttentionMask
from mars_jax.models.qwen3 import Qwen3, positions_from_mask
from mars_jax.rl.losses import LossConfig, policy_loss


@struct.dataclass
class TrainBatch:
    """Micro-batched training data, leading axis = micro-batch. Per-token arrays are aligned to
    token positions: `sampler_logprobs[..., t]` is the sampler's log p(tokens[t] | tokens[<t])."""

    tokens: jax.Array            # [M, b, L] int32, right-padded prompt + response
    attention_mask: jax.Array    # [M, b, L] 1 on real tokens
    loss_mask: jax.Array         # [M, b, L] 1 on response tokens
    advantages: jax.Array        # [M, b]
    sampler_logprobs: jax.Array  # [M, b, L]
    expert_ids: jax.Array | None = None  # [M, L_moe, b, L, k] routing replay


@struct.dataclass
class TrainState:
    """Parameters (shared with the sampler), optimizer state and the update counter."""

    params: Any
    opt_state: Any
    step: jax.Array


@dataclasses.dataclass(frozen=True)
class UpdateConfig:
    """Static settings of the update program."""

    loss: LossConfig = LossConfig()
    temperature: float = 1.0
    logits_chunk: int = 256
    routing_replay: bool = False


def make_optimizer(learning_rate: float, *, warmup_steps: int = 0, decay_steps: int = 0,
                   schedule: str = "constant", b1: float = 0.9, b2: float = 0.999,
                   eps: float = 1e-8, weight_decay: float = 0.0,
                   max_grad_norm: float | None = 1.0) -> optax.GradientTransformation:
    """AdamW with global-norm clipping; schedule 'constant' or 'cosine' after linear warmup.
    Weight decay applies to matrices only (not norm scales or biases)."""
    if schedule == "constant":
        lr = optax.join_schedules([optax.linear_schedule(0.0, learning_rate, max(warmup_steps, 1)),
                                   optax.constant_schedule(learning_rate)], [warmup_steps]) \
            if warmup_steps else optax.constant_schedule(learning_rate)
    elif schedule == "cosine":
        lr = optax.warmup_cosine_decay_schedule(0.0, learning_rate, warmup_steps,
                                                max(decay_steps, warmup_steps + 1))
    else:
        raise ValueError(f"optimizer.schedule: {schedule!r} is not 'constant' or 'cosine'")
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
    chain = [optax.clip_by_global_norm(max_grad_norm)] if max_grad_norm else []
    chain.append(optax.adamw(lr, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay,
                             mask=decay_mask))
    return optax.chain(*chain)


def token_logprobs(model: Qwen3, tokens: jax.Array, attention_mask: jax.Array, *,
                   temperature: float, chunk: int, expert_ids: jax.Array | None = None
                   ) -> tuple[jax.Array, jax.Array]:
    """log p(tokens[t] | tokens[<t]) / T-scaled, and the token entropy, both `[B, L]` (0 at t=0)."""
    out = model.forward(tokens, positions=positions_from_mask(attention_mask),
                        mask=AttentionMask.causal(attention_mask), expert_ids=expert_ids)
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
    """The shardings of `optimizer.init(params)` for sharded (or abstract, sharded) `params`:
    per-parameter moments shard like their parameter, counters and the like are replicated.
    (A jitted `optimizer.init` without them is free to replicate the moments.)"""
    replicated = jax.sharding.NamedSharding(jax.tree.leaves(params)[0].sharding.mesh,
                                            jax.sharding.PartitionSpec())
    return optax.tree_map_params(
        optimizer, lambda _, p: p.sharding, jax.eval_shape(optimizer.init, params), params,
        transform_non_params=lambda _: replicated)


def init_train_state(model: Qwen3, optimizer: optax.GradientTransformation) -> TrainState:
    """Train state over the model's own parameter arrays (no copy)."""
    params = nnx.state(model, nnx.Param)
    return TrainState(params=params, opt_state=optimizer.init(params), step=jnp.zeros((), jnp.int32))


def _micro_loss(params, graphdef, batch: TrainBatch, ref_params, config: UpdateConfig):
    model = nnx.merge(graphdef, params)
    replay = batch.expert_ids if config.routing_replay else None
    logprobs, entropy = token_logprobs(model, batch.tokens, batch.attention_mask,
                                       temperature=config.temperature, chunk=config.logits_chunk,
                                       expert_ids=replay)
    ref_logprobs = None
    if config.loss.needs_ref_logprobs:
        ref_model = nnx.merge(graphdef, jax.lax.stop_gradient(ref_params))
        ref_logprobs, _ = token_logprobs(ref_model, batch.tokens, batch.attention_mask,
                                         temperature=config.temperature,
                                         chunk=config.logits_chunk, expert_ids=replay)
    mask = batch.loss_mask.astype(jnp.float32)
    loss, metrics = policy_loss(
        logprobs, jax.lax.stop_gradient(logprobs), batch.advantages, mask, config.loss,
        ref_logprobs=ref_logprobs,
        sampler_logprobs=batch.sampler_logprobs if config.loss.tis_cap else None,
        entropy=entropy if config.loss.needs_entropy else jax.lax.stop_gradient(entropy))
    metrics = dict(metrics, tokens=jnp.sum(mask))
    metrics.setdefault("entropy", jnp.sum(entropy * mask) / jnp.maximum(jnp.sum(mask), 1.0))
    metrics["sampler_logprob_diff"] = (jnp.sum(jnp.abs(batch.sampler_logprobs - logprobs) * mask)
                                       / jnp.maximum(jnp.sum(mask), 1.0))
    return loss, metrics


@functools.partial(jax.jit, static_argnames=("graphdef", "optimizer", "config"),
                   donate_argnames=("state",))
def train_step(state: TrainState, batch: TrainBatch, ref_params: Any, *, graphdef: nnx.GraphDef,
               optimizer: optax.GradientTransformation, config: UpdateConfig
               ) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer update over all micro-batches of `batch` (losses averaged over micro-batches).
    `ref_params` is only read when the loss has a KL term (pass None otherwise)."""
    grad_fn = jax.value_and_grad(_micro_loss, has_aux=True)

    def accumulate(grads, micro):
        (loss, metrics), g = grad_fn(state.params, graphdef, micro, ref_params, config)
        return jax.tree.map(jnp.add, grads, g), dict(metrics, loss=loss)

    zeros = jax.tree.map(jnp.zeros_like, state.params)
    grads, metrics = jax.lax.scan(accumulate, zeros, batch)
    num_micro = batch.tokens.shape[0]
    grads = jax.tree.map(lambda g: g / num_micro, grads)
    grad_norm = optax.global_norm(grads)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    finite = (jnp.isfinite(grad_norm) & jnp.all(jnp.isfinite(metrics["loss"]))
              & jnp.isfinite(optax.global_norm(updates)))
    params = optax.apply_updates(state.params, updates)
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
    tokens = jnp.maximum(jnp.sum(metrics["tokens"]), 1.0)
    summary = {k: jnp.sum(v * metrics["tokens"]) / tokens for k, v in metrics.items() if k != "tokens"}
    summary.update(grad_norm=grad_norm, finite=finite.astype(jnp.float32), tokens=tokens)
    new_state = TrainState(params=keep(params, state.params), opt_state=keep(opt_state, state.opt_state),
                           step=state.step + finite.astype(jnp.int32))
    return new_state, summary
