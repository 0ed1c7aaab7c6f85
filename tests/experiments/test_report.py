"""`experiments/report.py` on synthetic records written to disk (no model is evaluated): run
discovery, pooled rows, the target checks and the written tables / summary / plots."""
import json

import pytest

from experiments import export_hf, report

PROBLEMS = 60


def _records(solver_right: int, system_right: int, verifier: str, samples: int = 2) -> list[dict]:
    """Per problem i (both samples alike): the Solver is right iff i < solver_right, the System
    iff i < system_right. Verifier 'always_correct' passes everything and every run is
    accepted; 'oracle' judges the Solver's candidate rightly and a run is accepted iff right."""
    out = []
    for i in range(PROBLEMS):
        solver, system = i < solver_right, i < system_right
        first = True if verifier == "always_correct" else solver
        candidates = [{"correct": solver, "verdicts": [first]}]
        if system != solver:
            candidates.append({"correct": system, "verdicts": [True, True]})
        accepted = verifier == "always_correct" or system
        for sample in range(samples):
            out.append({"problem_id": f"p{i}", "sample": sample, "solver_correct": solver,
                        "correct": system, "status": "accepted" if accepted else "fallback",
                        "iterations": len(candidates), "candidates": candidates,
                        "tokens": {"solver": 10, "verifier": 20 * len(candidates),
                                   "corrector": 5 * (len(candidates) - 1)}})
    return out


RUNS = {  # name: (Solver right, System right, Verifier) on the 60 problems
    "base": (24, 18, "always_correct"),          # Solver 40%, System 30%
    "marsrl_seed0": (30, 42, "oracle"),          # System 70%
    "marsrl_seed1": (30, 36, "oracle"),          # System 60%
    "marsrl_s_seed0": (30, 37, "oracle"),
    "marsrl_s_seed1": (30, 37, "oracle"),        # System 61.7%: MarsRL - MarsRL-S = +3.3
    "marsrl_vc": (24, 30, "oracle"),
    "marsrl_adaptive_seed0": (30, 45, "oracle"),  # System 75%
    "marsrl_random_seed0": (30, 12, "oracle"),    # System 20%
}


def _write(root, name, records, metrics=None):
    path = report.records_path(root, name)
    path.parent.mkdir(parents=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    if name != "base":
        (root / name).mkdir()
        lines = metrics or [{"step": s, "reward/solver": 0.1 * s, "verifier/pass_rate": 0.5,
                             "length/solver": 30 + s, "probe/solver_accuracy": 0.05 * s}
                            for s in range(0, 8)]
        (root / name / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))


@pytest.fixture
def study(tmp_path):
    for name, spec in RUNS.items():
        _write(tmp_path, name, _records(*spec))
    (tmp_path / "notarun").mkdir()
    (tmp_path / "marsrl_s_seed9").mkdir()  # no records: left out with skip_eval
    return tmp_path


def test_discover_runs_parses_the_layout(study):
    runs = {r.name: r for r in report.discover_runs(report.Settings(study), evaluated_only=True)}
    assert set(runs) == set(RUNS)
    assert runs["marsrl_s_seed1"] == report.Run("marsrl_s_seed1", "marsrl_s", "balanced", 1)
    assert runs["marsrl_vc"] == report.Run("marsrl_vc", "marsrl_vc", "balanced", None)
    assert runs["marsrl_random_seed0"] == report.Run("marsrl_random_seed0", "marsrl", "random", 0)
    # To be evaluated, a run needs checkpoints and its `done` file (one still training is left
    # out); one evaluated already needs only its records.
    (study / "marsrl_s_seed9" / "checkpoints").mkdir()
    to_evaluate = report.discover_runs(report.Settings(study), evaluated_only=False)
    assert {r.name for r in to_evaluate} == set(RUNS)
    (study / "marsrl_s_seed9" / "done").write_text("\n")
    to_evaluate = report.discover_runs(report.Settings(study), evaluated_only=False)
    assert {r.name for r in to_evaluate} == set(RUNS) | {"marsrl_s_seed9"}


def test_a_run_whose_records_are_complete_is_not_evaluated_again(study):
    """Complete records (60 problems x 2 samples) need no checkpoint: nothing is evaluated; a
    run asked for more problems than its records hold is exported first, which needs the run's
    checkpoints (absent here)."""
    run = report.Run("marsrl_seed0", "marsrl", "balanced", 0)
    report.evaluate(run, report.Settings(study, num_problems=PROBLEMS, num_samples=2))
    with pytest.raises(export_hf.ExportError, match="marsrl_seed0/checkpoints"):
        report.evaluate(run, report.Settings(study, num_problems=PROBLEMS + 1, num_samples=2))


