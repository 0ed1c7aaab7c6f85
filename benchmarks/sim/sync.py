"""The synchronous baseline peers compare against (AReaL's synchronous runs on SGLang, verl's
"colocate sync" on vLLM): one barrier per training step, none between stages.

`SyncRollouts` is `StreamingRollouts` in sequential mode (a step's `prompts_per_step` problems
are taken together and `collect` returns once every trajectory of them is complete, so nothing
of step t + 1 is submitted before step t's update) with the stage barriers lifted: a stage's
requests are submitted the moment their group's previous stage completes, into the running
engine (continuous batching), as an agent loop does. It only adds a submission after each
absorbed output; the engine picks requests submitted mid-stream up on its next admission.
"""
from __future__ import annotations

from mars_jax.rl.streaming import StreamingRollouts


class SyncRollouts(StreamingRollouts):
    """One barrier per step: `mode` must be 'sequential' (module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.mode != "sequential":
            raise ValueError(f"SyncRollouts: mode must be 'sequential', got {self.mode!r}")

    def _absorb(self, request_id: int, output, version: int) -> None:
        super()._absorb(request_id, output, version)
        self._submit(version)
