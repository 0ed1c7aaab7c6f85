"""`eval_stats`: bootstrap intervals against exactly enumerated bootstrap distributions and an
explicit resampling loop; Verifier confusion metrics against hand-counted matrices; real records
from `evaluate`."""
import itertools
import math

import numpy as np
import pytest

from mars_jax.agents import eval_stats
from mars_jax.agents.eval import evaluate
from tests.agents.test_agent_eval import CONFIG, PROBLEMS, OraclePolicy

RESAMPLES = 20_000  # Monte Carlo sd of a 2.5% tail's probability: 0.0011


def exact_interval(statistics: np.ndarray, level: float = 0.95,
                   margin: float = 0.01) -> tuple[float, float]:
    """The percentile interval of an enumerated (equally likely) bootstrap distribution, NaNs
    left out: the inverse CDF at the two tails, checked to be >= `margin` away from every jump of
    the CDF so that a sampled bootstrap with RESAMPLES draws lands on the same atoms."""
    statistics = np.asarray(statistics)
    values, counts = np.unique(np.round(statistics[~np.isnan(statistics)], 12),
                               return_counts=True)
    cdf = np.cumsum(counts) / counts.sum()
    tails = ((1 - level) / 2, (1 + level) / 2)
    for q in tails:
        assert np.min(np.abs(cdf - q)) > margin, "test data: a tail lies on a CDF jump"
    return tuple(float(values[np.searchsorted(cdf, q)]) for q in tails)


def enumerate_crossed(scores: np.ndarray) -> np.ndarray:
    """Every (seed draw, problem draw) of the crossed scheme: mean of scores[seeds][:, problems]."""
    runs, problems = scores.shape
    return np.array([scores[np.ix_(s, p)].mean()
                     for s in itertools.product(range(runs), repeat=runs)
                     for p in itertools.product(range(problems), repeat=problems)])


def test_bootstrap_over_problems_matches_the_enumerated_distribution():
    scores = np.array([0.0, 0.0, 0.5, 1.0, 1.0, 0.5])  # avg@2 of six problems
    means = np.array([scores[list(i)].mean() for i in itertools.product(range(6), repeat=6)])
    low, high = exact_interval(means)
    interval = eval_stats.bootstrap(scores, resamples=RESAMPLES, seed=3)
    assert interval.estimate == pytest.approx(0.5)
    assert (interval.low, interval.high) == pytest.approx((low, high))
    assert low < 0.5 < high


def test_paired_difference_matches_the_enumerated_distribution():
    a = np.array([1.0, 0.0, 1.0, 0.0, 1.0])  # e.g. System per problem
    b = np.array([0.5, 0.0, 0.5, 0.0, 0.5])  # e.g. Solver on the same problems
    diffs = a - b
    means = np.array([diffs[list(i)].mean() for i in itertools.product(range(5), repeat=5)])
    low, high = exact_interval(means)
    interval = eval_stats.bootstrap_difference(a, b, resamples=RESAMPLES, seed=1)
    assert interval.estimate == pytest.approx(0.3)
    assert (interval.low, interval.high) == pytest.approx((low, high)) == (0.1, 0.5)
    assert interval.excludes_zero
    # Unpaired (each model's problems drawn on their own) the same data gives a wider interval
    # that includes 0: pairing matters here.
    rng = np.random.default_rng(0)
    draws = lambda x: x[rng.integers(0, 5, (RESAMPLES, 5))].mean(axis=1)
    unpaired = np.quantile(draws(a) - draws(b), [0.025, 0.975])
    assert unpaired[0] < 0 < interval.low


def test_seed_and_problem_bootstrap_matches_the_enumerated_crossed_scheme():
    scores = np.array([[1.0, 0.0, 0.5, 0.5],
                       [1.0, 0.5, 0.5, 0.5]])  # 2 RL seeds x 4 problems
    crossed = exact_interval(enumerate_crossed(scores))
    interval = eval_stats.bootstrap(scores, resamples=RESAMPLES, seed=5)
    assert interval.estimate == pytest.approx(4.5 / 8)
    assert (interval.low, interval.high) == pytest.approx(crossed) == (0.25, 0.875)
    # Nested resampling (fresh problem draws per drawn seed) would give another interval for
    # this data, so the test pins the crossed scheme.
    draws = np.array(list(itertools.product(range(4), repeat=4)))
    per_seed = scores[:, draws].mean(axis=-1)  # [seed, problem draw]
    nested = np.concatenate([(per_seed[s1][:, None] + per_seed[s2][None, :]).ravel() / 2
                             for s1, s2 in itertools.product(range(2), repeat=2)])
    assert np.quantile(nested, [0.025, 0.975]) != pytest.approx(crossed, abs=0.02)


