"""Qwen3 / Qwen3-MoE configuration, read from and written to Hugging Face `config.json`."""
from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen3_moe")
MOE_IMPLS = ("auto", "dense", "sorted", "ragged", "mgpu")
ATTENTION_IMPLS = ("auto", "dense", "flash")
DTYPES = ("float32", "bfloat16", "float16")  # of activations and of parameters
# transformers' Qwen3Config / Qwen3MoeConfig defaults that depend on the model type (a Qwen3-MoE
# head_dim defaults to hidden_size // num_attention_heads).
HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3": dict(num_key_value_heads=32, head_dim=128),
    "qwen3_moe": dict(num_key_value_heads=4, moe_intermediate_size=768, num_local_experts=128,
                      num_experts_per_tok=8, norm_topk_prob=False),
}
HF_DEFAULT_ROPE_THETA = 10_000.0
HF_DEFAULT_SLIDING_WINDOW = 4096
HF_DEFAULT_MAX_WINDOW_LAYERS = 28  # Qwen3Config: layers from this index on slide


@dataclasses.dataclass(frozen=True)
class Qwen3Config:
    """Architecture (HF field names) plus how to run it (dtypes, MoE dispatch)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    moe_intermediate_size: int = 0
    num_experts: int = 0
    num_experts_per_tok: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    rope_theta: float = HF_DEFAULT_ROPE_THETA
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 40960
    attention_bias: bool = False
    initializer_range: float = 0.02
    # How to run it (not part of the architecture).
    dtype: str = "float32"          # compute dtype of activations
    param_dtype: str = "float32"    # storage dtype of parameters
    moe_impl: str = "auto"          # 'auto' | 'dense' | 'sorted' | 'ragged' | 'mgpu'
    moe_block_size: int = 128       # rows per expert block in the 'sorted' dispatch
    moe_dense_max_tokens: int = 64  # 'auto': all-experts fused matmuls up to this many tokens
    capacity_factor: float | None = None  # None = dropless; else tokens beyond capacity are dropped
    moe_chunk_tokens: int = 0       # dropless dispatch this many tokens at a time (0 = all)
    attention_impl: str = "auto"    # 'dense' [T, S] scores | 'flash' blockwise | 'auto': flash
    attention_block: int = 512      # when the queries span more than one block of this size and
                                    # the dense scores would exceed 512 MiB (layers/attention.py)
    remat: bool = False             # recompute each layer's activations in the backward pass
    scan_layers: bool = False       # run the layers as one lax.scan (compiles one layer)

    def __post_init__(self):
        if self.moe_impl not in MOE_IMPLS:
            raise ValueError(f"moe_impl: {self.moe_impl!r} is not one of {MOE_IMPLS}")
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(f"attention_impl: {self.attention_impl!r} is not one of "
                             f"{ATTENTION_IMPLS}")
        if self.attention_block < 1:
            raise ValueError(f"attention_block must be >= 1, got {self.attention_block}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads, got "
                             f"{self.num_attention_heads} and {self.num_key_value_heads}")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, num_experts={self.num_experts}], "
                             f"got {self.num_experts_per_tok}")
        for field in ("dtype", "param_dtype"):
            if getattr(self, field) not in DTYPES:
                raise ValueError(f"{field}: unsupported dtype {getattr(self, field)!r}")

    @property
    def model_type(self) -> str:
        return "qwen3_moe" if self.num_experts else "qwen3"

    @property
    def compute_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)

    @property
    def weight_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.param_dtype)

    def is_moe_layer(self, layer: int) -> bool:
        """HF's rule: MoE unless listed in mlp_only_layers or off the decoder_sparse_step grid."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    def replace(self, **changes: Any) -> "Qwen3Config":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf_dict(cls, hf: Mapping[str, Any], **overrides: Any) -> "Qwen3Config":
        """Reads the fields of a Qwen3 / Qwen3-MoE `config.json` dictionary; a missing field takes
        transformers' default. Raises ValueError naming the field for RoPE variants or
        sliding-window attention transformers would apply and this model does not implement."""
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"config.json: unsupported model_type {model_type!r}; "
                             f"supported: {SUPPORTED_MODEL_TYPES}")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config.json: hidden_act {hf['hidden_act']!r} is not supported (only 'silu')")
        required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                    "intermediate_size")
        missing = [k for k in required if k not in hf]
        if missing:
            raise ValueError(f"config.json: missing required fields {missing}")
        sizes = (*required, "num_key_value_heads", "head_dim", "moe_intermediate_size",
                 "num_experts", "num_local_experts", "num_experts_per_tok")
        wrong = {k: hf[k] for k in sizes
                 if hf.get(k) is not None and (isinstance(hf[k], bool) or not isinstance(hf[k], int)
                                               or hf[k] < 0)}
        if wrong:
            raise ValueError(f"config.json: sizes must be whole numbers >= 0, got {wrong}")
        _check_full_attention(hf, model_type)
        rope = _rope_parameters(hf)
        default = HF_DEFAULTS[model_type]
        heads = hf["num_attention_heads"]
        fields = dict(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=(hf.get("num_key_value_heads", default["num_key_value_heads"])
                                 or heads),
            head_dim=hf.get("head_dim") or default.get("head_dim") or hf["hidden_size"] // heads,
            intermediate_size=hf["intermediate_size"],
            rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", HF_DEFAULT_ROPE_THETA))),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=hf.get("max_position_embeddings", 32768),
            attention_bias=bool(hf.get("attention_bias", False)),
            initializer_range=float(hf.get("initializer_range", 0.02)),
        )
        if model_type == "qwen3_moe":
            get = lambda key: hf.get(key, default[key])
            fields.update(
                moe_intermediate_size=get("moe_intermediate_size"),
                num_experts=hf.get("num_experts", get("num_local_experts")),
                num_experts_per_tok=get("num_experts_per_tok"),
                norm_topk_prob=bool(get("norm_topk_prob")),
                decoder_sparse_step=hf.get("decoder_sparse_step", 1) or 1,
                mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()))
        fields.update(overrides)
        return cls(**fields)

    @classmethod
    def from_json_file(cls, path: str | os.PathLike, **overrides: Any) -> "Qwen3Config":
        try:
            with open(path) as f:
                hf = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: cannot read config.json ({e})") from e
        return cls.from_hf_dict(hf, **overrides)

    def to_hf_dict(self) -> dict[str, Any]:
        """The `config.json` dictionary transformers reads back into the same architecture."""
        hf: dict[str, Any] = dict(
            architectures=["Qwen3MoeForCausalLM" if self.num_experts else "Qwen3ForCausalLM"],
            model_type=self.model_type,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
            hidden_act="silu",
            rope_theta=self.rope_theta,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
            rms_norm_eps=self.rms_norm_eps,
            tie_word_embeddings=self.tie_word_embeddings,
            max_position_embeddings=self.max_position_embeddings,
            attention_bias=self.attention_bias,
            attention_dropout=0.0,
            initializer_range=self.initializer_range,
            torch_dtype=self.param_dtype,
            dtype=self.param_dtype,
        )
        if self.num_experts:
            hf.update(moe_intermediate_size=self.moe_intermediate_size, num_experts=self.num_experts,
                      num_experts_per_tok=self.num_experts_per_tok,
                      norm_topk_prob=self.norm_topk_prob,
                      decoder_sparse_step=self.decoder_sparse_step,
                      mlp_only_layers=list(self.mlp_only_layers))
        return hf


