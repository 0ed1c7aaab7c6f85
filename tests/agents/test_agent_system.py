"""V-C loop rules and round batching, driven by a scripted policy."""

import re

import pytest

from mars_jax.agents.policy import ChatRequest, Completion, RoutedPolicy
from mars_jax.agents.system import LoopConfig, ProblemLoop, run_system

BUDGETS = {"solver": 100, "verifier": 50, "corrector": 80}


def sol(tag, finish="stop"):
    return Completion(f"<think>draft of {tag}</think>Solution {tag}. So \\boxed{{{tag}}}", finish, 10)


def ok():
    return Completion("**Final Verdict:** sound.\n\n**List of Findings:** None\n\n**Correctness:** Correct",
                      "stop", 3)


def bad(tag):
    return Completion("<think>hmm</think>**Final Verdict:** flawed.\n\n**List of Findings:**\n"
                      f"* **Location:** step 2\n  **Issue:** Critical Error: {tag}\n\n**Correctness:** Wrong",
                      "stop", 4)


def garbage(finish="stop"):
    return Completion("I am not sure what to say.", finish, 2)


def describe(request: ChatRequest):
    """(role, problem, candidate seen, bug tag seen): what a request shows the policy."""
    text = "\n".join(m["content"] for m in request.messages)
    problem = re.search(r"Problem-\w+", text).group()
    if request.role == "solver":
        return ("solver", problem)
    if request.role == "verifier":
        solution = text.split("## Solution")[1].split("## Reminder")[0]
        return ("verifier", problem, re.search(r"Solution (\w+)", solution).group(1))
    assert [m["role"] for m in request.messages] == ["user", "assistant", "user"]
    assistant, fix = request.messages[1]["content"], request.messages[2]["content"]
    assert "<think>" not in assistant and "Correctness" not in fix and "<think>" not in fix
    return ("corrector", problem, re.search(r"Solution (\w+)", assistant).group(1),
            re.search(r"Critical Error: (\w+)", fix).group(1))


class ScriptedPolicy:
    """Pops canned completions per (problem, role); logs what each call received."""

    def __init__(self, scripts):
        self.scripts = {p: {r: list(q) for r, q in roles.items()} for p, roles in scripts.items()}
        self.calls = []

    def complete(self, requests):
        self.calls.append([describe(r) for r in requests])
        for r in requests:
            assert r.max_new_tokens == BUDGETS[r.role]
        return [self.scripts[describe(r)[1]][r.role].pop(0) for r in requests]

    def exhausted(self):
        return all(not q for roles in self.scripts.values() for q in roles.values())


def run_one(script, **config):
    policy = ScriptedPolicy({"Problem-A": script})
    [result] = run_system(["Problem-A: compute it."], policy, LoopConfig(max_new_tokens=BUDGETS, **config))
    assert policy.exhausted()
    return result, [call for [call] in policy.calls]  # one problem: one request per call


S, A = ("solver", "Problem-A"), "Problem-A"


def V(tag):
    return ("verifier", A, tag)


def C(tag, bug):
    return ("corrector", A, tag, bug)


def test_accepts_after_k_consecutive_passes():
    result, calls = run_one({"solver": [sol("s1")], "verifier": [ok()] * 4})
    assert calls == [S, V("s1"), V("s1"), V("s1"), V("s1")]
    assert (result.status, result.final, result.iterations, result.answer) == ("accepted", 0, 4, "s1")
    assert result.solution == "Solution s1. So \\boxed{s1}"
    assert result.candidates[0].verdicts == (True,) * 4
    assert result.tokens_by_role() == {"solver": 10, "verifier": 12, "corrector": 0}


def test_failed_verification_resets_the_streak_and_triggers_correction():
    result, calls = run_one({"solver": [sol("s1")], "verifier": [ok(), ok(), ok(), bad("b1")] + [ok()] * 4,
                             "corrector": [sol("s2")]})
    assert calls == [S, V("s1"), V("s1"), V("s1"), V("s1"), C("s1", "b1")] + [V("s2")] * 4
    assert (result.status, result.final, result.iterations, result.answer) == ("accepted", 1, 8, "s2")
    assert [c.source for c in result.candidates] == ["solver", "corrector"]
    assert [c.verdicts for c in result.candidates] == [(True, True, True, False), (True,) * 4]


