"""A resume never starts over beside checkpoints it could not read, and never continues a run
whose config changed what its checkpoint means (tiny smoke runs in subprocesses)."""
import json
import shutil
import subprocess

import pytest

from tests.fault import harness


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory):
    """A finished 2-step smoke run (a checkpoint after each step), both steps profiled."""
    workdir = tmp_path_factory.mktemp("two_steps") / "run"
    subprocess.run(harness.command(workdir, "--config.total_steps=2",
                                   "--config.profile_steps=1,2"),
                   env=harness.env(), check=True, capture_output=True, timeout=900)
    return workdir


def test_the_run_records_its_config_and_the_profiled_steps_trace(two_steps):
    recorded = json.loads((two_steps / "config.json").read_text())
    assert recorded["total_steps"] == 2 and recorded["profile_steps"] == [1, 2]
    assert recorded["rollout"]["group_size"] == 2  # the override, as resolved
    [trace] = (two_steps / "tensorboard" / "plugins" / "profile").glob("*/*.xplane.pb")
    assert trace.stat().st_size > 0


def test_a_resume_compares_against_the_recorded_config_json(two_steps, tmp_path):
    """The workdir's config.json, not only the checkpoint's copy, is what a resume is checked
    against: a record saying group size 4 refuses a rerun with the checkpoint's 2."""
    workdir = _copy(two_steps, tmp_path)
    recorded = json.loads((workdir / "config.json").read_text())
    recorded["rollout"]["group_size"] = 4
    (workdir / "config.json").write_text(json.dumps(recorded))
    changed = subprocess.run(harness.command(workdir, "--config.total_steps=3"),
                             env=harness.env(), capture_output=True, text=True, timeout=900)
    assert changed.returncode == 2, changed.stderr[-3000:]
    assert "rollout.group_size: 4 in the checkpoint, 2 now" in changed.stderr
    assert json.loads((workdir / "config.json").read_text()) == recorded  # a refused run
    # leaves the record as it was


def _copy(workdir, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(workdir, copy)
    return copy


def _steps(workdir) -> list[int]:
    return sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())


def test_a_storage_outage_fails_the_run_then_the_next_start_resumes(two_steps, tmp_path):
    workdir = _copy(two_steps, tmp_path)
    metrics = (workdir / "metrics.jsonl").read_text()
    assert [row["step"] for row in harness.metrics(workdir)] == [1, 2]
    outage = subprocess.run(
        harness.command(workdir, "--config.total_steps=3",
                        script=harness.REPO / "tests/fault/storage_outage_run.py"),
        env=harness.env(OUTAGE_S="60"), capture_output=True, text=True, timeout=900)
    assert outage.returncode == 74, outage.stderr[-3000:]
    assert (f"CheckpointUnavailable: reading checkpoint 2 in {workdir}/checkpoints failed 4 "
            "times without proof of damage") in outage.stderr
    assert "a launcher may restart the run" in outage.stderr
    assert "Traceback" not in outage.stderr
    assert (workdir / "metrics.jsonl").read_text() == metrics
    assert _steps(workdir) == [1, 2] and not (workdir / "checkpoints.unreadable").exists()

    resumed = subprocess.run(harness.command(workdir, "--config.total_steps=2"),
                             env=harness.env(), capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from step 2" in resumed.stdout
    assert (workdir / "metrics.jsonl").read_text() == metrics


def test_a_resume_that_changes_the_group_size_or_mode_exits_2_naming_them(two_steps, tmp_path):
    workdir = _copy(two_steps, tmp_path)
    changed = subprocess.run(
        harness.command(workdir, "--config.total_steps=3", "--config.rollout.group_size=4",
                        "--config.rollout.mode=sequential"),
        env=harness.env(), capture_output=True, text=True, timeout=900)
    assert changed.returncode == 2, changed.stderr[-3000:]
    for line in ("the config differs from the one checkpoint 2 was saved with, in 2 field(s)",
                 "rollout.group_size: 2 in the checkpoint, 4 now; fix: set it back to 2",
                 "rollout.mode: 'pipeline' in the checkpoint, 'sequential' now",
                 "--allow_config_change=rollout.group_size,rollout.mode"):
        assert line in changed.stderr
    assert "Traceback" not in changed.stderr and "KeyError" not in changed.stderr
    assert [row["step"] for row in harness.metrics(workdir)] == [1, 2]
