"""Jitted prefill + decode on the trainer's parameter arrays (see `sampler` for the design)."""
from mars_jax.sampling.processors import choose_tokens, truncate_logits
from mars_jax.sampling.sampler import SampleResult, SegmentState, generate, resume

__all__ = ["SampleResult", "SegmentState", "choose_tokens", "generate", "resume", "truncate_logits"]
