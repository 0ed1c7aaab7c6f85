"""Jitted prefill + decode on the trainer's parameter arrays (see `sampler` for the design)."""
from mars_jax.sampling.processors import choose_tokens, truncate_logits
from mars_jax.sampling.sampler import SampleResult, SegmentState, generate, prompt_bucket, resume

__all__ = ["SampleResult", "SegmentState", "choose_tokens", "generate", "prompt_bucket", "resume", "truncate_logits"]