def test_report_tables_and_targets_from_records(study):
    out = study / "out"
    text = report.build_report(report.Settings(study, resamples=500), out, run_eval=False)
    summary = json.loads((out / "summary.json").read_text())
    rows = summary["rows"]
    assert rows["base"]["system_avg_at_k"]["estimate"] == pytest.approx(0.3)
    assert rows["marsrl"]["runs"] == 2 and rows["marsrl"]["seeds"] == [0, 1]
    assert rows["marsrl"]["system_avg_at_k"]["estimate"] == pytest.approx(0.65)
    assert rows["marsrl"]["system_minus_solver"]["estimate"] == pytest.approx(0.15)
    assert summary["system_vs_base"]["marsrl"]["estimate"] == pytest.approx(0.35)
    # Paired: the Solver gains problems 24-29 (+10 points) in every MarsRL run.
    assert summary["solver_vs_base"]["marsrl"]["estimate"] == pytest.approx(0.1)
    assert "| +10.0 [" in text
    # MarsRL minus each ablation, paired: MarsRL-S 50% / 61.7%, MarsRL-VC 40% / 50%.
    minus = summary["marsrl_minus"]
    assert minus["marsrl_s"]["system"]["estimate"] == pytest.approx(0.65 - 37 / 60)
    assert minus["marsrl_vc"]["solver"]["estimate"] == pytest.approx(0.1)
    assert minus["marsrl_vc"]["system"]["estimate"] == pytest.approx(0.15)
    assert "| MarsRL-VC | +10.0 [" in text and "| +15.0 [" in text
    assert rows["marsrl_random"]["system_avg_at_k"]["estimate"] == pytest.approx(0.2)
    # The seed-0 / seed-1 spread (70% vs 60%) is inside MarsRL's interval.
    interval = rows["marsrl"]["system_avg_at_k"]
    assert interval["low"] < 0.6 and interval["high"] > 0.7
    # Verifier: base passes everything (balanced accuracy 0.5, precision undefined), MarsRL is
    # an oracle on the first verification.
    assert rows["base"]["verifier_first"]["balanced_accuracy"] == 0.5
    assert rows["base"]["accepted_rate"] == 1.0
    assert rows["marsrl"]["verifier_first"]["balanced_accuracy"] == 1.0
    assert rows["marsrl"]["accepted_rate"] == pytest.approx(0.65)
    # Base: the Corrector broke the 6 right Solver answers of problems 18-23 (x 2 samples).
    corrector = rows["base"]["corrector"]
    assert (corrector["broken"], corrector["corrections"]) == (1.0, 12)
    assert rows["marsrl"]["corrector"]["fixed"] == 1.0
    # Base: Solver right on 0-23, System on 0-17 -> 30% kept, 10% lost, 0 fixed, 60% unfixed,
    # none of which ever had a right candidate.
    assert rows["base"]["solver_to_system"] == pytest.approx(
        {"kept": 0.3, "lost": 0.1, "fixed": 0.0, "unfixed": 0.6, "never_right": 0.6,
         "some_right": 0.4})
    assert "| 30.0 / 10.0 / 0.0 / 60.0 (60.0) |" in text
    targets = {t["target"].split(",")[0]: t for t in summary["targets"]}
    assert [t["met"] for t in summary["targets"]] == [True, False, True, True, False]
    # The base revised no wrong candidate: its fix rate, and the gain over it, are undefined.
    assert summary["targets"][4]["detail"].startswith("in-loop fix rate nan -> 100.0%")
    assert "+35.0" in targets["MarsRL System >= base System + 10 points"]["detail"]
    assert "+3.3" in targets["MarsRL System - MarsRL-S System >= +5 points"]["detail"]
    assert "(+50.0 [+50.0, +50.0]); acceptance 65.0%" in summary["targets"][3]["detail"]
    assert rows["marsrl"]["verifier_first_balanced_accuracy"]["estimate"] == 1.0
    assert "| MarsRL System >= base System + 10 points, interval excluding 0 | met |" in text
    assert ("| MarsRL System - MarsRL-S System >= +5 points, interval excluding 0 | not met |"
            in text)
    assert "| MarsRL (balanced) | 2 | 65.0 [" in text
    assert "| MarsRL (adaptive) | 1 | 75.0 [" in text and "| MarsRL (random) | 1 | 20.0 [" in text
    # Each selection's System minus balanced (65%), paired over problems: +10 and -45 points.
    selection_minus = summary["selection_system_minus_default"]
    assert selection_minus["marsrl_adaptive"]["estimate"] == pytest.approx(0.10)
    assert selection_minus["marsrl_random"]["estimate"] == pytest.approx(-0.45)
    assert "System minus MarsRL (balanced) |" in text and "| -45.0 [" in text
    assert "| SFT warm start | 1 | 0 | 40.0 [" in text and "60 problems, avg@2" in text
    for name in ("tables.md", "rewards.png", "verifier.png", "training_lengths.png",
                 "held_out_probe.png",
                 "system_vs_solver.png", "selection.png", "lengths.png", "sft_loss.png"):
        assert (out / name).stat().st_size > 0, name


