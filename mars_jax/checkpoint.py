"""Orbax checkpoints of a training run: train state + JSON meta + optional per-host arrays.

Integrity rules:
  * Saves are asynchronous and atomic: a save killed midway never damages an earlier checkpoint;
    a failed save raises `CheckpointSaveError` at the next `save`, `wait` or `close`.
  * Only proof of damage (`is_damage`: no commit marker, undecodable bytes, a missing file, a
    fingerprint mismatch) sets a checkpoint aside into `<directory>.unreadable/`; restore then
    tries the next newest. Other read errors are retried, then raise `CheckpointUnavailable`.
  * Restore returns None only for a directory with no step directory, so a run never starts
    from step 0 beside checkpoints; another state layout raises `CheckpointMismatch`.
  * With several processes, all walk process 0's listing and get the same outcome.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from mars_jax import storage

FINGERPRINT_KEY = "state_fingerprint"
ARRAYS_FINGERPRINT_KEY = "arrays_fingerprint"  # present iff the checkpoint has an arrays item
META_FINGERPRINT_KEY = "meta_fingerprint"  # absent in checkpoints written before it existed
CONFIG_KEY = "config"  # the run's config (`Checkpointer(config=...)`), in every checkpoint's meta
READ_RETRY_WAITS = (1.0, 4.0, 16.0)  # seconds before each further attempt to read a checkpoint
STEP_METADATA_FILE = "_CHECKPOINT_METADATA"  # what orbax writes into every step directory
COMMIT_MARKER = "commit_success.txt"  # what orbax writes into a step directory it committed
# What tensorstore says of bytes it read that are not a valid checkpoint: a status code, or
# (status UNKNOWN, no code) a decoding error.
_DAMAGE_TEXT = re.compile(r"^(DATA_LOSS|OUT_OF_RANGE|NOT_FOUND|INVALID_ARGUMENT|"
                          r"FAILED_PRECONDITION):|Error decoding ")


class Restored(NamedTuple):
    """A checkpoint read back by `Checkpointer.restore_latest`."""

    step: int
    state: Any
    meta: dict
    arrays: Any  # None when the checkpoint has no arrays or none were asked for


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written; earlier checkpoints are intact."""

    exit_code = 74  # EX_IOERR: fix the storage, then rerun the same command to resume


class CorruptCheckpoint(ValueError):
    """A checkpoint read back differs from what was saved."""


class CheckpointMismatch(ValueError):
    """A readable checkpoint whose state has another layout than the state to restore into."""

    exit_code = 2  # a config error: restore with the settings it was saved with


class CheckpointUnavailable(RuntimeError):
    """Checkpoints exist but none could be restored (a read failed, or every one was damaged)."""

    exit_code = 74  # EX_IOERR: rerun the same command (a launcher may restart it) to resume