def test_seed_difference_against_an_explicit_resampling_loop():
    rng = np.random.default_rng(0)
    marsrl = rng.uniform(0.3, 0.9, (3, 40))  # 3 seeds x 40 problems
    base = np.clip(marsrl[0] - rng.uniform(0.0, 0.3, 40), 0, 1)[None]
    replicates = []
    for _ in range(RESAMPLES):
        seeds = rng.integers(0, 3, 3)
        problems = rng.integers(0, 40, 40)
        replicates.append(marsrl[np.ix_(seeds, problems)].mean() - base[0, problems].mean())
    low, high = np.quantile(replicates, [0.025, 0.975])
    interval = eval_stats.bootstrap_difference(marsrl, base, resamples=RESAMPLES, seed=7)
    assert interval.estimate == pytest.approx(marsrl.mean() - base.mean())
    assert (interval.low, interval.high) == pytest.approx((low, high), abs=0.006)
    assert high - low > 0.02  # not degenerate


def test_bootstrap_is_seeded_and_checks_shapes():
    scores = np.array([[1.0, 0.0, 0.5], [0.0, 0.0, 1.0]])
    assert eval_stats.bootstrap(scores, seed=2) == eval_stats.bootstrap(scores, seed=2)
    with pytest.raises(ValueError, match="same problems"):
        eval_stats.bootstrap_difference(scores, scores[:, :2])
    with pytest.raises(ValueError, match="non-empty"):
        eval_stats.bootstrap(np.zeros((0, 3)))


def test_confusion_against_a_hand_counted_matrix():
    # (solution actually correct, verdict): positive = actually wrong.
    pairs = ([(False, False)] * 6      # TP: error detected
             + [(False, True)] * 2     # FN: passed a wrong solution
             + [(False, None)] * 1     # FN: no verdict on a wrong solution
             + [(True, True)] * 3      # TN
             + [(True, False)] * 2     # FP: flagged a correct solution
             + [(True, None)] * 1)     # no verdict on a correct solution: not a positive
    c = eval_stats.confusion(pairs)
    assert (c.tp, c.fn, c.tn, c.fp, c.no_verdict_on_correct, c.passed) == (6, 3, 3, 2, 1, 5)
    assert c.accuracy == pytest.approx(9 / 15)
    assert c.recall == pytest.approx(6 / 9)
    assert c.specificity == pytest.approx(3 / 6)
    assert c.balanced_accuracy == pytest.approx((6 / 9 + 3 / 6) / 2)
    assert c.precision == pytest.approx(6 / 8)
    assert c.pass_rate == pytest.approx(5 / 15)
    # "Always Wrong" on a 90%-wrong set: accuracy 0.9, balanced accuracy 0.5.
    always_wrong = eval_stats.confusion([(False, False)] * 9 + [(True, False)])
    assert (always_wrong.accuracy, always_wrong.balanced_accuracy) == (0.9, 0.5)
    assert math.isnan(eval_stats.confusion([(True, True)]).recall)


def _verified(pairs_by_problem):
    """One record per (solution correct, first verdict) pair, problems p0, p1, ..."""
    return [{"problem_id": f"p{i}", "sample": j, "candidates": [{"correct": c, "verdicts": [v]}]}
            for i, pairs in enumerate(pairs_by_problem) for j, (c, v) in enumerate(pairs)]


def _enumerated_balanced_accuracy(*models):
    """Balanced accuracy (difference, for two models) over every problem resample, from the
    drawn problems' pairs."""
    problems = len(models[0])
    values = []
    for draw in itertools.product(range(problems), repeat=problems):
        scores = [eval_stats.confusion(p for i in draw for p in m[i]).balanced_accuracy
                  for m in models]
        values.append(scores[0] - scores[1] if len(models) == 2 else scores[0])
    return np.array(values)


BALANCED_RESAMPLES = 50_000  # these tails lie >= 0.0089 from a CDF jump: 12 Monte Carlo sd


