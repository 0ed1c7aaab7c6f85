"""Tiny random checkpoints made by HF transformers (torch), the independent reference."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import transformers

TINY_COMMON = dict(vocab_size=96, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=8, intermediate_size=48, rms_norm_eps=1e-6,
                   max_position_embeddings=512, tie_word_embeddings=False)


def hf_config(moe: bool, **overrides) -> transformers.PretrainedConfig:
    if moe:
        fields = dict(TINY_COMMON, moe_intermediate_size=16, num_experts=6, num_experts_per_tok=2,
                      norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1],
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
        fields.update(overrides)
        return transformers.Qwen3MoeConfig(**fields)
    fields = dict(TINY_COMMON, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                  attention_bias=True)
    fields.update(overrides)
    return transformers.Qwen3Config(**fields)


def save_tiny_hf(path: Path, moe: bool, seed: int = 0, **overrides) -> Path:
    """Builds a random HF model (non-trivial norm weights and biases) and saves it to `path`."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(moe, **overrides))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    return path


def hf_logits(path: Path, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """HF logits with position ids counting real tokens only (what left padding needs)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    positions = np.maximum(mask.cumsum(-1) - 1, 0)
    with torch.no_grad():
        out = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                    position_ids=torch.tensor(positions))
    return out.logits.numpy()


def padded_batch(vocab: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A batch of 3 rows of 12 tokens: full, left-padded by 4, right-padded by 3."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, (3, 12))
    mask = np.ones((3, 12), np.int64)
    mask[1, :4] = 0
    mask[2, 9:] = 0
    return ids, mask
