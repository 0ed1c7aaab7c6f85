"""avg@k evaluation: records, summary and resuming from records.jsonl."""

import json
import re

import pytest

from mars_jax import storage
from mars_jax.agents.eval import EvalProblem, evaluate
from mars_jax.agents.policy import Completion
from mars_jax.agents.system import LoopConfig
from tests import fake_gcs

GOLD = {"Problem-A": "2", "Problem-B": "7"}
CONFIG = LoopConfig(max_new_tokens={"solver": 64, "verifier": 32, "corrector": 64})


class OraclePolicy:
    """The Solver answers 2, the Verifier knows the gold answers, the Corrector answers 7."""

    def __init__(self):
        self.calls = []

    def complete(self, requests):
        self.calls.append([r.role for r in requests])
        return [self._one(r) for r in requests]

    def _one(self, request):
        if request.role == "solver":
            return Completion("<think>guess</think>The answer is \\boxed{2}.", "stop", 10)
        if request.role == "corrector":
            return Completion("Fixed: the answer is \\boxed{7}.", "stop", 7)
        text = request.messages[1]["content"]
        problem = re.search(r"Problem-\w", text).group()
        right = f"\\boxed{{{GOLD[problem]}}}" in text.split("## Solution")[1]
        return Completion(f"**Final Verdict:** {'fine' if right else 'wrong answer'}.\n\n"
                          f"**List of Findings:** {'None' if right else 'Critical Error in the answer'}\n\n"
                          f"**Correctness:** {'Correct' if right else 'Wrong'}", "stop", 3)


PROBLEMS = [EvalProblem("a", "Problem-A: compute.", "2"), EvalProblem("b", "Problem-B: compute.", "7")]


def test_evaluate_scores_solver_and_system(tmp_path):
    path = tmp_path / "records.jsonl"
    policy = OraclePolicy()
    records, summary = evaluate(PROBLEMS, policy, num_samples=2, config=CONFIG, records_path=str(path))
    assert [(r["problem_id"], r["sample"]) for r in records] == [("a", 0), ("a", 1), ("b", 0), ("b", 1)]
    assert len(policy.calls) == 7  # A: S V V V V; B: S V C V V V V, all four pairs together
    a, b = records[0], records[2]
    assert (a["solver_correct"], a["correct"], a["status"], a["verifications"], a["iterations"]) == (
        True, True, "accepted", 4, 3)
    assert (b["solver_answer"], b["solver_correct"], b["answer"], b["correct"]) == ("2", False, "7", True)
    assert [(c["source"], c["answer"], c["correct"], c["verdicts"]) for c in b["candidates"]] == [
        ("solver", "2", False, [False]), ("corrector", "7", True, [True] * 4)]
    assert b["tokens"] == {"solver": 10, "verifier": 15, "corrector": 7}
    assert b["steps"][1]["verdict"] is False and "Correctness" not in b["steps"][1]["report"]
    assert summary == {
        "num_problems": 2, "num_records": 4, "solver_avg_at_k": 0.5, "system_avg_at_k": 1.0,
        "accepted_rate": 1.0, "fallback_rate": 0.0, "failed_rate": 0.0, "mean_iterations": 3.5,
        "mean_verifications": 4.5,
        "mean_tokens": {"solver": 10.0, "verifier": 13.5, "corrector": 3.5}}
    assert [json.loads(line) for line in path.read_text().splitlines()] == records  # JSON round trip


def test_resume_skips_recorded_pairs_and_drops_a_torn_line(tmp_path):
    path = tmp_path / "records.jsonl"
    first, _ = evaluate(PROBLEMS, OraclePolicy(), num_samples=2, config=CONFIG, records_path=str(path))
    with open(path, "a") as f:
        f.write('{"problem_id": "a", "sam')  # a write cut short by a crash
    policy = OraclePolicy()
    records, summary = evaluate(PROBLEMS, policy, num_samples=3, config=CONFIG, records_path=str(path))
    assert policy.calls[0] == ["solver", "solver"]  # only sample 2 of each problem
    assert records[:2] == first[:2] and records[3:5] == first[2:]
    assert [(r["problem_id"], r["sample"]) for r in map(json.loads, path.read_text().splitlines())] == [
        ("a", 0), ("a", 1), ("b", 0), ("b", 1), ("a", 2), ("b", 2)]
    assert summary["num_records"] == 6 and summary["solver_avg_at_k"] == 0.5

    policy = OraclePolicy()
    again, _ = evaluate(PROBLEMS, policy, num_samples=3, config=CONFIG, records_path=str(path))
    assert policy.calls == [] and again == records


def test_failed_pair_has_no_answer_and_counts_wrong():
    class Truncating(OraclePolicy):
        def _one(self, request):
            return Completion("The answer is \\boxed{2", "length", 64)

    records, summary = evaluate(PROBLEMS[:1], Truncating(), num_samples=1, config=CONFIG)
    [r] = records
    assert (r["status"], r["answer"], r["correct"], r["final_candidate"]) == ("failed", None, False, None)
    assert r["failure"] and r["candidates"] == [] and r["tokens"]["solver"] == 3 * 64
    assert (summary["failed_rate"], summary["system_avg_at_k"]) == (1.0, 0.0)


def test_a_truncated_first_solver_output_is_not_graded_even_when_it_holds_the_box():
    class TruncatedOnce(OraclePolicy):
        def _one(self, request):
            if request.role == "solver" and not any("solver" in c for c in self.calls[:-1]):
                return Completion("The answer is \\boxed{2}, I think, but", "length", 64)
            return super()._one(request)

    [r], _ = evaluate(PROBLEMS[:1], TruncatedOnce(), num_samples=1, config=CONFIG)
    assert (r["solver_answer"], r["solver_correct"]) == ("2", False)  # the retry then solves it
    assert r["correct"] and r["steps"][0]["finish_reason"] == "length"


def test_duplicate_ids_are_rejected():
    with pytest.raises(ValueError):
        evaluate([PROBLEMS[0], PROBLEMS[0]], OraclePolicy(), num_samples=1, config=CONFIG)


@pytest.fixture
def gcs(monkeypatch):
    with fake_gcs.bucket(monkeypatch) as root:
        yield root


def test_records_on_gcs_are_uploaded_once_a_round_and_resumed(gcs, monkeypatch):
    """An object cannot be appended to (each append rewrites it): the pairs that finish in one
    V-C round are uploaded together."""
    path, appended = f"{gcs}/run/eval/records.jsonl", []
    append_text = storage.append_text
    monkeypatch.setattr(storage, "append_text", lambda target, text: (
        appended.append([json.loads(line)["problem_id"] for line in text.splitlines()]),
        append_text(target, text)))
    first, _ = evaluate(PROBLEMS, OraclePolicy(), num_samples=2, config=CONFIG, records_path=path)
    assert appended == [["a", "a"], ["b", "b"]]  # A's pairs end in round 5, B's in round 7
    assert [json.loads(line) for line in storage.path(path).read_text().splitlines()] == first
    append_text(path, '{"problem_id": "a", "sam')  # a write cut short
    policy = OraclePolicy()
    records, _ = evaluate(PROBLEMS, policy, num_samples=3, config=CONFIG, records_path=path)
    assert policy.calls[0] == ["solver", "solver"]  # only sample 2 of each problem
    assert records[:2] == first[:2] and records[3:5] == first[2:]
    assert [(r["problem_id"], r["sample"]) for r in map(json.loads, storage.path(path).read_text().splitlines())
            ] == [("a", 0), ("a", 1), ("b", 0), ("b", 1), ("a", 2), ("b", 2)]
