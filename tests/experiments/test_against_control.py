"""experiments/against_control.py: per-window run - control differences, hand-computed."""
import json

import pytest

from experiments import against_control


def test_windows_pair_steps_and_give_a_normal_interval():
    run = {1: 0.5, 2: 0.25, 3: 0.75, 4: 1.0, 5: 0.5}
    control = {1: 0.25, 2: 0.25, 3: 0.25, 4: 0.5, 6: 0.0}  # step 5 has no control: left out
    windows = against_control.windowed_difference(run, control, window=2)
    # Differences: step 1 +0.25, 2 0.0, 3 +0.5, 4 +0.5.
    assert [(w["first"], w["last"], w["steps"]) for w in windows] == [(1, 2, 2), (3, 4, 2),
                                                                       (1, 4, 4)]
    assert windows[0]["mean"] == pytest.approx(0.125)
    # sd of (0.25, 0) is 0.1768; 1.96 * 0.1768 / sqrt(2) = 0.245
    assert windows[0]["half_width"] == pytest.approx(0.245, abs=1e-3)
    assert windows[1]["mean"] == pytest.approx(0.5) and windows[1]["half_width"] == 0.0
    # All four: mean 0.3125, sd 0.2394, 1.96 * 0.2394 / 2 = 0.2346
    assert windows[2]["mean"] == pytest.approx(0.3125)
    assert windows[2]["half_width"] == pytest.approx(0.2346, abs=1e-3)


def test_step_rewards_skip_steps_without_the_role(tmp_path):
    lines = [{"step": 0, "probe/solver_accuracy": 0.5}, {"step": 1, "reward/solver": 0.25},
             {"step": 2, "reward/solver": None}, {"step": 3, "reward/solver": 1.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert against_control.step_rewards(tmp_path, "solver") == {1: 0.25, 3: 1.0}
    with pytest.raises(FileNotFoundError, match="no metrics"):
        against_control.step_rewards(tmp_path / "missing", "solver")


def test_a_role_the_run_never_trained_is_reported_not_a_crash(tmp_path):
    for name, verifier in (("run", None), ("control", 0.5)):
        lines = [{"step": 1, "reward/solver": 0.5, "reward/verifier": verifier}]
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    text = against_control.table([str(tmp_path / "run")], str(tmp_path / "control"), "verifier", 2)
    assert "no step where both have a verifier reward" in text
