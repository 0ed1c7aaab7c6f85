"""A `jax.profiler` trace of a range of a run's steps (`profile_steps=(first, last)`), written where
TensorBoard's profile tab reads it (staged locally for a `gs://` logdir). Python calls are not
traced (`python_tracer_level=0`), which keeps traces small; device programs are.
"""
from __future__ import annotations

import os
from collections.abc import Sequence

import jax

from mars_jax import storage


class StepProfiler:
    """Traces the steps `steps` = (first, last) that run (empty: none)."""

    def __init__(self, steps: Sequence[int], logdir: str | os.PathLike):
        self.first, self.last = (tuple(steps) or (0, -1))
        self.logdir = logdir
        self._staging: storage.LocalStaging | None = None

    def before(self, step: int) -> None:
        """Starts the trace if `step` is the first traced step that runs (a resume may start
        late)."""
        if self._staging is None and self.first <= step <= self.last:
            self._staging = storage.LocalStaging(self.logdir)
            options = jax.profiler.ProfileOptions()
            options.python_tracer_level = 0
            jax.profiler.start_trace(os.fspath(self._staging.local), profiler_options=options)

    def after(self, step: int) -> None:
        """Stops the trace (and writes it to `logdir`) after step `last`."""
        if step >= self.last:
            self.close()

    def close(self) -> None:
        """Stops a running trace and writes it to `logdir` (e.g. a run stopped inside the range)."""
        if self._staging is not None:
            staging, self._staging = self._staging, None
            jax.profiler.stop_trace()
            staging.publish()