def test_gives_up_after_max_iterations_without_correcting_the_last_failure():
    result, calls = run_one({"solver": [sol("s1")], "verifier": [bad("b1"), bad("b2")], "corrector": [sol("s2")]},
                            max_iterations=2)
    assert calls == [S, V("s1"), C("s1", "b1"), V("s2")]
    assert (result.status, result.iterations, result.failure) == ("fallback", 2, None)
    assert result.final == 1  # no passes anywhere: the latest candidate


def test_fallback_is_the_most_verified_candidate():
    result, calls = run_one({"solver": [sol("s1")], "verifier": [ok(), ok(), bad("b1"), ok(), bad("b2"), bad("b3")],
                             "corrector": [sol("s2"), sol("s3")]}, max_iterations=6)
    assert calls == [S, V("s1"), V("s1"), V("s1"), C("s1", "b1"), V("s2"), V("s2"), C("s2", "b2"), V("s3")]
    assert [c.passes for c in result.candidates] == [2, 1, 0]
    assert (result.status, result.final, result.answer) == ("fallback", 0, "s1")


def test_fallback_tie_goes_to_the_latest_candidate():
    result, _ = run_one({"solver": [sol("s1")], "verifier": [ok(), bad("b1"), ok()],
                         "corrector": [sol("s2")]}, max_iterations=3)
    assert [c.passes for c in result.candidates] == [1, 1]
    assert (result.status, result.final) == ("fallback", 1)


def test_truncated_solver_is_retried():
    result, calls = run_one({"solver": [sol("s0", "length"), Completion("", "error", 0), sol("s1")],
                             "verifier": [ok()] * 4})
    assert calls == [S, S, S, V("s1"), V("s1"), V("s1"), V("s1")]
    assert (result.status, result.answer, len(result.candidates)) == ("accepted", "s1", 1)
    assert [s.completion.finish_reason for s in result.steps[:3]] == ["length", "error", "stop"]
    assert result.tokens_by_role()["solver"] == 20  # retries count


def test_solver_truncated_beyond_retries_fails_the_problem():
    result, calls = run_one({"solver": [sol("s0", "length")] * 3})
    assert calls == [S, S, S]
    assert (result.status, result.final, result.answer, result.solution) == ("failed", None, None, None)
    assert result.candidates == () and "solver" in result.failure and "length" in result.failure


def test_corrector_truncated_beyond_retries_fails_the_problem():
    result, calls = run_one({"solver": [sol("s1")], "verifier": [bad("b1")],
                             "corrector": [sol("x", "length")] * 2}, max_retries=1)
    assert calls == [S, V("s1"), C("s1", "b1"), C("s1", "b1")]
    assert (result.status, result.answer, result.iterations) == ("failed", None, 1)
    assert "corrector" in result.failure


def test_unusable_verification_is_retried_without_counting_an_iteration():
    result, calls = run_one({"solver": [sol("s1")], "verifier": [garbage(), ok(), garbage("length"), ok(), ok(), ok()]})
    assert calls == [S] + [V("s1")] * 6
    assert (result.status, result.iterations) == ("accepted", 4)
    assert [s.verdict for s in result.steps[1:]] == [None, True, None, True, True, True]


def test_verification_unusable_beyond_retries_breaks_the_streak_and_reverifies():
    verifier = [ok(), ok()] + [garbage()] * 3 + [ok()] * 4
    result, calls = run_one({"solver": [sol("s1")], "verifier": verifier})
    assert calls == [S] + [V("s1")] * 9
    assert (result.status, result.iterations) == ("accepted", 7)
    assert result.candidates[0].verdicts == (True, True, None, True, True, True, True)


def test_zero_iterations_is_the_solver_alone():
    result, calls = run_one({"solver": [sol("s1")]}, max_iterations=0)
    assert calls == [S]
    assert (result.status, result.final, result.iterations) == ("fallback", 0, 0)


THREE = {
    # 5 rounds: S V V V V
    "Problem-A": {"solver": [sol("a1")], "verifier": [ok()] * 4},
    # 7 rounds: S V C V V V V
    "Problem-B": {"solver": [sol("b1")], "verifier": [bad("x")] + [ok()] * 4, "corrector": [sol("b2")]},
    # 2 rounds: S S(fail after 1 retry)
    "Problem-C": {"solver": [sol("c", "length")] * 2},
}


