"""What a decode's buffers take and what memory is free for them (devices', or the host's RAM on
CPU). Arithmetic only; `sampler.generate` and the engine decide with it.
"""
from __future__ import annotations

import jax.numpy as jnp

from mars_jax.layers.attention import AUTO_DENSE_MAX_SCORE_BYTES

_FLOAT32 = 4  # activations and attention scores are counted at the widest compute dtype


def kv_bytes_per_token(config) -> int:
    """KV-cache bytes one token of context takes in a slot (keys and values of every layer)."""
    return (2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim
            * jnp.dtype(config.compute_dtype).itemsize)


def device_free_bytes(devices) -> int | None:
    """The fewest bytes free on `devices`; None where a device reports no memory (CPU)."""
    free = []
    for device in devices:
        stats = device.memory_stats()
        if not stats or "bytes_limit" not in stats:
            return None
        free.append(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    return min(free)


def host_free_bytes() -> int | None:
    """The host's available RAM (`MemAvailable` of /proc/meminfo), None where it is not readable."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def static_row_bytes(config, prompt_len: int, num_new: int, *, record_routing: bool) -> int:
    """An upper estimate of the peak bytes one row of a `generate` batch takes (prompts padded to
    `prompt_len`, `num_new` new-token slots): four copies of its KV cache, the prefill's
    attention scores, two layers' activations per prompt token, logits and recorded routing.
    `tests/sampling/test_batch_memory.py` checks it against XLA's own analysis."""
    heads, hidden = config.num_attention_heads, config.hidden_size
    cache = 4 * kv_bytes_per_token(config) * (prompt_len + num_new)
    queries = prompt_len if config.attention_impl == "dense" else min(prompt_len,
                                                                      config.attention_block)
    scores = heads * queries * prompt_len * _FLOAT32
    ffn = max(config.intermediate_size,
              config.num_experts_per_tok * config.moe_intermediate_size + config.num_experts)
    per_token = _FLOAT32 * (4 * hidden + 3 * heads * config.head_dim + 3 * ffn)
    logits = 4 * config.vocab_size * _FLOAT32
    routing = (config.num_hidden_layers * (prompt_len + num_new) * config.num_experts_per_tok * 4
               if record_routing else 0)
    return cache + scores + 2 * prompt_len * per_token + logits + routing


def static_fixed_bytes(config, prompt_len: int) -> int:
    """Bytes a `generate` batch may take whatever its rows: the dense attention scores the
    `auto` kernel forms beyond one block of queries, up to `AUTO_DENSE_MAX_SCORE_BYTES` in all."""
    return AUTO_DENSE_MAX_SCORE_BYTES if prompt_len > config.attention_block else 0
