"""Qwen3 / Qwen3-MoE in Flax NNX, its configuration, presets and HF checkpoint I/O."""
from mars_jax.models.config import Qwen3Config
from mars_jax.models.hf_io import CheckpointError, from_pretrained, save_pretrained
from mars_jax.models.presets import PRESETS, get_preset
from mars_jax.models.qwen3 import ModelOutput, Qwen3, create_model

__all__ = ["CheckpointError", "ModelOutput", "PRESETS", "Qwen3", "Qwen3Config", "create_model",
           "from_pretrained", "get_preset", "save_pretrained"]