def test_one_policy_call_per_round_serves_every_problem_at_its_stage():
    policy = ScriptedPolicy(THREE)
    rounds = []
    results = run_system(["Problem-A", "Problem-B", "Problem-C"], policy,
                         LoopConfig(max_new_tokens=BUDGETS, max_retries=1), on_round=rounds.append)
    assert policy.exhausted()
    assert [r.status for r in results] == ["accepted", "accepted", "failed"]
    assert len(policy.calls) == 7  # rounds, not problems x rounds
    assert policy.calls[:3] == [
        [S, ("solver", "Problem-B"), ("solver", "Problem-C")],
        [V("a1"), ("verifier", "Problem-B", "b1"), ("solver", "Problem-C")],
        [V("a1"), ("corrector", "Problem-B", "b1", "x")],
    ]
    assert [len(c) for c in policy.calls] == [3, 3, 2, 2, 2, 1, 1]
    assert [(r.round, r.finished, r.total) for r in rounds] == [
        (1, 0, 3), (2, 1, 3), (3, 1, 3), (4, 1, 3), (5, 2, 3), (6, 2, 3), (7, 3, 3)]
    assert rounds[2].requests_by_role == {"solver": 0, "verifier": 1, "corrector": 1}


def test_max_in_flight_refills_finished_slots():
    policy = ScriptedPolicy(THREE)
    done = []
    run_system(["Problem-A", "Problem-B", "Problem-C"], policy, LoopConfig(max_new_tokens=BUDGETS, max_retries=1),
               max_in_flight=2, on_result=lambda i, r: done.append((i, r.status)))
    assert [len(c) for c in policy.calls] == [2] * 7
    assert policy.calls[4] == [V("a1"), ("verifier", "Problem-B", "b2")]
    assert policy.calls[5] == [("verifier", "Problem-B", "b2"), ("solver", "Problem-C")]
    assert done == [(0, "accepted"), (1, "accepted"), (2, "failed")]


def test_routed_policy_makes_one_call_per_policy_per_round():
    solver_policy, vc_policy = ScriptedPolicy(THREE), ScriptedPolicy(THREE)
    results = run_system(["Problem-A", "Problem-B", "Problem-C"],
                         RoutedPolicy(vc_policy, {"solver": solver_policy}),
                         LoopConfig(max_new_tokens=BUDGETS, max_retries=1))
    assert [r.status for r in results] == ["accepted", "accepted", "failed"]
    assert solver_policy.calls == [[S, ("solver", "Problem-B"), ("solver", "Problem-C")], [("solver", "Problem-C")]]
    assert {d[0] for call in vc_policy.calls for d in call} == {"verifier", "corrector"}
    assert len(vc_policy.calls) == 6


def test_routed_policy_rejects_unknown_roles():
    with pytest.raises(ValueError):
        RoutedPolicy(ScriptedPolicy({}), {"critic": ScriptedPolicy({})})


def test_loop_refuses_use_after_finishing():
    loop = ProblemLoop("Problem-A", LoopConfig(max_new_tokens=BUDGETS, max_iterations=0))
    with pytest.raises(RuntimeError):
        loop.result()
    loop.advance(sol("s1"))
    assert loop.done
    with pytest.raises(RuntimeError):
        loop.next_request()


def test_config_validation():
    with pytest.raises(ValueError):
        LoopConfig(max_new_tokens={"solver": 1})
    with pytest.raises(ValueError):
        LoopConfig(k_accept=0)


def test_text_inside_the_thought_the_prompt_opened_is_neither_answer_nor_verdict():
    # Qwen3-Thinking-2507: the prompt opens <think>, so the completion has only </think>.
    from mars_jax.agents import stages
    thought = "2 + 2 = \\boxed{4}. **Correctness:** Correct"
    solution = stages.parse_solution(Completion(thought, "stop", 9, thinking_open=True))
    assert (solution.solution, solution.answer) == ("", None)
    closed = stages.parse_solution(Completion(thought + "</think>So \\boxed{4}", "stop", 9,
                                              thinking_open=True))
    assert (closed.solution, closed.answer) == ("So \\boxed{4}", "4")
    report = stages.parse_verification(Completion(thought, "stop", 9, thinking_open=True))
    assert (report.passed, report.report, report.usable) == (None, "", False)
    # The same text from a template that opened nothing is read as usual.
    assert stages.parse_solution(Completion(thought, "stop", 9)).answer == "4"
