"""Checkpoint integrity: damaged checkpoints are skipped on restore; failed or killed saves never
damage the previous checkpoint."""
import errno
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from mars_jax.checkpoint import (CheckpointMismatch, Checkpointer, CheckpointSaveError,
                                 CheckpointUnavailable)
from tests.fault import harness


@pytest.fixture(autouse=True)
def _no_retry_waits(monkeypatch):
    from mars_jax import checkpoint
    monkeypatch.setattr(checkpoint, "READ_RETRY_WAITS", (0.0, 0.0))


def _state(step: int) -> dict:
    rng = np.random.default_rng(step)
    return {"w": jnp.asarray(rng.standard_normal((256, 64), dtype=np.float32)),
            "b": jnp.asarray(rng.standard_normal(64).astype(jnp.bfloat16)), "step": jnp.int32(step)}


def _save_steps(directory: Path, steps) -> None:
    checkpointer = Checkpointer(directory, keep=5)
    for step in steps:
        checkpointer.save(step, _state(step), {"step": step})
    checkpointer.close()


def _assert_restores(directory: Path, step: int) -> Checkpointer:
    checkpointer = Checkpointer(directory, keep=5)
    restored_step, state, meta, _ = checkpointer.restore_latest(_state(0))
    assert (restored_step, meta) == (step, {"step": step})
    for key, value in _state(step).items():
        np.testing.assert_array_equal(np.asarray(state[key]), np.asarray(value))
    return checkpointer