class Checkpointer:
    """Keeps the last `keep` checkpoints under `directory`, `config` (if any) in each meta."""

    def __init__(self, directory: str | os.PathLike, *, keep: int = 3, async_save: bool = True,
                 config: dict | None = None):
        self.directory = os.fspath(storage.path(directory))
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                               cleanup_tmp_directories=True,
                                               enable_async_checkpointing=async_save)
        self.manager, error = _read_with_retries(  # it lists the directory's steps
            lambda: ocp.CheckpointManager(self.directory, options=options),
            f"the checkpoint directory {self.directory}")
        if error is not None:
            raise error
        self.config = config
        self._pending: int | None = None

    def save(self, step: int, state: Any, meta: dict, arrays: Any = None) -> None:
        """Starts saving `state`, `meta` and `arrays` as `step`; raises if an earlier save
        failed."""
        self.wait()
        meta = {**meta, FINGERPRINT_KEY: fingerprint(state)}
        if self.config is not None:
            meta[CONFIG_KEY] = self.config
        items = dict(state=ocp.args.StandardSave(state))
        if arrays is not None:
            meta[ARRAYS_FINGERPRINT_KEY] = fingerprint(arrays)
            items["arrays"] = ocp.args.StandardSave(arrays)
        meta[META_FINGERPRINT_KEY] = meta_fingerprint(meta)
        self._pending = step
        try:
            self.manager.save(step, args=ocp.args.Composite(
                meta=ocp.args.JsonSave(meta), **items), force=True)
        except Exception as e:  # noqa: BLE001 - orbax and tensorstore raise many types
            self._failed(e)

    def wait(self) -> None:
        """Blocks until the pending save is committed; raises `CheckpointSaveError` if it failed."""
        try:
            self.manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001
            self._failed(e)
        self._pending = None

    def steps(self) -> list[int]:
        """The committed steps: process 0's list on every process (a collective)."""
        self.wait()
        return _process_0_value(lambda: list(self.manager.all_steps()))

    def delete(self, step: int) -> None:
        """Removes checkpoint `step` (to save it again), once the pending save is committed."""
        self.wait()
        self.manager.delete(step)

    def _failed(self, error: Exception) -> None:
        step, self._pending = self._pending, None
        self.manager.reload()
        raise CheckpointSaveError(
            f"saving checkpoint {step} to {self.directory} failed: {error}; the previous "
            f"checkpoint ({self.manager.latest_step()}) is intact: fix the storage (e.g. free disk "
            "space) and rerun to resume from it") from error

    def restore_latest(self, abstract_state: Any,
                       arrays_target: Callable[[dict], Any] | None = None,
                       check_meta: Callable[[int, dict], None] | None = None
                       ) -> Restored | None:
        """(step, state, meta, arrays) of the newest intact checkpoint, or None when the
        directory holds no step directory. `check_meta(step, meta)` sees each meta before its
        state is read; `arrays_target(meta)` gives the arrays' abstract pytree (without it they
        are not read). Raises as the module docstring's rules say."""
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_state)
        steps, stray = _listed(self._listing, f"the checkpoint directory {self.directory}")
        if not steps and stray:
            raise ValueError(
                f"{self.directory} holds one checkpoint's files ({STEP_METADATA_FILE}) but no "
                f"step directory: move them into {self.directory}/<its step>/ to resume from "
                "it, or remove them to start afresh")
        for step in steps:
            what = f"checkpoint {step} in {self.directory}"
            _, error = _agreed(lambda: self._check_committed(step), what)
            if error is None:
                meta, error = _agreed(lambda: self._read_meta(step), what)
            if error is not None:
                self._skip(step, error)
                continue
            if check_meta is not None:
                check_meta(step, meta)
            saved, error = _agreed(lambda: self._saved_layout(step), what)
            if error is not None:
                self._skip(step, error)
                continue
            differences = _layout_differences(saved, target)
            if differences:
                raise CheckpointMismatch(
                    f"checkpoint at step {step} in {self.directory} does not fit the state to "
                    f"restore: {'; '.join(differences)}; restore with the model and optimizer "
                    "settings it was saved with, or use another directory to start afresh")
            restored, error = _agreed(
                lambda: self._restore(step, meta, target, arrays_target), what)
            if error is None:
                return restored
            self._skip(step, error)
        if steps:
            raise CheckpointUnavailable(
                f"every checkpoint in {self.directory} (steps {', '.join(map(str, steps))}) is "
                f"damaged; each was moved to {self.directory}.unreadable/: rerun to start afresh "
                "from step 0, or move an intact copy of a step back to resume from it")
        return None

    def _step_dir(self, step: int) -> epath.Path:
        return storage.path(self.directory) / str(step)

    def _steps(self) -> list[int]:
        """Every step directory, newest first: orbax's committed steps and any other directory
        named by a step number (one orbax does not list, e.g. without its commit marker)."""
        self.manager.reload()
        named = {int(entry.name) for entry in storage.entries(self.directory)
                 if entry.name.isdigit() and entry.is_dir()}
        return sorted(named | set(self.manager.all_steps()), reverse=True)

    def _listing(self) -> tuple[list[int], bool]:
        """(`_steps`, whether one checkpoint's files lie at the directory's top)."""
        return self._steps(), (storage.path(self.directory) / STEP_METADATA_FILE).exists()

    def _check_committed(self, step: int) -> None:
        """Raises `CorruptCheckpoint` unless this process sees `step` committed."""
        if not self._step_dir(step).is_dir():
            raise CorruptCheckpoint("its directory is missing")
        if not (self._step_dir(step) / COMMIT_MARKER).exists():
            raise CorruptCheckpoint(f"its directory has no commit marker ({COMMIT_MARKER}): "
                                    "it was not completely written")

    def _read_meta(self, step: int) -> dict:
        """Checkpoint `step`'s meta, its own fingerprint checked and removed."""
        meta = dict(self.manager.restore(step, args=ocp.args.Composite(
            meta=ocp.args.JsonRestore())).meta)
        expected = meta.pop(META_FINGERPRINT_KEY, None)
        if expected is not None and meta_fingerprint(meta) != expected:
            raise CorruptCheckpoint("its meta differs from the one saved (fingerprint)")
        return meta

    def _saved_layout(self, step: int) -> Any:
        """The metadata tree (paths, shapes, dtypes) of checkpoint `step`'s state."""
        handler = ocp.StandardCheckpointHandler()
        try:
            return handler.metadata(self._step_dir(step) / "state").tree
        finally:
            handler.close()

    def _skip(self, step: int, error: Exception) -> None:
        logging.warning("checkpoint at step %d is damaged (%s); set aside, trying an older one",
                        step, error)
        self._set_aside(step)

    def _restore(self, step: int, meta: dict, target: Any,
                 arrays_target: Callable[[dict], Any] | None) -> Restored:
        meta = dict(meta)
        items = dict(state=ocp.args.StandardRestore(target))
        if arrays_target is not None and ARRAYS_FINGERPRINT_KEY in meta:
            try:
                abstract_arrays = arrays_target(dict(meta))
            except Exception as e:  # noqa: BLE001 - the caller's rule for its own meta
                raise CheckpointMismatch(f"checkpoint at step {step} in {self.directory}: "
                                         f"its arrays do not fit this run: {e}") from e
            items["arrays"] = ocp.args.StandardRestore(abstract_arrays)
        restored = self.manager.restore(step, args=ocp.args.Composite(**items))
        expected = meta.pop(FINGERPRINT_KEY, None)
        if expected is not None and fingerprint(restored.state) != expected:
            raise CorruptCheckpoint("its state differs from the one saved (fingerprint)")
        expected = meta.pop(ARRAYS_FINGERPRINT_KEY, None)
        arrays = restored["arrays"] if "arrays" in items else None
        if arrays is not None and fingerprint(arrays) != expected:
            raise CorruptCheckpoint("its arrays differ from the ones saved (fingerprint)")
        return Restored(step, restored.state, meta, arrays)

    def _set_aside(self, step: int) -> None:
        """Moves an unreadable checkpoint out of the manager's directory (kept for inspection)."""
        if jax.process_index() == 0:
            aside = storage.path(self.directory + ".unreadable") / str(step)
            suffix = 0
            while aside.with_name(f"{step}.{suffix}" if suffix else str(step)).exists():
                suffix += 1
            storage.move_tree(self._step_dir(step),
                              aside.with_name(f"{step}.{suffix}" if suffix else str(step)))
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils
            multihost_utils.sync_global_devices(f"checkpoint_set_aside_{step}")
        self.manager.reload()

    def close(self) -> None:
        """Waits for the pending save (raising if it failed) and releases the manager."""
        try:
            self.wait()
        finally:
            self.manager.close()


