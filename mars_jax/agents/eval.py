"""avg@k evaluation of the Solver alone and of the V-C system, from one run.

Each (problem, sample) runs the loop once; the Solver-alone score grades the first Solver output as
it came, the system score the loop's choice. Records are appended as pairs finish (on an object
store, each round); a rerun skips recorded pairs (the loop config is not checked).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from typing import Any, Callable, Sequence

from mars_jax import storage
from mars_jax.agents import prompts, stages
from mars_jax.agents.policy import Policy
from mars_jax.agents.system import ACCEPTED, FAILED, FALLBACK, LoopConfig, RoundInfo, SystemResult, run_system
from mars_jax.types import ROLES

log = logging.getLogger(__name__)

Record = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class EvalProblem:
    """A problem to evaluate: a unique id, the statement and the gold answer."""

    id: str
    problem: str
    answer: str


def evaluate(
    problems: Sequence[EvalProblem],
    policy: Policy,
    *,
    num_samples: int,
    config: LoopConfig | None = None,
    records_path: str | None = None,
    max_in_flight: int | None = None,
    on_round: Callable[[RoundInfo], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> tuple[list[Record], dict[str, Any]]:
    """Runs `num_samples` V-C loops per problem and returns (records in (problem, sample) order,
    summary), resuming from `records_path`; the other arguments go to `run_system`."""
    ids = [p.id for p in problems]
    if len(set(ids)) != len(ids):
        raise ValueError("problem ids must be unique")
    done = _load_records(records_path) if records_path else {}
    wanted = [(p, s) for p in problems for s in range(num_samples)]
    todo = [(p, s) for p, s in wanted if (p.id, s) not in done]
    if len(todo) < len(wanted):
        log.info("resuming: %d of %d pairs already recorded", len(wanted) - len(todo), len(wanted))
    pending: list[str] = []  # recorded lines not yet in records_path
    append_each = records_path is not None and not storage.is_remote(records_path)

    def write_pending() -> None:
        if records_path and pending:
            storage.append_text(records_path, "".join(pending))
            pending.clear()

    def on_result(index: int, result: SystemResult) -> None:
        problem, sample = todo[index]
        record = make_record(problem, sample, result)
        done[(problem.id, sample)] = record
        pending.append(json.dumps(record) + "\n")
        if append_each:
            write_pending()

    def round_done(info: RoundInfo) -> None:
        write_pending()
        if on_round is not None:
            on_round(info)

    try:
        run_system([p.problem for p, _ in todo], policy, config, max_in_flight=max_in_flight,
                   on_round=round_done, on_result=on_result, should_stop=should_stop)
    finally:
        write_pending()
    records = [done[(p.id, s)] for p, s in wanted]
    return records, summarize(records)


def make_record(problem: EvalProblem, sample: int, result: SystemResult) -> Record:
    """The JSON record of one loop run, graded by `stages.correct` (the Solver's first try)."""
    first = stages.parse_solution(result.steps[0].completion)
    outputs = [first, *(c.output for c in result.candidates)]
    solver_correct, *candidates_correct = stages.correct(outputs, [problem.answer] * len(outputs))
    return {
        "problem_id": problem.id,
        "sample": sample,
        "gold": problem.answer,
        "solver_answer": first.answer,
        "solver_correct": solver_correct,
        "status": result.status,
        "failure": result.failure,
        "final_candidate": result.final,
        "answer": result.answer,
        "correct": result.final is not None and candidates_correct[result.final],
        "iterations": result.iterations,
        "verifications": result.verifications,
        "candidates": [
            {"source": c.source, "solution": c.solution, "answer": c.answer,
             "correct": correct, "verdicts": list(c.verdicts), "passes": c.passes}
            for c, correct in zip(result.candidates, candidates_correct)
        ],
        "steps": [
            {"role": s.role, "finish_reason": s.completion.finish_reason, "num_tokens": s.completion.num_tokens,
             **({"verdict": s.verdict, "report": prompts.bug_report(
                 s.completion.text, thinking_open=s.completion.thinking_open)}
                if s.role == "verifier" else {})}
            for s in result.steps
        ],
        "tokens": result.tokens_by_role(),
    }


def summarize(records: Sequence[Record]) -> dict[str, Any]:
    """avg@k of Solver and system, outcome rates, and means per run and per agent."""
    by_problem: dict[str, list[Record]] = {}
    for record in records:
        by_problem.setdefault(record["problem_id"], []).append(record)

    def avg_at_k(key: str) -> float:
        return _mean([_mean([float(r[key]) for r in rs]) for rs in by_problem.values()])

    def rate(status: str) -> float:
        return _mean([float(r["status"] == status) for r in records])

    return {
        "num_problems": len(by_problem),
        "num_records": len(records),
        "solver_avg_at_k": avg_at_k("solver_correct"),
        "system_avg_at_k": avg_at_k("correct"),
        "accepted_rate": rate(ACCEPTED),
        "fallback_rate": rate(FALLBACK),
        "failed_rate": rate(FAILED),
        "mean_iterations": _mean([float(r["iterations"]) for r in records]),
        "mean_verifications": _mean([float(r["verifications"]) for r in records]),
        "mean_tokens": {role: _mean([float(r["tokens"][role]) for r in records]) for role in ROLES},
    }


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _load_records(path: str) -> dict[tuple[str, int], Record]:
    """Records in `path` by (problem id, sample), undecodable lines dropped from the file."""
    if not storage.path(path).exists():
        return {}
    records: dict[tuple[str, int], Record] = {}
    good, bad, rewrite = [], 0, False
    for line in re.findall(r"[^\n]*\n|[^\n]+$", storage.path(path).read_text()):
        try:
            record = json.loads(line)
            key = (record["problem_id"], record["sample"])
        except (ValueError, KeyError, TypeError):
            bad += 1
            continue
        records[key] = record
        if not line.endswith("\n"):
            line, rewrite = line + "\n", True
        good.append(line)
    if bad:
        log.warning("dropping %d unreadable line(s) from %s", bad, path)
    if bad or rewrite:
        storage.write_text(path, "".join(good))
    return records