def _rope_parameters(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The RoPE dictionary as transformers resolves it (a non-empty `rope_scaling` replaces
    `rope_parameters`); raises ValueError naming the field unless it is plain RoPE over the whole
    head."""
    field = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    rope = dict(hf.get(field) or {})
    if any(isinstance(value, Mapping) for value in rope.values()):
        raise ValueError(f"config.json: {field}: RoPE per layer type {sorted(rope)} is not "
                         "supported (only one 'default' RoPE)")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"config.json: {field}: rope_type {rope_type!r} is not supported "
                         "(only 'default')")
    factor = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if factor != 1.0:
        raise ValueError(f"config.json: partial_rotary_factor {factor} is not supported (only "
                         "1.0, RoPE over the whole head)")
    return rope


def _check_full_attention(hf: Mapping[str, Any], model_type: str) -> None:
    """Raises ValueError naming the field when a layer would not use full attention: a
    `layer_types` entry other than 'full_attention', or a `use_sliding_window` window
    transformers would apply."""
    types = list(hf.get("layer_types") or ())
    sliding = [i for i, kind in enumerate(types) if kind != "full_attention"]
    if sliding:
        raise ValueError(f"config.json: layer_types: layers {sliding} are "
                         f"{types[sliding[0]]!r}; only 'full_attention' is supported")
    if not hf.get("use_sliding_window"):
        return
    window = hf.get("sliding_window", HF_DEFAULT_SLIDING_WINDOW)
    if model_type == "qwen3_moe":
        first = 0
    elif types:  # transformers keeps the layer types given
        return
    else:
        first = hf.get("max_window_layers", HF_DEFAULT_MAX_WINDOW_LAYERS)
    if window is not None and first < hf["num_hidden_layers"]:
        raise ValueError(f"config.json: use_sliding_window: a {window}-token window from layer "
                         f"{first} on is not supported (only full attention)")