def test_missing_rows_are_not_evaluated(tmp_path):
    _write(tmp_path, "base", _records(*RUNS["base"]))
    _write(tmp_path, "marsrl", _records(*RUNS["marsrl_seed0"]))
    report.build_report(report.Settings(tmp_path, resamples=200), tmp_path / "out", run_eval=False)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert [t["met"] for t in summary["targets"]] == [True, None, True, True, False]
    assert summary["targets"][1]["detail"] == "no runs of marsrl_s"
    assert not (tmp_path / "out" / "selection.png").exists()


def test_runs_on_other_problems_are_refused(tmp_path):
    _write(tmp_path, "base", _records(*RUNS["base"]))
    _write(tmp_path, "marsrl", _records(*RUNS["marsrl_seed0"])[:-4])  # two problems fewer
    with pytest.raises(ValueError, match="other problems"):
        report.build_report(report.Settings(tmp_path, resamples=50), tmp_path / "out",
                            run_eval=False)


def test_report_interval_is_the_exact_bootstrap_of_a_proportion(tmp_path):
    """The base System is right on 18 of 60 problems (both samples alike), so a bootstrap mean
    is Binomial(60, 0.3) / 60: its 2.5% / 97.5% quantiles are 11/60 and 25/60 (the CDF there is
    0.0295 and 0.9804, > 6 Monte Carlo sd of 50,000 draws from the tails)."""
    scipy_stats = pytest.importorskip("scipy.stats")
    _write(tmp_path, "base", _records(*RUNS["base"]))
    _write(tmp_path, "marsrl", _records(*RUNS["marsrl_seed0"]))
    report.build_report(report.Settings(tmp_path, resamples=50_000), tmp_path / "out",
                        run_eval=False)
    system = json.loads((tmp_path / "out" / "summary.json").read_text())["rows"]["base"][
        "system_avg_at_k"]
    low, high = scipy_stats.binom.ppf([0.025, 0.975], PROBLEMS, 0.3) / PROBLEMS
    assert (low, high) == pytest.approx((11 / 60, 25 / 60))
    assert (system["low"], system["high"]) == pytest.approx((low, high))


def test_records_must_hold_each_problem_k_times_once_each():
    complete = _records(30, 40, "oracle")
    report.check_complete("run", complete, 2)
    with pytest.raises(ValueError, match=r"doubled \(problem, sample\) \[\('p0', 0\)\]"):
        report.check_complete("run", complete + complete[:1], 2)
    with pytest.raises(ValueError, match=r"without 2 samples: \['p59'\]"):
        report.check_complete("run", complete[:-1], 2)


def _run(problem: str, sample: int, chain: list[tuple[bool, str]], returned: int | None) -> dict:
    """One evaluated run: its candidates as (correct, answer), each verified once (passed iff
    right), the System returning candidate `returned` (None: the Solver failed, no candidate)."""
    candidates = [{"correct": ok, "answer": answer, "verdicts": [ok]} for ok, answer in chain]
    correct = returned is not None and chain[returned][0]
    return {"problem_id": problem, "sample": sample, "solver_correct": bool(chain) and chain[0][0],
            "correct": correct, "status": "accepted" if correct else "fallback",
            "iterations": max(1, len(chain)), "candidates": candidates,
            "tokens": {"solver": 1, "verifier": len(chain), "corrector": len(chain) - 1}}