def test_balanced_accuracy_interval_matches_the_enumerated_distribution():
    w, r = False, True  # a wrong / right solution
    verifier = [[(w, None), (r, w)], [(w, w), (w, r)], [(w, w), (r, w)], [(w, r), (r, w)],
                [(w, w), (r, w)]]
    problems = [f"p{i}" for i in range(5)]
    counts = eval_stats.confusion_counts([_verified(verifier)], problems, first_only=True)
    assert counts.shape == (1, 5, 6)
    np.testing.assert_array_equal(counts[0, 1], [1, 1, 0, 0, 0, 1])  # tp fn tn fp none passed
    exact = exact_interval(_enumerated_balanced_accuracy(verifier), margin=0.0089)
    interval = eval_stats.bootstrap_statistic(
        [counts], lambda t: eval_stats.balanced_accuracy(t[0]), resamples=BALANCED_RESAMPLES)
    whole = eval_stats.confusion(p for pairs in verifier for p in pairs)
    assert interval.estimate == pytest.approx(whole.balanced_accuracy) == 0.25  # 3/6 and 0/4
    assert (interval.low, interval.high) == pytest.approx(exact)
    undefined_share = np.isnan(_enumerated_balanced_accuracy(verifier)).mean()
    assert undefined_share > 0  # some resamples hold no correct solution
    sd = np.sqrt(undefined_share * (1 - undefined_share) / BALANCED_RESAMPLES)
    assert abs(interval.undefined / BALANCED_RESAMPLES - undefined_share) < 5 * sd


def test_balanced_accuracy_difference_matches_the_enumerated_distribution():
    w, r = False, True
    a = [[(w, r), (r, r)], [(w, w), (w, None)], [(w, r), (r, r)], [(w, r), (w, r)],
         [(w, None), (r, w)]]
    b = [[(w, w), (r, r)], [(w, r), (w, r)], [(w, w), (r, r)], [(r, r), (r, None)],
         [(w, r), (r, None)]]
    problems = [f"p{i}" for i in range(5)]
    counts = [eval_stats.confusion_counts([_verified(m)], problems, first_only=True)
              for m in (a, b)]
    exact = exact_interval(_enumerated_balanced_accuracy(a, b), margin=0.0089)
    interval = eval_stats.bootstrap_statistic(
        counts, lambda t: eval_stats.balanced_accuracy(t[0]) - eval_stats.balanced_accuracy(t[1]),
        resamples=BALANCED_RESAMPLES, seed=4)
    assert (interval.low, interval.high) == pytest.approx(exact)
    assert interval.low < interval.estimate < interval.high


def _record(problem, sample, solver_correct, correct, status, candidates, tokens=(1, 2, 3)):
    return {"problem_id": problem, "sample": sample, "solver_correct": solver_correct,
            "correct": correct, "status": status,
            "candidates": [{"correct": ok, "verdicts": list(v)} for ok, v in candidates],
            "tokens": dict(zip(("solver", "verifier", "corrector"), tokens))}


def test_record_statistics_by_hand():
    records = [
        _record("p", 0, False, True, "accepted", [(False, [False]), (True, [True, True])]),
        _record("p", 1, True, True, "fallback", [(True, [False, None])], tokens=(3, 4, 5)),
        _record("q", 0, False, False, "failed", []),  # the Solver's output was unusable
        _record("q", 1, False, False, "fallback", [(False, [True, False])]),
    ]
    assert eval_stats.problem_ids(records) == ["p", "q"]
    np.testing.assert_array_equal(eval_stats.per_problem(records, "correct"), [1.0, 0.0])
    np.testing.assert_array_equal(eval_stats.per_problem(records, "solver_correct"), [0.5, 0.0])
    first = eval_stats.verification_pairs(records, first_only=True)
    assert first == [(False, False), (True, False), (False, True)]
    every = eval_stats.verification_pairs(records, first_only=False)
    assert every == [(False, False), (True, True), (True, True), (True, False), (True, None),
                     (False, True), (False, False)]
    assert eval_stats.outcome_rates(records) == {
        "accepted_rate": 0.25, "fallback_rate": 0.5, "failed_rate": 0.25}
    assert eval_stats.mean_tokens(records) == {"solver": 1.5, "verifier": 2.5, "corrector": 3.5}
    # (Solver, System): p0 wrong -> right, p1 right -> right, q0 and q1 wrong -> wrong, and
    # neither q run has a right candidate.
    assert eval_stats.solver_to_system(records) == {
        "kept": 0.25, "lost": 0.0, "fixed": 0.25, "unfixed": 0.5, "never_right": 0.5,
        "some_right": 0.5}
    dropped = _record("r", 0, False, False, "fallback", [(False, [False]), (True, [False])])
    assert eval_stats.solver_to_system([dropped])["never_right"] == 0.0  # a right one, dropped
    matrix = eval_stats.score_matrix([records, records[::-1]], "correct")
    np.testing.assert_array_equal(matrix, [[1.0, 0.0], [1.0, 0.0]])  # aligned by problem id
    with pytest.raises(ValueError, match="other problems"):
        eval_stats.score_matrix([records, records[:2]], "correct")


