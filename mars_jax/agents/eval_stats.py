"""Statistics of avg@k evaluation records (`mars_jax.agents.eval.make_record`), with intervals.

avg@k: per problem, the mean over its samples of a 0/1 field (`solver_correct` or `correct`);
a model's avg@k is the mean over problems. Scores of one model are a matrix `[runs, problems]`:
one row per RL seed (one row for a model trained once or not at all), the columns the same
held-out problems in the same order for every run.

Intervals are percentile bootstrap intervals. Each replicate draws the runs with replacement and,
independently, the problems with replacement, and takes the mean of the drawn sub-matrix (the
same drawn problems for every drawn run: seeds and problems are crossed factors, both treated as
random). With one run this is the plain bootstrap over problems. A difference between two models
evaluated on the same problems draws the problems once for both (paired) and each model's runs
independently (its seeds are separate trainings).

Verifier metrics treat an actually wrong solution as the positive class: a verdict "Wrong" on a
wrong solution is a true positive (an error detected). A verification without a readable verdict
(None) is neither a detection nor a pass: it counts against the true-positive rate on wrong
solutions and against the true-negative rate on correct ones, and is not a positive prediction.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from mars_jax.agents.policy import ROLES
from mars_jax.agents.system import ACCEPTED, FAILED, FALLBACK

Record = dict[str, Any]
RESAMPLES = 2000
LEVEL = 0.95


@dataclasses.dataclass(frozen=True)
class Interval:
    """A point estimate and its percentile bootstrap interval."""

    estimate: float
    low: float
    high: float

    @property
    def excludes_zero(self) -> bool:
        return self.low > 0 or self.high < 0

    def to_json(self) -> dict[str, float]:
        return dataclasses.asdict(self)


def problem_ids(records: Iterable[Record]) -> list[str]:
    """The problems of `records`, in order of first appearance."""
    return list(dict.fromkeys(r["problem_id"] for r in records))


def per_problem(records: Sequence[Record], key: str,
                problems: Sequence[str] | None = None) -> np.ndarray:
    """Per problem (in the order of `problems`, default: first appearance), the mean over its
    samples of the 0/1 field `key`; raises ValueError when a listed problem has no record."""
    problems = problem_ids(records) if problems is None else problems
    sums, counts = dict.fromkeys(problems, 0.0), dict.fromkeys(problems, 0)
    for record in records:
        if record["problem_id"] in sums:
            sums[record["problem_id"]] += float(record[key])
            counts[record["problem_id"]] += 1
    missing = [p for p in problems if counts[p] == 0]
    if missing:
        raise ValueError(f"{len(missing)} problem(s) have no record, e.g. {missing[0]!r}")
    return np.array([sums[p] / counts[p] for p in problems])


def score_matrix(runs: Sequence[Sequence[Record]], key: str,
                 problems: Sequence[str] | None = None) -> np.ndarray:
    """`[runs, problems]` avg@k scores of `key`, columns in the order of `problems` (default: the
    first run's); raises ValueError unless every run holds exactly these problems."""
    if not runs:
        raise ValueError("no runs")
    problems = problem_ids(runs[0]) if problems is None else list(problems)
    for i, records in enumerate(runs):
        if set(problem_ids(records)) != set(problems):
            raise ValueError(f"run {i} was evaluated on other problems than the others")
    return np.stack([per_problem(records, key, problems) for records in runs])


def _replicates(scores: np.ndarray, problem_counts: np.ndarray,
                rng: np.random.Generator) -> np.ndarray:
    """Bootstrap replicates of the mean of `scores [S, P]`: seeds drawn here, problems given as
    draw counts `[B, P]`."""
    runs, problems = scores.shape
    seed_counts = rng.multinomial(runs, np.full(runs, 1 / runs), size=len(problem_counts))
    return np.einsum("bs,sp,bp->b", seed_counts, scores, problem_counts) / (runs * problems)


def _check(scores: np.ndarray) -> np.ndarray:
    scores = np.asarray(scores, dtype=np.float64)
    if scores.ndim == 1:
        scores = scores[None]
    if scores.ndim != 2 or scores.size == 0:
        raise ValueError(f"scores must be a non-empty [runs, problems] matrix, got {scores.shape}")
    return scores


def _interval(estimate: float, replicates: np.ndarray, level: float) -> Interval:
    tail = (1 - level) / 2
    low, high = np.quantile(replicates, [tail, 1 - tail])
    return Interval(float(estimate), float(low), float(high))


def bootstrap(scores: np.ndarray, *, resamples: int = RESAMPLES, seed: int = 0,
              level: float = LEVEL) -> Interval:
    """The mean of `scores` (`[runs, problems]`, or `[problems]`) and its percentile bootstrap
    interval (runs and problems resampled, see the module docstring)."""
    scores = _check(scores)
    rng = np.random.default_rng(seed)
    counts = rng.multinomial(scores.shape[1], np.full(scores.shape[1], 1 / scores.shape[1]),
                             size=resamples)
    return _interval(scores.mean(), _replicates(scores, counts, rng), level)


def bootstrap_difference(a: np.ndarray, b: np.ndarray, *, resamples: int = RESAMPLES,
                         seed: int = 0, level: float = LEVEL) -> Interval:
    """mean(a) - mean(b) and its interval: the same problem draws for both (paired; columns are
    the same problems), each model's runs drawn independently."""
    a, b = _check(a), _check(b)
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"paired scores need the same problems: {a.shape[1]} vs {b.shape[1]}")
    rng = np.random.default_rng(seed)
    problems = a.shape[1]
    counts = rng.multinomial(problems, np.full(problems, 1 / problems), size=resamples)
    replicates = _replicates(a, counts, rng) - _replicates(b, counts, rng)
    return _interval(a.mean() - b.mean(), replicates, level)


