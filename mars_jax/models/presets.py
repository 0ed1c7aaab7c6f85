"""Named model configurations: `tiny` (tests, toy RL), `bench` (benchmarks), `qwen3_30b_a3b`."""
from __future__ import annotations

from typing import Any

from mars_jax.models.config import Qwen3Config

PRESETS: dict[str, dict[str, Any]] = {
    # A tiny Qwen3-MoE for tests and CPU toy runs; vocab fits the small tokenizer.
    "tiny": dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, intermediate_size=128,
                 moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                 norm_topk_prob=True, rope_theta=10_000.0, max_position_embeddings=4096),
    "bench": dict(vocab_size=8192, hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=64, intermediate_size=1024,
                  moe_intermediate_size=256, num_experts=16, num_experts_per_tok=4,
                  norm_topk_prob=True, rope_theta=1e6, rms_norm_eps=1e-6,
                  tie_word_embeddings=False, max_position_embeddings=32768),
    # Qwen3-30B-A3B(-Thinking-2507): 30.5B parameters, 3.3B active per token.
    "qwen3_30b_a3b": dict(vocab_size=151936, hidden_size=2048, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                          num_experts_per_tok=8, norm_topk_prob=True, rope_theta=10_000_000.0,
                          rms_norm_eps=1e-6, tie_word_embeddings=False,
                          max_position_embeddings=262144, dtype="bfloat16",
                          param_dtype="bfloat16"),
}


def get_preset(name: str, **overrides: Any) -> Qwen3Config:
    """The named configuration with `overrides` applied (e.g. `param_dtype='bfloat16'`)."""
    if name not in PRESETS:
        raise ValueError(f"model preset {name!r} is unknown; choose one of {sorted(PRESETS)}")
    return Qwen3Config(**{**PRESETS[name], **overrides})
