"""Statistics of avg@k evaluation records (`eval.make_record`), with percentile bootstrap intervals.

Over `[runs, problems]` score matrices, runs and problems are drawn independently (crossed random
factors), paired across models compared on the same problems. Verifier metrics take a wrong solution
as the positive class; an unreadable verdict counts against both true rates.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from mars_jax.types import ROLES
from mars_jax.agents.system import ACCEPTED, FAILED, FALLBACK

Record = dict[str, Any]
RESAMPLES = 2000
LEVEL = 0.95


@dataclasses.dataclass(frozen=True)
class Interval:
    """A point estimate and its percentile bootstrap interval; `undefined` counts the replicates
    left out because the statistic was NaN there (e.g. a resample without one class)."""

    estimate: float
    low: float
    high: float
    undefined: int = 0

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


def _check(array: np.ndarray) -> np.ndarray:
    array = np.asarray(array, dtype=np.float64)
    if array.ndim == 1:
        array = array[None]
    if array.ndim < 2 or array.shape[0] == 0 or array.shape[1] == 0:
        raise ValueError(f"need a non-empty [runs, problems, ...] array, got {array.shape}")
    return array


def bootstrap_statistic(arrays: Sequence[np.ndarray], statistic, *,
                        resamples: int = RESAMPLES, seed: int = 0,
                        level: float = LEVEL) -> Interval:
    """A statistic of several models' per-(run, problem) values `arrays` and its interval;
    replicates where it is NaN are left out (`Interval.undefined`)."""
    arrays = [_check(a) for a in arrays]
    problems = arrays[0].shape[1]
    if any(a.shape[1] != problems for a in arrays):
        raise ValueError(f"paired values need the same problems: {[a.shape[1] for a in arrays]}")
    rng = np.random.default_rng(seed)
    problem_counts = rng.multinomial(problems, np.full(problems, 1 / problems), size=resamples)
    sums = []
    for a in arrays:
        runs = a.shape[0]
        run_counts = rng.multinomial(runs, np.full(runs, 1 / runs), size=resamples)
        sums.append(np.einsum("bs,sp...,bp->b...", run_counts, a, problem_counts))
    estimate = statistic([a.sum(axis=(0, 1)) for a in arrays])
    with np.errstate(invalid="ignore", divide="ignore"):
        replicates = np.asarray(statistic(sums), dtype=np.float64)
    tail = (1 - level) / 2
    defined = replicates[~np.isnan(replicates)]
    low, high = np.quantile(defined, [tail, 1 - tail]) if defined.size else (np.nan, np.nan)
    return Interval(float(estimate), float(low), float(high),
                    int(np.isnan(replicates).sum()))


def bootstrap(scores: np.ndarray, *, resamples: int = RESAMPLES, seed: int = 0,
              level: float = LEVEL) -> Interval:
    """The mean of `scores` (`[runs, problems]` or `[problems]`) and its bootstrap interval."""
    scores = _check(scores)
    return bootstrap_statistic([scores], lambda t: t[0] / scores.size,
                               resamples=resamples, seed=seed, level=level)


def bootstrap_difference(a: np.ndarray, b: np.ndarray, *, resamples: int = RESAMPLES,
                         seed: int = 0, level: float = LEVEL) -> Interval:
    """mean(a) - mean(b) and its interval, problems drawn paired, runs apart."""
    a, b = _check(a), _check(b)
    return bootstrap_statistic([a, b], lambda t: t[0] / a.size - t[1] / b.size,
                               resamples=resamples, seed=seed, level=level)


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
    """The confusion matrix of (solution actually correct, verdict or None) pairs."""
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


CONFUSION_FIELDS = ("tp", "fn", "tn", "fp", "no_verdict_on_correct", "passed")


def confusion_counts(runs: Sequence[Sequence[Record]], problems: Sequence[str], *,
                     first_only: bool) -> np.ndarray:
    """`[runs, problems, 6]` confusion counts of each run's verifications, for
    `bootstrap_statistic`."""
    column = {p: i for i, p in enumerate(problems)}
    counts = np.zeros((len(runs), len(problems), len(CONFUSION_FIELDS)))
    for i, records in enumerate(runs):
        for record in records:
            c = confusion(verification_pairs([record], first_only=first_only))
            counts[i, column[record["problem_id"]]] += [getattr(c, f) for f in CONFUSION_FIELDS]
    return counts


def balanced_accuracy(totals: np.ndarray) -> np.ndarray:
    """Balanced accuracy of confusion totals `[..., 6]`; NaN where a class is absent."""
    tp, fn, tn, fp, none_on_correct = np.moveaxis(np.asarray(totals, np.float64), -1, 0)[:5]
    with np.errstate(invalid="ignore", divide="ignore"):
        return (tp / (tp + fn) + tn / (tn + fp + none_on_correct)) / 2


def verification_pairs(records: Iterable[Record], *,
                       first_only: bool) -> list[tuple[bool, bool | None]]:
    """(candidate correct, verdict) of every verification, or of each run's first."""
    pairs = []
    for record in records:
        for candidate in record["candidates"][:1] if first_only else record["candidates"]:
            verdicts = candidate["verdicts"][:1] if first_only else candidate["verdicts"]
            pairs += [(bool(candidate["correct"]), v) for v in verdicts]
    return pairs