@dataclasses.dataclass(frozen=True)
class Confusion:
    """Verifier verdicts against real correctness; positive = the solution is actually wrong."""

    tp: int  # wrong solution, verdict Wrong (error detected)
    fn: int  # wrong solution, verdict Correct or none
    tn: int  # correct solution, verdict Correct
    fp: int  # correct solution, verdict Wrong
    no_verdict_on_correct: int  # correct solution, no readable verdict (not a positive)
    passed: int  # verdicts Correct, on any solution

    @property
    def total(self) -> int:
        return self.tp + self.fn + self.tn + self.fp + self.no_verdict_on_correct

    @property
    def accuracy(self) -> float:
        """Verdicts that match the real correctness."""
        return _ratio(self.tp + self.tn, self.total)

    @property
    def recall(self) -> float:
        """True-positive rate: wrong solutions flagged Wrong."""
        return _ratio(self.tp, self.tp + self.fn)

    @property
    def specificity(self) -> float:
        """True-negative rate: correct solutions passed as Correct."""
        return _ratio(self.tn, self.tn + self.fp + self.no_verdict_on_correct)

    @property
    def balanced_accuracy(self) -> float:
        return (self.recall + self.specificity) / 2

    @property
    def precision(self) -> float:
        """Wrong verdicts that are on actually wrong solutions."""
        return _ratio(self.tp, self.tp + self.fp)

    @property
    def pass_rate(self) -> float:
        """Verdicts Correct, over all verifications."""
        return _ratio(self.passed, self.total)

    def to_json(self) -> dict[str, float]:
        return {"accuracy": self.accuracy, "balanced_accuracy": self.balanced_accuracy,
                "recall": self.recall, "specificity": self.specificity,
                "precision": self.precision, "pass_rate": self.pass_rate,
                "verifications": self.total}


def confusion(pairs: Iterable[tuple[bool, bool | None]]) -> Confusion:
    """The confusion matrix of (solution actually correct, verdict) pairs; verdict None: no
    readable verdict."""
    tp = fn = tn = fp = none_on_correct = passed = 0
    for correct, verdict in pairs:
        passed += verdict is True
        if not correct:
            tp += verdict is False
            fn += verdict is not False
        elif verdict is True:
            tn += 1
        elif verdict is False:
            fp += 1
        else:
            none_on_correct += 1
    return Confusion(tp, fn, tn, fp, none_on_correct, passed)


def verification_pairs(records: Iterable[Record], *, first_only: bool) -> list[tuple[bool, bool | None]]:
    """(candidate actually correct, verdict) of every verification in `records`, or with
    `first_only` of each run's first one (the Solver's candidate; runs whose Solver failed have
    none)."""
    pairs = []
    for record in records:
        for candidate in record["candidates"][:1] if first_only else record["candidates"]:
            verdicts = candidate["verdicts"][:1] if first_only else candidate["verdicts"]
            pairs += [(bool(candidate["correct"]), v) for v in verdicts]
    return pairs


def correction_rates(records: Iterable[Record]) -> dict[str, float]:
    """Over every correction (a candidate revised into the next one): `fixed`, the share of
    wrong candidates whose revision is correct, and `broken`, the share of correct ones whose
    revision is wrong."""
    before_after = [(r["candidates"][i - 1]["correct"], r["candidates"][i]["correct"])
                    for r in records for i in range(1, len(r["candidates"]))]
    wrong = [after for before, after in before_after if not before]
    right = [after for before, after in before_after if before]
    return {"fixed": _ratio(sum(wrong), len(wrong)),
            "broken": _ratio(len(right) - sum(right), len(right)),
            "corrections": len(before_after)}


def outcome_rates(records: Sequence[Record]) -> dict[str, float]:
    """Share of runs accepted, returned by the fallback rule, and failed."""
    return {f"{status}_rate": _ratio(sum(r["status"] == status for r in records), len(records))
            for status in (ACCEPTED, FALLBACK, FAILED)}


def mean_tokens(records: Sequence[Record]) -> dict[str, float]:
    """Generated tokens per run, by role (retries included)."""
    return {role: _ratio(sum(r["tokens"][role] for r in records), len(records)) for role in ROLES}


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else float("nan")
