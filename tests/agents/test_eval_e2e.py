"""End to end through the eval job: every role of the V–C system, scripted, with the loop's
decisions checked against hand-computed expectations; and the tiny model on the real sampler."""
import json

import numpy as np
import pytest

from experiments.configs import eval_system
from mars_jax import eval_job, storage
from mars_jax.agents.policy import ChatRequest, Completion
from tests import fake_gcs

K_ACCEPT, MAX_ITERATIONS, MAX_RETRIES = 2, 2, 1  # so at most 3 verifications per problem

# Per problem (in dataset order) the scripted outputs of each role, in call order. 'right' and
# 'wrong' box the gold answer or gold + 1; 'T'/'F' are Correct/Wrong verdicts; '~' is a
# truncated output (finish_reason 'length').
SCENARIOS = [
    # accepted: 2 passes of the Solver's right answer.
    {"solver": ["right"], "verifier": ["T", "T"]},
    # a failed verification is corrected; the correction passes twice.
    {"solver": ["wrong"], "verifier": ["F", "T", "T"], "corrector": ["right"]},
    # the cap: 3 verifications without 2 passes in a row. s1 (wrong) T F, s2 (right) T:
    # most_passed ties (1, 1) -> the latest (s2, right); most_verified (2, 1) -> s1 (wrong).
    {"solver": ["wrong"], "verifier": ["T", "F", "T"], "corrector": ["right"]},
    # retries on truncation: the Solver and one Verifier output are cut and asked again.
    {"solver": ["~", "right"], "verifier": ["~", "T", "T"]},
    # the Solver truncated beyond its retries: the problem fails with no answer.
    {"solver": ["~", "~"]},
    # a Verifier that always fails: 3 verifications, 2 corrections, then the fallback (no passes:
    # most_passed takes the latest, most_verified the earliest).
    {"solver": ["wrong"], "verifier": ["F", "F", "F"], "corrector": ["wrong", "wrong"]},
]

# What each problem must end with. final: chosen candidate per fallback rule.
EXPECTED = [
    dict(status="accepted", final={"most_passed": 0, "most_verified": 0}, verifications=2,
         roles="S V V", verdicts=[[True, True]]),
    dict(status="accepted", final={"most_passed": 1, "most_verified": 1}, verifications=3,
         roles="S V C V V", verdicts=[[False], [True, True]]),
    dict(status="fallback", final={"most_passed": 1, "most_verified": 0}, verifications=3,
         roles="S V V C V", verdicts=[[True, False], [True]]),
    dict(status="accepted", final={"most_passed": 0, "most_verified": 0}, verifications=2,
         roles="S S V V V", verdicts=[[True, True]]),
    dict(status="failed", final={"most_passed": None, "most_verified": None}, verifications=0,
         roles="S S", verdicts=[]),
    dict(status="fallback", final={"most_passed": 2, "most_verified": 0}, verifications=3,
         roles="S V C V C V", verdicts=[[False], [False], [False]]),
]
ROLE_LETTER = {"solver": "S", "verifier": "V", "corrector": "C"}
TOKENS = {"solver": 11, "verifier": 7, "corrector": 5}  # per completion, truncated ones included


