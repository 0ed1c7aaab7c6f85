"""Orbax checkpoints of a training run: train state (params, optimizer, update count) + JSON meta
(step, data iterator position, pipeline queues and partial segments, counters).

Saves are asynchronous and atomic (orbax writes to a temporary directory and renames it on commit),
so a crash mid-save never damages an earlier checkpoint. Restore walks back from the newest step and
skips, with a warning, any checkpoint that fails to read.
"""
from __future__ import annotations

import logging
import os
from typing import Any

import jax
import orbax.checkpoint as ocp


class Checkpointer:
    """Keeps the last `keep` checkpoints under `directory`."""

    def __init__(self, directory: str | os.PathLike, *, keep: int = 3, async_save: bool = True):
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                               cleanup_tmp_directories=True,
                                               enable_async_checkpointing=async_save)
        self.manager = ocp.CheckpointManager(os.path.abspath(directory), options=options)

    def save(self, step: int, state: Any, meta: dict) -> None:
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True)

    def restore_latest(self, abstract_state: Any) -> tuple[int, Any, dict] | None:
        """(step, state, meta) of the newest readable checkpoint, or None if there is none."""
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_state)
        for step in sorted(self.manager.all_steps(), reverse=True):
            try:
                restored = self.manager.restore(step, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()))
            except Exception as e:  # orbax raises many types for damaged files
                logging.warning("checkpoint at step %d is unreadable (%s); trying an older one",
                                step, e)
                continue
            return step, restored.state, restored.meta
        return None

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