R, W = True, False
DECOMPOSITION = {
    "base": [_run("p0", 0, [(R, "5")], 0),                       # kept
             _run("p0", 1, [(R, "5"), (W, "6")], 1),             # lost (a right one broken)
             _run("p1", 0, [(W, "3"), (W, "3")], 1),             # unfixed, revision unchanged
             _run("p1", 1, [(W, "3"), (R, "4")], 1),             # fixed
             _run("p2", 0, [(W, "7"), (R, "8"), (W, "9")], 2),   # unfixed, a right one dropped
             _run("p2", 1, [], None)],                           # unfixed, the Solver failed
    "marsrl": [_run("p0", 0, [(R, "5")], 0), _run("p0", 1, [(R, "5")], 0),   # kept, kept
               _run("p1", 0, [(W, "3"), (R, "4")], 1),                       # fixed
               _run("p1", 1, [(W, "2"), (R, "4")], 1),                       # fixed
               _run("p2", 0, [(W, "7"), (R, "8")], 1),                       # fixed
               _run("p2", 1, [(W, "7"), (W, "6")], 1)],                      # unfixed, changed
}


def test_decomposition_by_hand(tmp_path):
    """Kept / lost / fixed / unfixed, the ceiling, the in-loop fix and unchanged rates and their
    paired differences, against counts made by hand on 3 problems x 2 samples."""
    for name, records in DECOMPOSITION.items():
        _write(tmp_path, name, records)
    text = report.build_report(report.Settings(tmp_path, resamples=300), tmp_path / "out",
                               run_eval=False)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    base, marsrl = summary["rows"]["base"], summary["rows"]["marsrl"]
    # Base: 1 kept, 1 lost, 1 fixed, 3 unfixed of 6 runs; a right candidate in p0 (both), p1
    # sample 1 and p2 sample 0 (4 of 6). MarsRL: 2 kept, 3 fixed, 1 unfixed; some right 5 of 6.
    expected = {"base": dict(kept=1, lost=1, fixed=1, unfixed=3, never_right=2, some_right=4),
                "marsrl": dict(kept=2, lost=0, fixed=3, unfixed=1, never_right=1, some_right=5)}
    for row, counts in expected.items():
        got = summary["rows"][row]
        assert got["solver_to_system"] == pytest.approx({k: v / 6 for k, v in counts.items()})
        for name, count in counts.items():
            assert got["outcomes"][name]["estimate"] == pytest.approx(count / 6), (row, name)
    # Revisions of wrong candidates. Base: 3 -> 3 (unchanged), 3 -> 4 and 7 -> 8 (fixed): 2 of 3
    # fixed, 1 of 3 unchanged; the right ones revised (5 -> 6, 8 -> 9) both broken. MarsRL:
    # 3 -> 4, 2 -> 4, 7 -> 8 fixed, 7 -> 6 neither: 3 of 4.
    assert (base["corrector"]["fixed"], base["corrector"]["unchanged"],
            base["corrector"]["broken"]) == pytest.approx((2 / 3, 1 / 3, 1.0))
    assert (marsrl["corrector"]["fixed"], marsrl["corrector"]["unchanged"]) == (0.75, 0.0)
    assert base["corrector_fix_rate"]["estimate"] == pytest.approx(2 / 3)
    # Paired over problems (per-problem shares p0, p1, p2): kept base (.5, 0, 0), MarsRL
    # (1, 0, 0): +1/6; fixed (0, .5, 0) -> (0, 1, .5): +1/3; unfixed (0, .5, 1) -> (0, 0, .5):
    # -1/3; lost -1/6; some right (1, .5, .5) -> (1, 1, .5): +1/6; fix rate 3/4 - 2/3.
    vs_base = {k: v["estimate"] for k, v in
               json.loads((tmp_path / "out" / "summary.json").read_text())["decomposition_vs_base"]
               ["marsrl"].items()}
    assert vs_base == pytest.approx({
        "outcome/kept": 1 / 6, "outcome/lost": -1 / 6, "outcome/fixed": 1 / 3,
        "outcome/unfixed": -1 / 3, "outcome/never_right": -1 / 6, "outcome/some_right": 1 / 6,
        "corrector_fix_rate": 3 / 4 - 2 / 3,
        # The oracle verdicts make both first verifications perfect.
        "verifier_balanced_accuracy": 0.0})
    # The table: base kept 16.7%; MarsRL fixed 50.0% (+33.3 paired).
    assert "| SFT warm start | 16.7 [" in text and "| 50.0 [" in text and "(+33.3 [" in text
    target = {t["target"]: t for t in summary["targets"]}[
        "In-loop Corrector fix rate up over the warm start, interval excluding 0"]
    assert target["detail"].startswith("in-loop fix rate 66.7 -> 75.0% (+8.3 [")
    assert "wrong candidates left unchanged 33.3 -> 0.0%" in target["detail"]
