"""Names and records shared by several floors of the package, kept below all of them: the agent
roles, and the training batch that `rl.batching` builds, `distributed` pads to one global shape and
`rl.update` trains on."""
from __future__ import annotations

import jax
from flax import struct

ROLES = ("solver", "verifier", "corrector")  # the three agents, in the order they act


@struct.dataclass
class TrainBatch:
    """Micro-batched training data, leading axis = micro-batch. Per-token arrays are aligned to
    token positions: `sampler_logprobs[..., t]` is the sampler's log p(tokens[t] | tokens[<t])."""

    tokens: jax.Array            # [M, b, L] int32, right-padded prompt + response
    attention_mask: jax.Array    # [M, b, L] 1 on real tokens
    loss_mask: jax.Array         # [M, b, L] 1 on response tokens
    advantages: jax.Array        # [M, b], or [M, b, L] per token when packed
    sampler_logprobs: jax.Array  # [M, b, L] the behaviour policy (the sampler's)
    old_logprobs: jax.Array | None = None  # [M, b, L] pi_old when not the sampler's
    expert_ids: jax.Array | None = None  # [M, L_moe, b, L, k] routing replay
    # Packed rows: [M, b, L] int32, the samples of a row numbered from 1 (0 = padding); each
    # attends only to itself and its positions restart at 0. None: one sample per row.
    segments: jax.Array | None = None
