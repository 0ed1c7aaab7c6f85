"""Jitted prefill + decode on the trainer's parameter arrays: `generate` (static batches, the
reference path), `Engine` (continuous batching over fixed slots), `StaticBatchEngine` (`Engine`'s
request interface on `generate`) and `decode_batch` (a batch of requests through either)."""
from mars_jax.sampling.decode import (ContinuingEngine, DecodeEngine, EngineSettings, decode_batch,
                                      make_engine)
from mars_jax.sampling.engine import Engine, EngineOutput
from mars_jax.sampling.processors import choose_tokens, truncate_logits
from mars_jax.sampling.sampler import SampleResult, batch_shards, generate, prompt_bucket
from mars_jax.sampling.static_engine import StaticBatchEngine

__all__ = ["ContinuingEngine", "DecodeEngine", "Engine", "EngineOutput", "EngineSettings",
           "SampleResult", "StaticBatchEngine", "batch_shards", "choose_tokens", "decode_batch", "generate",
           "make_engine", "prompt_bucket", "truncate_logits"]