def _largest_file(directory: Path) -> Path:
    return max((p for p in directory.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def _flip_bytes(data: Path, at: int = 100) -> None:
    """Inverts the 16 bytes of `data` from offset `at`; the file keeps its length."""
    content = bytearray(data.read_bytes())
    content[at:at + 16] = bytes(b ^ 0xFF for b in content[at:at + 16])
    data.write_bytes(bytes(content))


@pytest.mark.parametrize("damage", ["truncate", "flip_bytes"])
def test_a_damaged_latest_checkpoint_falls_back_to_the_previous_one(tmp_path, caplog, damage):
    directory = tmp_path / "checkpoints"
    _save_steps(directory, [1, 2, 3])
    if damage == "truncate":
        data = _largest_file(directory / "3")
        content = data.read_bytes()
        data.write_bytes(content[:len(content) // 2])
    else:  # same length: only the stored fingerprint can tell
        _flip_bytes(_largest_file(directory / "3"))

    with caplog.at_level(logging.WARNING):
        checkpointer = _assert_restores(directory, 2)
    assert "checkpoint at step 3 is damaged" in caplog.text
    if damage == "flip_bytes":
        assert "fingerprint" in caplog.text
    # The damaged step is set aside, so the resumed run can write step 3 again.
    assert (tmp_path / "checkpoints.unreadable/3").is_dir()
    checkpointer.save(3, _state(3), {"step": 3})
    checkpointer.close()
    _assert_restores(directory, 3).close()


def _fail_json_write_midway(monkeypatch):
    """Makes the meta writer stop halfway with ENOSPC, as on a full disk."""
    async def full_disk(self, item, directory):
        path = directory / self._filename
        text = json.dumps(item)
        path.write_text(text[:len(text) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    monkeypatch.setattr(ocp.JsonCheckpointHandler, "_save_fn", full_disk)


def test_a_save_failing_with_enospc_raises_and_keeps_the_previous_checkpoint(tmp_path,
                                                                            monkeypatch):
    directory = tmp_path / "checkpoints"
    checkpointer = Checkpointer(directory, keep=1)  # keep=1: the only good one must survive
    checkpointer.save(1, _state(1), {"step": 1})
    checkpointer.wait()
    _fail_json_write_midway(monkeypatch)
    checkpointer.save(2, _state(2), {"step": 2})  # asynchronous: fails in the background
    with pytest.raises(CheckpointSaveError, match=r"checkpoint 2 .*No space left on device.*"
                                                   r"previous checkpoint \(1\) is intact"):
        checkpointer.save(3, _state(3), {"step": 3})
    assert checkpointer.manager.all_steps() == [1]  # not pointing at the failed step
    monkeypatch.undo()
    checkpointer.close()
    _assert_restores(directory, 1).close()
    assert not (directory / "2").exists()  # only a temporary directory, never a step


def test_a_full_tmpfs_fails_the_save_and_keeps_the_previous_checkpoint(tmp_path):
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    # One checkpoint of _state (~80 KB incompressible) fits in 150 KB, two do not.
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=150k", "tmpfs", str(mount)],
                      capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs (needs root)")
    try:
        directory = mount / "checkpoints"
        checkpointer = Checkpointer(directory, keep=1)
        checkpointer.save(1, _state(1), {"step": 1})
        checkpointer.wait()
        checkpointer.save(2, _state(2), {"step": 2})
        with pytest.raises(CheckpointSaveError, match="No space left on device"):
            checkpointer.close()
        _assert_restores(directory, 1).close()
    finally:
        subprocess.run(["umount", str(mount)], check=True)


_KILLED_SAVE = """
import json, time, jax.numpy as jnp, orbax.checkpoint as ocp
from mars_jax.checkpoint import Checkpointer
from tests.fault.test_checkpoint_integrity import _state

async def hang_midway(self, item, directory):
    text = json.dumps(item)
    (directory / self._filename).write_text(text[:len(text) // 2])
    time.sleep(600)

checkpointer = Checkpointer({directory!r}, keep=1)
checkpointer.save(1, _state(1), {{"step": 1}})
checkpointer.wait()
ocp.JsonCheckpointHandler._save_fn = hang_midway
checkpointer.save(2, _state(2), {{"step": 2}})
time.sleep(600)
"""


def test_a_save_killed_midway_keeps_the_previous_checkpoint(tmp_path):
    directory = tmp_path / "checkpoints"
    script = textwrap.dedent(_KILLED_SAVE.format(directory=str(directory)))
    process = subprocess.Popen([sys.executable, "-c", script], cwd=harness.REPO, env=harness.env())
    deadline = time.time() + 300
    while not list(directory.glob("2.orbax-checkpoint-tmp*/meta*/metadata")):
        assert process.poll() is None and time.time() < deadline, "the save never started"
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)  # a half-written meta file is on disk
    process.wait()
    assert not (directory / "2").exists()
    checkpointer = _assert_restores(directory, 1)
    checkpointer.save(2, _state(2), {"step": 2})
    checkpointer.close()
    _assert_restores(directory, 2).close()
    shutil.rmtree(directory)


def _steps_on_disk(directory: Path) -> list[int]:
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


def test_only_the_newest_keep_checkpoints_stay(tmp_path):
    directory = tmp_path / "checkpoints"
    checkpointer = Checkpointer(directory, keep=2)
    for step in range(1, 6):
        checkpointer.save(step, _state(step), {"step": step})
    checkpointer.close()
    assert _steps_on_disk(directory) == [4, 5]
    # A resumed run (a new manager on the same directory) keeps pruning to `keep`.
    checkpointer = Checkpointer(directory, keep=2)
    checkpointer.save(6, _state(6), {"step": 6})
    checkpointer.close()
    assert _steps_on_disk(directory) == [5, 6]
    checkpointer = Checkpointer(directory, keep=2)
    step, state, meta, _ = checkpointer.restore_latest(_state(0))
    checkpointer.close()
    assert (step, meta) == (6, {"step": 6})
    np.testing.assert_array_equal(np.asarray(state["w"]), np.asarray(_state(6)["w"]))


@pytest.mark.parametrize("exists", [True, False])
def test_restore_latest_of_an_empty_directory_is_none(tmp_path, exists):
    directory = tmp_path / "checkpoints"
    if exists:
        directory.mkdir()
    checkpointer = Checkpointer(directory, keep=2)
    assert checkpointer.restore_latest(_state(0)) is None
    checkpointer.close()


def test_a_checkpoint_copied_without_its_step_directory_raises(tmp_path):
    """One step's files at the top of the directory (e.g. `cp -r run/checkpoints/3 new/checkpoints`
    when `new/checkpoints` does not exist) are refused instead of starting afresh beside them."""
    _save_steps(tmp_path / "saved", [3])
    shutil.copytree(tmp_path / "saved" / "3", tmp_path / "checkpoints")
    checkpointer = Checkpointer(tmp_path / "checkpoints", keep=2)
    with pytest.raises(ValueError, match=r"holds one checkpoint's files .*move them into "
                                         r".*checkpoints/<its step>/"):
        checkpointer.restore_latest(_state(0))
    checkpointer.close()


def test_restore_latest_when_every_checkpoint_is_damaged_raises_then_starts_afresh(tmp_path,
                                                                                 caplog):
    """Damaged checkpoints are set aside, but a run never starts from step 0 beside them: the
    restore that set the last one aside fails; the next one finds no step and starts afresh."""
    directory = tmp_path / "checkpoints"
    _save_steps(directory, [1, 2])
    for step in (1, 2):
        data = _largest_file(directory / str(step))
        data.write_bytes(data.read_bytes()[:100])
    checkpointer = Checkpointer(directory, keep=5)
    with caplog.at_level(logging.WARNING), pytest.raises(
            CheckpointUnavailable, match=r"every checkpoint in .*checkpoints \(steps 2, 1\) is "
                                         r"damaged; each was moved to .*checkpoints.unreadable/"):
        checkpointer.restore_latest(_state(0))
    assert "step 2 is damaged" in caplog.text and "step 1 is damaged" in caplog.text
    assert _steps_on_disk(directory) == []
    assert sorted(p.name for p in (tmp_path / "checkpoints.unreadable").iterdir()) == ["1", "2"]
    assert checkpointer.restore_latest(_state(0)) is None
    checkpointer.save(1, _state(1), {"step": 1})  # a fresh start can write step 1 again
    checkpointer.close()
    _assert_restores(directory, 1).close()


@pytest.mark.parametrize("target, difference", [
    ({"w": jnp.zeros(5)}, r"w is float32\[4\] in the checkpoint, float32\[5\] in the state"),
    ({"w": jnp.zeros(4, jnp.bfloat16)},
     r"w is float32\[4\] in the checkpoint, bfloat16\[4\] in the state"),
    ({"w": jnp.zeros(4), "b": jnp.zeros(2)}, "b is missing from the checkpoint"),
    ({"v": jnp.zeros(4)}, "v is missing from the checkpoint; w is in the checkpoint but not in"),
])
def test_a_state_that_does_not_fit_the_checkpoint_raises_and_sets_nothing_aside(
        tmp_path, target, difference):
    directory = tmp_path / "checkpoints"
    checkpointer = Checkpointer(directory, keep=5)
    for step in (1, 2):
        checkpointer.save(step, {"w": jnp.ones(4)}, {"step": step})
    checkpointer.close()
    checkpointer = Checkpointer(directory, keep=5)
    with pytest.raises(CheckpointMismatch, match=f"checkpoint at step 2 in .* does not fit the "
                                                 f"state to restore: {difference}"):
        checkpointer.restore_latest(target)
    checkpointer.close()
    assert _steps_on_disk(directory) == [1, 2]
    assert not (tmp_path / "checkpoints.unreadable").exists()


def test_an_unreadable_latest_checkpoint_then_a_mismatched_one_raises_for_the_readable_step(
        tmp_path):
    directory = tmp_path / "checkpoints"
    _save_steps(directory, [1, 2])
    metadata = directory / "2" / "state" / "_METADATA"
    metadata.write_bytes(metadata.read_bytes()[:40])  # torn: its layout cannot be read
    checkpointer = Checkpointer(directory, keep=5)
    with pytest.raises(CheckpointMismatch, match=r"step 1 .*w is float32\[256, 64\] in the "
                                                 r"checkpoint, float32\[256, 32\] in the state"):
        checkpointer.restore_latest({**_state(0), "w": jnp.zeros((256, 32))})
    checkpointer.close()
    assert _steps_on_disk(directory) == [1]


def test_a_legacy_checkpoint_without_a_fingerprint_restores(tmp_path, caplog):
    """Checkpoints written before fingerprints existed: the same items, no fingerprint in meta."""
    directory = tmp_path / "checkpoints"
    manager = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(create=True))
    manager.save(7, args=ocp.args.Composite(state=ocp.args.StandardSave(_state(7)),
                                            meta=ocp.args.JsonSave({"step": 7, "data": [1, 2]})))
    manager.wait_until_finished()
    manager.close()
    checkpointer = Checkpointer(directory, keep=2)
    with caplog.at_level(logging.WARNING):
        step, state, meta, _ = checkpointer.restore_latest(_state(0))
    checkpointer.close()
    assert (step, meta) == (7, {"step": 7, "data": [1, 2]})
    for key, value in _state(7).items():
        np.testing.assert_array_equal(np.asarray(state[key]), np.asarray(value))
    assert "damaged" not in caplog.text


def _routing(seed: int) -> dict[str, np.ndarray]:
    """Expert ids [layers=3, positions, k=2] of a few rollouts, by uid (128 experts)."""
    rng = np.random.default_rng(seed)
    return {f"{seed}-0/s0/{i}": rng.integers(0, 128, (3, n, 2)).astype(np.int32)
            for i, n in enumerate((5, 1700, 1))}  # 1700: data in its own file


def _save_with_routing(directory: Path, steps) -> None:
    from mars_jax import distributed
    checkpointer = Checkpointer(directory, keep=5)
    for step in steps:
        index, array = distributed.host_arrays(_routing(step))
        assert array.dtype == np.uint8 and array.shape[0] == 1  # one host; ids < 256
        checkpointer.save(step, _state(step), {"step": step, "routing": index},
                          arrays={"routing": array})
    checkpointer.close()


def _restore_with_routing(directory: Path, with_target: bool = True):
    from mars_jax import distributed
    checkpointer = Checkpointer(directory, keep=5)
    target = lambda meta: {"routing": distributed.host_arrays_target(meta["routing"])}
    restored = checkpointer.restore_latest(_state(0), arrays_target=target if with_target else None)
    checkpointer.close()
    if restored.arrays is None:
        return restored.step, None
    return restored.step, distributed.unpack_host_arrays(restored.meta["routing"],
                                                         restored.arrays["routing"])


def _assert_routing_equal(back: dict, step: int) -> None:
    assert back.keys() == _routing(step).keys()
    for uid, ids in _routing(step).items():
        assert back[uid].dtype == np.int32
        np.testing.assert_array_equal(back[uid], ids)


def test_per_host_arrays_round_trip(tmp_path):
    _save_with_routing(tmp_path, [1, 2])
    step, back = _restore_with_routing(tmp_path)
    assert step == 2
    _assert_routing_equal(back, 2)
    assert _restore_with_routing(tmp_path, with_target=False) == (2, None)  # arrays left unread


def test_damaged_arrays_fall_back_to_the_previous_checkpoint(tmp_path, caplog):
    _save_with_routing(tmp_path, [1, 2])
    for data in (tmp_path / "2" / "arrays").glob("ocdbt.process_*/d/*"):
        _flip_bytes(data, at=data.stat().st_size // 2 - 8)  # decoding or the fingerprint fails
    with caplog.at_level(logging.WARNING):
        step, back = _restore_with_routing(tmp_path)
    assert step == 1 and "checkpoint at step 2 is damaged" in caplog.text
    _assert_routing_equal(back, 1)


def test_arrays_that_do_not_fit_this_run_raise_and_set_nothing_aside(tmp_path):
    from mars_jax import distributed
    _save_with_routing(tmp_path, [1, 2])
    checkpointer = Checkpointer(tmp_path, keep=5)
    other_hosts = lambda meta: distributed.local_process_meta({**meta, "process_count": 2})
    with pytest.raises(CheckpointMismatch, match="step 2 .*arrays do not fit this run: .*"
                                                 "written by 2 processes"):
        checkpointer.restore_latest(_state(0), arrays_target=other_hosts)
    checkpointer.close()
    assert _steps_on_disk(tmp_path) == [1, 2]


def _two_processes(monkeypatch, other: list | None) -> list:
    """Makes `checkpoint` see process 0 (this one) of 2, whose peer reports `other` to
    `allgather_json`; returns the values this process sent."""
    from mars_jax import checkpoint, distributed
    monkeypatch.setattr(checkpoint.jax, "process_count", lambda: 2)
    monkeypatch.setattr(checkpoint.jax, "process_index", lambda: 0)
    sent = []
    monkeypatch.setattr(distributed, "allgather_json", lambda value: sent.append(value) or [
        json.loads(json.dumps(value)), other])
    return sent


def test_damage_on_process_0_makes_every_process_skip_the_checkpoint(monkeypatch):
    from mars_jax import checkpoint
    _two_processes(monkeypatch, None)  # the other process read it
    value, error = checkpoint._agreed(
        lambda: (_ for _ in ()).throw(checkpoint.CorruptCheckpoint("fingerprint")))
    assert value is None and isinstance(error, checkpoint.CorruptCheckpoint)


def test_damage_seen_only_by_another_process_stops_every_process_setting_nothing_aside(
        monkeypatch):
    from mars_jax import checkpoint
    sent = _two_processes(monkeypatch, ["damage", "its directory is missing"])
    with pytest.raises(CheckpointUnavailable, match="checkpoint 3 is intact on process 0, .*"
                                                    "process 1: its directory is missing"):
        checkpoint._agreed(lambda: "read here", "checkpoint 3")
    assert sent == [None]
    with pytest.raises(CheckpointMismatch, match="process 1: layout"):  # any process's mismatch
        _two_processes(monkeypatch, ["mismatch", "layout"])
        checkpoint._agreed(lambda: "read here")
    _two_processes(monkeypatch, None)
    assert checkpoint._agreed(lambda: "read here") == ("read here", None)


def test_every_process_walks_the_listing_of_process_0(tmp_path, monkeypatch):
    """Process 0 (this one) lists steps 1 and 2; its peer's listing is never read."""
    from mars_jax import checkpoint
    directory = tmp_path / "checkpoints"
    _save_steps(directory, [1, 2])
    checkpointer = Checkpointer(directory, keep=5)
    sent = _two_processes(monkeypatch, None)
    assert checkpointer.steps() == [1, 2] and sent == [[1, 2]]
    assert checkpoint._listed(checkpointer._listing, "it") == [[2, 1], False]
    monkeypatch.setattr(checkpoint.jax, "process_index", lambda: 1)  # now as process 1
    monkeypatch.setattr(checkpointer, "_steps", lambda: [1])  # a stale listing: never read
    from mars_jax import distributed
    monkeypatch.setattr(distributed, "allgather_json", lambda value: [[[[2, 1], False], None],
                                                                      value])
    assert checkpoint._listed(checkpointer._listing, "it") == [[2, 1], False]
    monkeypatch.setattr(distributed, "allgather_json", lambda value: [[None, "disk gone"], value])
    with pytest.raises(CheckpointUnavailable, match="process 0: disk gone"):
        checkpoint._listed(checkpointer._listing, "it")
    checkpointer.close()


def test_a_read_that_fails_once_restores_the_newest_checkpoint(tmp_path, monkeypatch, caplog):
    """A transient storage error (the first read of step 3 fails) costs no checkpoint."""
    directory = tmp_path / "checkpoints"
    _save_steps(directory, [2, 3])
    failures = iter([OSError("connection reset")])
    real_restore = ocp.CheckpointManager.restore

    def flaky_restore(self, step, *args, **kwargs):
        for error in failures:
            raise error
        return real_restore(self, step, *args, **kwargs)

    monkeypatch.setattr(ocp.CheckpointManager, "restore", flaky_restore)
    with caplog.at_level(logging.WARNING):
        _assert_restores(directory, 3).close()
    assert "connection reset" in caplog.text and "damaged" not in caplog.text
    assert not (tmp_path / "checkpoints.unreadable").exists()


def test_a_checkpoint_whose_fingerprint_differs_is_read_once(tmp_path, monkeypatch):
    """Bits that differ from the ones saved are damage, not a storage hiccup: no second read."""
    directory = tmp_path / "checkpoints"
    _save_steps(directory, [2, 3])
    _flip_bytes(_largest_file(directory / "3"))
    reads = []
    real_restore = ocp.CheckpointManager.restore

    def counted_restore(self, step, *args, **kwargs):
        if "state" in kwargs["args"].keys():
            reads.append(step)
        return real_restore(self, step, *args, **kwargs)

    monkeypatch.setattr(ocp.CheckpointManager, "restore", counted_restore)
    _assert_restores(directory, 2).close()
    assert reads == [3, 2]


def _save_with_meta(directory: Path, steps) -> None:
    checkpointer = Checkpointer(directory, keep=5, config={"rollout": {"group_size": 8}})
    for step in steps:
        checkpointer.save(step, _state(step), {"step": step, "data": {"next_index": 5 * step}})
    checkpointer.close()


@pytest.mark.parametrize("damage", ["edit_a_value", "flip_a_byte"])
def test_a_damaged_meta_sets_its_step_aside_and_restores_the_previous_one(tmp_path, caplog,
                                                                         damage):
    directory = tmp_path / "checkpoints"
    _save_with_meta(directory, [1, 2])
    meta_file = directory / "2" / "meta" / "metadata"
    text = meta_file.read_bytes()
    if damage == "edit_a_value":  # still valid JSON: only the meta fingerprint can tell
        assert text.count(b'"next_index": 10') == 1
        meta_file.write_bytes(text.replace(b'"next_index": 10', b'"next_index": 11'))
    else:
        at = text.index(b'"group_size": 8') + len(b'"group_size": ')
        meta_file.write_bytes(text[:at] + bytes([text[at] ^ 0x01]) + text[at + 1:])  # 8 -> 9
    checkpointer = Checkpointer(directory, keep=5)
    with caplog.at_level(logging.WARNING):
        step, _, meta, _ = checkpointer.restore_latest(_state(0))
    checkpointer.close()
    assert (step, meta["data"]) == (1, {"next_index": 5})
    assert meta["config"] == {"rollout": {"group_size": 8}}
    assert "checkpoint at step 2 is damaged (its meta differs from the one saved" in caplog.text
    assert _steps_on_disk(directory) == [1]
    assert (tmp_path / "checkpoints.unreadable/2").is_dir()


def test_a_step_without_its_commit_marker_is_set_aside(tmp_path, caplog):
    """A step directory whose commit never happened (e.g. copied in part), listed by orbax on a
    local disk or not, is damage: the previous step is restored."""
    directory = tmp_path / "checkpoints"
    _save_steps(directory, [1, 2])
    (directory / "2" / "commit_success.txt").unlink()
    with caplog.at_level(logging.WARNING):
        _assert_restores(directory, 1).close()
    assert "step 2 is damaged (its directory has no commit marker" in caplog.text
    assert _steps_on_disk(directory) == [1]


class _Outage:
    """Reads of checkpoints fail with an I/O error until `seconds` have passed on a clock that
    only the retry waits advance."""

    def __init__(self, seconds: float):
        self.seconds, self.now, self.failed_reads = seconds, 0.0, 0
        self.real_restore = ocp.CheckpointManager.restore

    def sleep(self, seconds: float) -> None:
        self.now += seconds

    def restore(self, manager, step, *args, **kwargs):
        if self.now < self.seconds:
            self.failed_reads += 1
            raise OSError(errno.EIO, f"storage unavailable (injected, t={self.now:g}s)")
        return self.real_restore(manager, step, *args, **kwargs)


def test_a_storage_outage_fails_the_restore_sets_nothing_aside_and_a_restart_resumes(
        tmp_path, monkeypatch, caplog):
    """Reads fail for 60 s (simulated) then recover: each start during the outage fails after
    its bounded retries, naming the directory, and sets nothing aside; the first start after it
    restores the newest step."""
    from mars_jax import checkpoint
    directory = tmp_path / "checkpoints"
    _save_steps(directory, [1, 2, 3])
    outage = _Outage(60.0)
    monkeypatch.setattr(checkpoint, "READ_RETRY_WAITS", (1.0, 4.0, 16.0))
    monkeypatch.setattr(checkpoint, "time", types.SimpleNamespace(sleep=outage.sleep))
    monkeypatch.setattr(ocp.CheckpointManager, "restore",
                        lambda self, step, *a, **k: outage.restore(self, step, *a, **k))
    starts = []
    while True:  # a launcher restarting the run after each failure
        starts.append(outage.now)
        checkpointer = Checkpointer(directory, keep=5)
        try:
            step, state, _, _ = checkpointer.restore_latest(_state(0))
            break
        except CheckpointUnavailable as e:
            assert (f"reading checkpoint 3 in {directory} failed 4 times without proof of damage"
                    in str(e)) and "storage unavailable (injected" in str(e)
            assert "nothing was set aside: rerun when the storage is back" in str(e)
            assert _steps_on_disk(directory) == [1, 2, 3]
        finally:
            checkpointer.close()
    assert starts == [0.0, 21.0, 42.0]  # each start: 4 reads, 1 + 4 + 16 s of waits
    assert step == 3 and outage.failed_reads == 4 + 4 + 3
    np.testing.assert_array_equal(np.asarray(state["w"]), np.asarray(_state(3)["w"]))
    assert not (tmp_path / "checkpoints.unreadable").exists()
    assert "damaged" not in caplog.text


def test_a_directory_that_cannot_be_listed_raises_naming_it(tmp_path, monkeypatch):
    def unavailable(self, directory, *args, **kwargs):
        raise OSError(errno.EIO, "Input/output error", str(directory))

    monkeypatch.setattr(ocp.CheckpointManager, "__init__", unavailable)
    with pytest.raises(CheckpointUnavailable, match=f"reading the checkpoint directory "
                                                    f"{tmp_path} failed 3 times .*rerun when "):
        Checkpointer(tmp_path)


@pytest.mark.parametrize("error, damage", [
    (OSError(errno.EIO, "Input/output error"), False),
    (ConnectionResetError("connection reset"), False),
    (PermissionError(errno.EACCES, "Permission denied"), False),
    (ValueError("UNAVAILABLE: GCS returned 503"), False),
    (ValueError("DEADLINE_EXCEEDED: read timed out"), False),
    (RuntimeError("something orbax has not said before"), False),
    (FileNotFoundError(errno.ENOENT, "No such file", "meta/metadata"), True),
    (json.JSONDecodeError("Unterminated string", '{"a', 1), True),
    (ValueError("DATA_LOSS: Error decoding manifest"), True),
    (ValueError('Error opening "zarr" driver: Error decoding b-tree node: Data corruption'), True),
])
def test_only_errors_that_prove_damage_are_damage(error, damage):
    from mars_jax.checkpoint import CorruptCheckpoint, is_damage
    assert is_damage(error) is damage
    try:  # as orbax wraps tensorstore's errors
        raise Exception("Encountered error while reading array index") from error
    except Exception as wrapped:  # noqa: BLE001
        assert is_damage(wrapped) is damage
    assert is_damage(CorruptCheckpoint("fingerprint"))