def _agreed(read: Callable[[], Any], what: str = "a checkpoint"
            ) -> tuple[Any, Exception | None]:
    """(`read()`, None), or (None, the damage) on proof of damage; raises `CheckpointUnavailable`
    or `CheckpointMismatch`, the same outcome on every process."""
    value, error = _read_with_retries(read, what)
    if jax.process_count() == 1:
        if isinstance(error, (CheckpointUnavailable, CheckpointMismatch)):
            raise error
        return value, error
    from mars_jax.distributed import allgather_json
    kind = (None if error is None else "unavailable" if isinstance(error, CheckpointUnavailable)
            else "mismatch" if isinstance(error, CheckpointMismatch) else "damage")
    outcomes = allgather_json(None if error is None else [kind, str(error)])
    failed = lambda kind: {p: o[1] for p, o in enumerate(outcomes) if o and o[0] == kind}
    report = lambda found: "; ".join(f"process {p}: {m}" for p, m in found.items())
    for kind, error_type in (("unavailable", CheckpointUnavailable),
                             ("mismatch", CheckpointMismatch)):
        if failed(kind):
            raise error_type(report(failed(kind))) from error
    damaged = failed("damage")
    if 0 in damaged:
        return None, error or CorruptCheckpoint(f"damaged on process 0: {damaged[0]}")
    if damaged:
        raise CheckpointUnavailable(
            f"{what} is intact on process 0, whose listing every process restores from, but "
            f"other processes cannot read it ({report(damaged)}): their view of the storage "
            "may be stale (a cached listing); nothing was set aside: rerun when every host "
            "sees the same files") from error
    return value, None


