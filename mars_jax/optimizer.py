"""The optimizer of every training loop (RL updates, the SFT warm start): AdamW with global-norm
clipping and a learning-rate schedule, on optax."""
from __future__ import annotations

import jax
import optax


def make_optimizer(learning_rate: float, *, warmup_steps: int = 0, decay_steps: int = 0,
                   schedule: str = "constant", b1: float = 0.9, b2: float = 0.999,
                   eps: float = 1e-8, weight_decay: float = 0.0,
                   max_grad_norm: float | None = 1.0) -> optax.GradientTransformation:
    """AdamW with global-norm clipping; schedule 'constant' or 'cosine' after linear warmup (to 0
    at update `decay_steps`, at least one update after the warmup). Weight decay applies to
    matrices only (not norm scales or biases)."""
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