def _wrong_revisions(record: Record) -> tuple[int, int, int]:
    """(wrong candidates revised, revised into a right one, revised keeping their answer)."""
    pairs = [(b, a) for b, a in zip(record["candidates"], record["candidates"][1:])
             if not b["correct"]]
    unchanged = sum(b.get("answer") is not None and a.get("answer") == b.get("answer")
                    for b, a in pairs)
    return len(pairs), sum(bool(a["correct"]) for _, a in pairs), unchanged


def correction_rates(records: Iterable[Record]) -> dict[str, float]:
    """Over every correction: `fixed` (share of wrong candidates revised right), `unchanged`
    (wrong ones keeping their answer) and `broken` (right ones revised wrong)."""
    records = list(records)
    wrong, fixed, unchanged = np.sum([_wrong_revisions(r) for r in records], axis=0,
                                     dtype=np.int64) if records else (0, 0, 0)
    right = [a["correct"] for r in records for b, a in zip(r["candidates"], r["candidates"][1:])
             if b["correct"]]
    wrong, fixed, unchanged = int(wrong), int(fixed), int(unchanged)
    return {"fixed": _ratio(fixed, wrong), "unchanged": _ratio(unchanged, wrong),
            "broken": _ratio(len(right) - sum(right), len(right)),
            "corrections": wrong + len(right)}


CORRECTION_FIELDS = ("wrong_revised", "fixed", "unchanged")


def correction_counts(runs: Sequence[Sequence[Record]], problems: Sequence[str]) -> np.ndarray:
    """`[runs, problems, 3]` counts (`CORRECTION_FIELDS`) of each run's revised wrong candidates,
    those fixed and those keeping their answer, for `bootstrap_statistic`."""
    column = {p: i for i, p in enumerate(problems)}
    counts = np.zeros((len(runs), len(problems), len(CORRECTION_FIELDS)))
    for i, records in enumerate(runs):
        for record in records:
            counts[i, column[record["problem_id"]]] += _wrong_revisions(record)
    return counts


def fix_rate(totals: np.ndarray) -> np.ndarray:
    """Fixed over revised wrong candidates of correction totals `[..., 3]`; NaN without any."""
    totals = np.asarray(totals, np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        return totals[..., 1] / totals[..., 0]


SOLVER_TO_SYSTEM = ("kept", "lost", "fixed", "unfixed")
OUTCOMES = (*SOLVER_TO_SYSTEM, "never_right", "some_right")


def run_outcome(record: Record) -> dict[str, bool]:
    """What the V-C loop did to one run's Solver answer (one of `SOLVER_TO_SYSTEM`), `some_right`
    (some candidate was right) and `never_right` (not fixed, no candidate right)."""
    solver, system = bool(record["solver_correct"]), bool(record["correct"])
    some_right = system or solver or any(c["correct"] for c in record["candidates"])
    return {"kept": solver and system, "lost": solver and not system,
            "fixed": not solver and system, "unfixed": not solver and not system,
            "never_right": not some_right, "some_right": some_right}


def solver_to_system(records: Sequence[Record]) -> dict[str, float]:
    """Share of runs by `run_outcome` (summing to 1; empty: NaN); `some_right` is the ceiling of
    the System's avg@k over this Solver and Corrector."""
    outcomes = [run_outcome(r) for r in records]
    return {name: _ratio(sum(o[name] for o in outcomes), len(records)) for name in OUTCOMES}


def outcome_matrices(runs: Sequence[Sequence[Record]],
                     problems: Sequence[str] | None = None) -> dict[str, np.ndarray]:
    """Per `OUTCOMES` name, the `[runs, problems]` share of each problem's samples with that
    outcome (`score_matrix` of `run_outcome`), for `bootstrap` / `bootstrap_difference`."""
    flagged = [[{**record, **run_outcome(record)} for record in records] for records in runs]
    return {name: score_matrix(flagged, name, problems) for name in OUTCOMES}


def outcome_rates(records: Sequence[Record]) -> dict[str, float]:
    """Share of runs accepted, returned by the fallback rule, and failed."""
    return {f"{status}_rate": _ratio(sum(r["status"] == status for r in records), len(records))
            for status in (ACCEPTED, FALLBACK, FAILED)}


def mean_tokens(records: Sequence[Record]) -> dict[str, float]:
    """Generated tokens per run, by role (retries included)."""
    return {role: _ratio(sum(r["tokens"][role] for r in records), len(records)) for role in ROLES}


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else float("nan")