def _process_0_value(read: Callable[[], Any]) -> Any:
    """`read()` (JSON) on process 0, the same value on every process."""
    if jax.process_count() == 1:
        return read()
    from mars_jax.distributed import allgather_json
    return allgather_json(read() if jax.process_index() == 0 else None)[0]


def _listed(read: Callable[[], Any], what: str) -> Any:
    """Process 0's `read()` (JSON, retried) on every process, or the same error on every one."""
    def read_or_error():
        value, error = _read_with_retries(read, what)
        if error is not None and not isinstance(error, CheckpointUnavailable):
            error = CheckpointUnavailable(f"reading {what} failed: {error!r}")
        return value, error

    if jax.process_count() == 1:
        value, error = read_or_error()
    else:
        value, error = read_or_error() if jax.process_index() == 0 else (None, None)
        from mars_jax.distributed import allgather_json
        value, message = allgather_json([value, None if error is None else str(error)])[0]
        if message is not None:
            raise CheckpointUnavailable(f"process 0: {message}") from error
    if error is not None:
        raise error
    return value


def _read_with_retries(read: Callable[[], Any], what: str = "a checkpoint"
                       ) -> tuple[Any, Exception | None]:
    """(`read()`, None); (None, the error) at once for a mismatch or damage; (None,
    `CheckpointUnavailable`) once every attempt (`READ_RETRY_WAITS` apart) failed otherwise."""
    for attempt, wait in enumerate((*READ_RETRY_WAITS, None)):
        try:
            return read(), None
        except CheckpointMismatch as e:
            return None, e
        except Exception as e:  # noqa: BLE001 - orbax and tensorstore raise many types
            if is_damage(e):
                return None, e
            if wait is None:
                unavailable = CheckpointUnavailable(
                    f"reading {what} failed {attempt + 1} times without proof of damage "
                    f"(last error: {e!r}); nothing was set aside: rerun when the storage is "
                    "back (a launcher may restart the run) to resume from the newest checkpoint")
                unavailable.__cause__ = e
                return None, unavailable
            logging.warning("reading a checkpoint failed (%s); trying again in %g s", e, wait)
            time.sleep(wait)


def is_damage(error: BaseException) -> bool:
    """Whether `error` (or its cause) proves a checkpoint's files damaged: a fingerprint
    mismatch, undecodable bytes, a missing file, or a tensorstore status saying so."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, (CorruptCheckpoint, json.JSONDecodeError, UnicodeDecodeError,
                              FileNotFoundError)) or _DAMAGE_TEXT.search(str(error)):
            return True
        error = error.__cause__ or error.__context__
    return False


def _layout_differences(saved: Any, target: Any, limit: int = 5) -> list[str]:
    """Up to `limit` differences in paths, shapes and dtypes between checkpoint metadata `saved`
    and abstract state `target`; empty when they agree."""
    have, want = ocp.tree.to_flat_dict(saved), ocp.tree.to_flat_dict(target)
    name = lambda path: ".".join(map(str, path))
    found = [f"{name(p)} is missing from the checkpoint" for p in want if p not in have]
    found += [f"{name(p)} is in the checkpoint but not in the state" for p in have if p not in want]
    for path in (p for p in want if p in have and hasattr(want[p], "dtype")):
        a, b = have[path], want[path]
        if (tuple(a.shape), np.dtype(a.dtype)) != (tuple(b.shape), np.dtype(b.dtype)):
            found.append(f"{name(path)} is {a.dtype}{list(a.shape)} in the checkpoint, "
                         f"{b.dtype}{list(b.shape)} in the state")
    if len(found) > limit:
        found = found[:limit] + [f"{len(found) - limit} more"]
    return found


def meta_fingerprint(meta: dict) -> str:
    """A digest of `meta` as JSON text with sorted keys, after one JSON round trip (so that
    tuples and lists, int and str keys, digest alike before saving and after reading)."""
    text = json.dumps(json.loads(json.dumps(meta)), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def fingerprint(state: Any) -> str:
    """A digest of every array's shape, dtype and bits, whatever their sharding."""
    leaves = [jnp.asarray(x) for x in jax.tree.leaves(state)]
    sums = np.asarray(jax.device_get(_bit_sums(leaves)))
    layout = repr([(x.shape, str(x.dtype)) for x in leaves]).encode()
    return hashlib.sha256(layout + sums.tobytes()).hexdigest()[:32]