class ScriptedAgents:
    """A `Policy` that plays the three roles from `SCENARIOS`, in the compact prompt format.

    It reads each request as a model would (problem, candidate solution, bug report), checks that
    the loop showed it the right things, and answers with a well-formed output."""

    def __init__(self, problems):
        self.gold = {p.problem: p.answer for p in problems}
        self.index = {p.problem: i for i, p in enumerate(problems)}
        self.queues = [{role: list(q) for role, q in s.items()} for s in SCENARIOS]
        self.last_solution = {}  # problem -> the newest candidate's text
        self.last_report = {}    # problem -> the newest Wrong verdict's findings
        self.calls = 0

    def complete(self, requests):
        self.calls += 1
        return [self._one(r) for r in requests]

    def _answer(self, problem: str, kind: str) -> str:
        gold = int(self.gold[problem])
        return str(gold if kind == "right" else gold + 1)

    def _one(self, request: ChatRequest) -> Completion:
        text = "\n".join(m["content"] for m in request.messages)
        problem = next(p for p in self.gold if p in text)
        kind = self.queues[self.index[problem]][request.role].pop(0)
        if request.role == "verifier":
            seen = text.split("## Solution\n")[1].split("\n\n## Reminder")[0]
            assert seen == self.last_solution[problem]  # the newest candidate, thinking stripped
            if kind == "~":
                return Completion("**Final Verdict:** let me check the", "length", TOKENS["verifier"])
            if kind == "T":
                return Completion("**Final Verdict:** sound.\n**List of Findings:** None\n"
                                  "**Correctness:** Correct", "stop", TOKENS["verifier"])
            report = f"**Final Verdict:** flawed.\n**List of Findings:** Critical Error in {problem}"
            self.last_report[problem] = report
            return Completion(report + "\n**Correctness:** Wrong", "stop", TOKENS["verifier"])
        if request.role == "corrector":
            assert [m["role"] for m in request.messages] == ["user", "assistant", "user"]
            assert request.messages[1]["content"] == self.last_solution[problem]
            assert request.messages[2]["content"].endswith(self.last_report[problem])
        if kind == "~":
            return Completion("<think>Let me think about", "length", TOKENS[request.role])
        solution = f"Working it out, {problem[8:-1]} = \\boxed{{{self._answer(problem, kind)}}}."
        self.last_solution[problem] = solution
        return Completion(f"<think>compute</think>{solution}", "stop", TOKENS[request.role])

    def exhausted(self) -> bool:
        return all(not q for s in self.queues for q in s.values())


def _config(fallback: str):
    config = eval_system.get_config("tiny")
    config.eval.num_problems, config.eval.num_samples = len(SCENARIOS), 1
    config.eval.k_accept, config.eval.max_iterations = K_ACCEPT, MAX_ITERATIONS
    config.eval.max_retries, config.eval.fallback = MAX_RETRIES, fallback
    return config


@pytest.mark.parametrize("fallback", ["most_passed", "most_verified"])
def test_eval_job_runs_every_role_and_the_loop_decides_as_computed_by_hand(tmp_path, monkeypatch,
                                                                           fallback):
    config = _config(fallback)
    problems = eval_job.load_eval_problems(config)
    agents = ScriptedAgents(problems)
    monkeypatch.setattr(eval_job, "build_policy", lambda _: agents)
    summary = eval_job.run(config, str(tmp_path))
    assert agents.exhausted()  # every scripted output was asked for, none more
    assert agents.calls == 6  # rounds = the longest problem's calls (S V C V C V)
    records = [json.loads(line) for line in (tmp_path / "eval/records.jsonl").read_text().splitlines()]
    records.sort(key=lambda r: r["problem_id"])
    correct, solver_correct = [], []
    for problem, record, want in zip(problems, records, EXPECTED):
        assert record["problem_id"] == problem.id
        assert record["status"] == want["status"]
        assert record["final_candidate"] == want["final"][fallback]
        assert record["verifications"] == want["verifications"]
        assert record["iterations"] == max(want["verifications"] - 1, 0)
        assert " ".join(ROLE_LETTER[s["role"]] for s in record["steps"]) == want["roles"]
        assert [c["verdicts"] for c in record["candidates"]] == want["verdicts"]
        assert record["tokens"] == {role: TOKENS[role] * want["roles"].split().count(ROLE_LETTER[role])
                                    for role in TOKENS}
        # Correctness, against the gold answer: the candidate's scripted kind decides it.
        kinds = [k for k in SCENARIOS[len(correct)]["solver"] + SCENARIOS[len(correct)].get(
            "corrector", []) if k != "~"]
        assert [c["correct"] for c in record["candidates"]] == [k == "right" for k in kinds]
        final = want["final"][fallback]
        correct.append(final is not None and kinds[final] == "right")
        solver_correct.append(SCENARIOS[len(solver_correct)]["solver"][0] == "right")
        assert record["correct"] == correct[-1] and record["solver_correct"] == solver_correct[-1]
        if final is not None:
            assert record["answer"] == str(int(problem.answer) + (kinds[final] == "wrong"))
    # By hand: system right on problems 0, 1, 3 and (most_passed) 2; the Solver alone on 0 only.
    assert correct == [True, True, fallback == "most_passed", True, False, False]
    assert summary["system_avg_at_k"] == pytest.approx((4 if fallback == "most_passed" else 3) / 6)
    assert summary["solver_avg_at_k"] == pytest.approx(1 / 6)
    assert (summary["accepted_rate"], summary["fallback_rate"], summary["failed_rate"]) == \
        pytest.approx((3 / 6, 2 / 6, 1 / 6))
    assert summary["mean_verifications"] == pytest.approx((2 + 3 + 3 + 2 + 0 + 3) / 6)
    assert summary == json.loads((tmp_path / "eval/summary.json").read_text())


