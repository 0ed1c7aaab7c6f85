"""Jitted prefill + decode on the trainer's parameter arrays: `generate` (static batches, the
reference path) and `Engine` (continuous batching over fixed slots)."""
from mars_jax.sampling.engine import Engine, EngineOutput
from mars_jax.sampling.processors import choose_tokens, truncate_logits
from mars_jax.sampling.sampler import SampleResult, batch_shards, generate, prompt_bucket

__all__ = ["Engine", "EngineOutput", "SampleResult", "batch_shards", "choose_tokens", "generate",
           "prompt_bucket", "truncate_logits"]