@jax.jit
def _bit_sums(leaves: list[jax.Array]) -> jax.Array:
    """[n, 2] uint32: per array, the sum of its words and their position-weighted sum."""
    return jnp.stack([_leaf_sums(x) for x in leaves]) if leaves else jnp.zeros((0, 2), jnp.uint32)


def _leaf_sums(x: jax.Array) -> jax.Array:
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    unsigned = {1: jnp.uint8, 2: jnp.uint16}.get(x.dtype.itemsize, jnp.uint32)
    words = jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)
    position, stride = jnp.zeros(words.shape, jnp.uint32), 1
    for axis in reversed(range(words.ndim)):
        position += jax.lax.broadcasted_iota(jnp.uint32, words.shape, axis) * jnp.uint32(stride)
        stride = stride * words.shape[axis] % 2**32
    return jnp.stack([jnp.sum(words, dtype=jnp.uint32),
                      jnp.sum(words * (2 * position + 1), dtype=jnp.uint32)])


def committed_steps(directory: str | os.PathLike) -> list[int]:
    """The committed steps under `directory`, newest first (read only: nothing set aside)."""
    path = epath.Path(directory)
    if not path.is_dir():
        raise FileNotFoundError(f"no checkpoint directory {path}")
    return sorted((int(p.name) for p in path.iterdir()
                   if p.name.isdigit() and (p / COMMIT_MARKER).exists()), reverse=True)


def read_meta(directory: str | os.PathLike, step: int) -> dict:
    """Checkpoint `step`'s JSON meta (the run's config under `CONFIG_KEY`), its fingerprint
    checked and removed; raises `CorruptCheckpoint` when it differs from the one saved."""
    checkpointer = ocp.Checkpointer(ocp.JsonCheckpointHandler())
    try:
        meta = dict(checkpointer.restore(epath.Path(directory) / str(step) / "meta"))
    finally:
        checkpointer.close()
    expected = meta.pop(META_FINGERPRINT_KEY, None)
    if expected is not None and meta_fingerprint(meta) != expected:
        raise CorruptCheckpoint(f"checkpoint {step} in {directory}: its meta differs from the "
                                "one saved (fingerprint)")
    return meta


def restore_params(directory: str | os.PathLike, step: int, target: Any) -> Any:
    """The `params` subtree of checkpoint `step`'s train state, read into `target`'s structure
    and shardings without the optimizer state; `CheckpointMismatch` for another layout."""
    path = epath.Path(directory) / str(step) / "state"
    handler = ocp.StandardCheckpointHandler()
    try:
        saved = handler.metadata(path).tree
    finally:
        handler.close()
    if "params" not in saved:
        raise CheckpointMismatch(f"checkpoint {step} in {directory} holds no parameters "
                                 f"(its state has {sorted(saved)})")
    differences = _layout_differences(saved["params"], target)
    if differences:
        raise CheckpointMismatch(
            f"checkpoint {step} in {directory}: its parameters do not fit the model of the run's "
            f"config: {'; '.join(differences)}")
    item = {"params": target}
    checkpointer = ocp.PyTreeCheckpointer()
    try:
        return checkpointer.restore(path, args=ocp.args.PyTreeRestore(
            item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item),
            partial_restore=True))["params"]
    finally:
        checkpointer.close()