def test_eval_job_on_tiny_model_with_the_real_sampler(tmp_path):
    """The in-process sampler path of the job (the untrained model's outputs decide nothing)."""
    config = eval_system.get_config("tiny")
    config.eval.num_problems, config.eval.num_samples = 3, 2
    config.eval.k_accept, config.eval.max_iterations, config.eval.max_retries = 1, 2, 1
    for role in ("solver", "verifier", "corrector"):
        config.eval.max_new_tokens[role] = 16
    summary = eval_job.run(config, str(tmp_path))
    records = [json.loads(line) for line in (tmp_path / "eval/records.jsonl").read_text().splitlines()]
    assert {(r["problem_id"], r["sample"]) for r in records} == {
        (f"arith-test-{i:05d}", s) for i in range(3) for s in range(2)}
    for r in records:
        assert r["status"] in ("accepted", "fallback", "failed")
        assert (r["status"] == "failed") == (r["failure"] is not None)
        assert r["tokens"]["solver"] > 0
        assert all(s["num_tokens"] <= 16 for s in r["steps"])
    assert summary == json.loads((tmp_path / "eval/summary.json").read_text())
    by_problem = {}
    for r in records:
        by_problem.setdefault(r["problem_id"], []).append(r)
    assert summary["system_avg_at_k"] == np.mean(
        [np.mean([r["correct"] for r in rs]) for rs in by_problem.values()])
    assert summary["failed_rate"] == np.mean([r["status"] == "failed" for r in records])


def test_eval_job_on_a_gcs_workdir_writes_and_resumes_there(monkeypatch):
    """The scripted run of the first test with `--workdir=gs://...` (a local fake GCS server):
    records, summary and TensorBoard scalars land in the bucket; a rerun finds every pair
    recorded there and asks no agent anything."""
    with fake_gcs.bucket(monkeypatch) as gcs:
        config = _config("most_passed")
        agents = ScriptedAgents(eval_job.load_eval_problems(config))
        monkeypatch.setattr(eval_job, "build_policy", lambda _: agents)
        summary = eval_job.run(config, f"{gcs}/run")
        written = storage.files(f"{gcs}/run/eval")
        assert {"records.jsonl", "summary.json"} <= set(written)
        assert any(name.startswith("tensorboard/events.out.tfevents") for name in written), written
        assert json.loads(storage.path(f"{gcs}/run/eval/summary.json").read_text()) == summary
        records = storage.path(f"{gcs}/run/eval/records.jsonl").read_text().splitlines()
        assert len(records) == len(SCENARIOS)
        assert summary["system_avg_at_k"] == pytest.approx(4 / 6)  # as the first test computed

        again = ScriptedAgents(eval_job.load_eval_problems(config))
        monkeypatch.setattr(eval_job, "build_policy", lambda _: again)
        assert eval_job.run(config, f"{gcs}/run") == summary and again.calls == 0