def test_correction_rates_by_hand():
    # Each run's candidates as (correct, answer); the gold answer is 5.
    chains = [[(False, "4"), (True, "5")], [(False, "3"), (False, "3"), (True, "5")],
              [(True, "5"), (False, "6")], [(True, "5")], [(False, "2"), (False, None)]]
    records = [_record("p", i, c[0][0], c[-1][0], "fallback", [(ok, [None]) for ok, _ in c])
               for i, c in enumerate(chains)]
    for record, chain in zip(records, chains):
        for candidate, (_, answer) in zip(record["candidates"], chain):
            candidate["answer"] = answer
    # Revisions of wrong candidates: 4 -> 5 and 3 -> 5 fixed, 3 -> 3 unchanged, 2 -> no answer
    # neither (2 of 4 fixed, 1 of 4 unchanged); of right ones: 5 -> 6 broken.
    assert eval_stats.correction_rates(records) == {"fixed": 0.5, "unchanged": 0.25,
                                                    "broken": 1.0, "corrections": 5}
    assert math.isnan(eval_stats.correction_rates(records[3:4])["fixed"])
    counts = eval_stats.correction_counts([records, records[3:]], ["p"])
    np.testing.assert_array_equal(counts, [[[4, 2, 1]], [[1, 0, 0]]])
    np.testing.assert_array_equal(eval_stats.fix_rate(counts.sum(axis=1)), [0.5, 0.0])


def test_outcome_matrices_by_hand():
    """Per problem, the share of its runs with each outcome; some_right = 1 - never_right."""
    runs = [[_record("p", 0, True, True, "accepted", [(True, [True])]),
             _record("p", 1, True, False, "fallback", [(True, [False]), (False, [False])]),
             _record("q", 0, False, True, "accepted", [(False, [False]), (True, [True])]),
             _record("q", 1, False, False, "fallback", [(False, [False]), (True, [False]),
                                                         (False, [False])])],
            [_record("q", 0, False, False, "failed", []),
             _record("q", 1, False, False, "fallback", [(False, [True])]),
             _record("p", 0, True, True, "accepted", [(True, [True])]),
             _record("p", 1, True, True, "accepted", [(True, [True])])]]
    m = eval_stats.outcome_matrices(runs, ["p", "q"])
    expected = {"kept": [[0.5, 0.0], [1.0, 0.0]], "lost": [[0.5, 0.0], [0.0, 0.0]],
                "fixed": [[0.0, 0.5], [0.0, 0.0]], "unfixed": [[0.0, 0.5], [0.0, 1.0]],
                "never_right": [[0.0, 0.0], [0.0, 1.0]], "some_right": [[1.0, 1.0], [1.0, 0.0]]}
    assert set(m) == set(expected)
    for name, values in expected.items():
        np.testing.assert_array_equal(m[name], values, err_msg=name)


def test_statistics_of_real_evaluation_records():
    records, summary = evaluate(PROBLEMS, OraclePolicy(), num_samples=2, config=CONFIG)
    # A: the Solver is right, 4 passing verdicts. B: the Solver is wrong, flagged Wrong, the
    # Corrector is right, 4 passing verdicts. The oracle Verifier is never wrong.
    first = eval_stats.confusion(eval_stats.verification_pairs(records, first_only=True))
    assert (first.tp, first.fn, first.tn, first.fp) == (2, 0, 2, 0)
    assert (first.balanced_accuracy, first.pass_rate) == (1.0, 0.5)
    every = eval_stats.confusion(eval_stats.verification_pairs(records, first_only=False))
    assert (every.tp, every.fn, every.tn, every.fp) == (2, 0, 16, 0)
    system = eval_stats.score_matrix([records], "correct")
    solver = eval_stats.score_matrix([records], "solver_correct")
    assert system.mean() == summary["system_avg_at_k"]
    assert solver.mean() == summary["solver_avg_at_k"]
    assert eval_stats.outcome_rates(records)["accepted_rate"] == summary["accepted_rate"]
    assert eval_stats.solver_to_system(records) == {  # A's runs kept, B's fixed
        "kept": 0.5, "lost": 0.0, "fixed": 0.5, "unfixed": 0.0, "never_right": 0.0,
        "some_right": 1.0}
    assert eval_stats.mean_tokens(records) == summary["mean_tokens"]
    corrections = eval_stats.correction_rates(records)  # B's two runs: 2 -> 7, both fixed
    assert (corrections["fixed"], corrections["corrections"]) == (1.0, 2)
    assert math.isnan(corrections["broken"])
