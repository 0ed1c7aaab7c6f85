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
    assert (result.status, result.final, result.verifications, result.answer) == ("accepted", 0, 4, "s1")
    assert result.iterations == 3  # the first verification is not an iteration
    assert result.solution == "Solution s1. So \\boxed{s1}"
    assert result.candidates[0].verdicts == (True,) * 4
    assert result.tokens_by_role() == {"solver": 10, "verifier": 12, "corrector": 0}


def test_failed_verification_resets_the_streak_and_triggers_correction():
    result, calls = run_one({"solver": [sol("s1")], "verifier": [ok(), ok(), ok(), bad("b1")] + [ok()] * 4,
                             "corrector": [sol("s2")]})
    assert calls == [S, V("s1"), V("s1"), V("s1"), V("s1"), C("s1", "b1")] + [V("s2")] * 4
    assert (result.status, result.final, result.verifications, result.answer) == ("accepted", 1, 8, "s2")
    assert [c.source for c in result.candidates] == ["solver", "corrector"]
    assert [c.verdicts for c in result.candidates] == [(True, True, True, False), (True,) * 4]


def test_gives_up_after_max_iterations_without_correcting_the_last_failure():
    # max_iterations=2: the first verification, then 2 iterations of (correct, verify).
    result, calls = run_one({"solver": [sol("s1")], "verifier": [bad("b1"), bad("b2"), bad("b3")],
                             "corrector": [sol("s2"), sol("s3")]}, max_iterations=2)
    assert calls == [S, V("s1"), C("s1", "b1"), V("s2"), C("s2", "b2"), V("s3")]
    assert (result.status, result.verifications, result.iterations, result.failure) == ("fallback", 3, 2, None)
    assert result.final == 2  # no passes anywhere: the latest candidate


@pytest.mark.parametrize("max_iterations", [0, 1, 2, 3, 10])
def test_a_verifier_that_always_fails_gets_n_plus_one_verifications_and_n_corrections(max_iterations):
    # Hand count of the released loop: verify once after the Solver, then N x (correct, verify).
    n = max_iterations
    result, calls = run_one({"solver": [sol("s0")], "verifier": [bad(f"b{i}") for i in range(n + 1)],
                             "corrector": [sol(f"s{i + 1}") for i in range(n)]}, max_iterations=n)
    assert calls == [S, V("s0")] + [x for i in range(n) for x in (C(f"s{i}", f"b{i}"), V(f"s{i + 1}"))]
    assert (result.status, result.verifications, result.iterations, len(result.candidates)) == (
        "fallback", n + 1, n, n + 1)


def test_passing_verifications_spend_iterations_without_corrections():
    # k_accept=4 is out of reach in max_iterations=2 (3 verifications): no Corrector call.
    result, calls = run_one({"solver": [sol("s1")], "verifier": [ok()] * 3}, max_iterations=2)
    assert calls == [S, V("s1"), V("s1"), V("s1")]
    assert (result.status, result.final, result.verifications) == ("fallback", 0, 3)


def test_acceptance_on_the_last_allowed_verification():
    # bad, then 4 passes of the correction = 5 verifications = 1 + max_iterations.
    result, calls = run_one({"solver": [sol("s1")], "verifier": [bad("b1")] + [ok()] * 4,
                             "corrector": [sol("s2")]}, max_iterations=4)
    assert calls == [S, V("s1"), C("s1", "b1")] + [V("s2")] * 4
    assert (result.status, result.final, result.verifications) == ("accepted", 1, 5)


# Fallback rules. Candidate verdicts in each script, and the hand-picked winner of each rule:
#   most_passed    the most True verdicts, ties to the latest;
#   most_verified  the most verdicts that are not None, ties to the earliest.
FALLBACK_CASES = {
    # s1: T T F (2 passes, 3 verdicts); s2: T F (1, 2); s3: F (0, 1).
    "clear_winner": ({"verifier": [ok(), ok(), bad("b1"), ok(), bad("b2"), bad("b3")],
                      "corrector": [sol("s2"), sol("s3")]}, 5, {}, [2, 1, 0], [3, 2, 1], 0, 0),
    # s1: T T F (2, 3); s2: T T T, cut by the cap (3, 3): passes favour s2, the verdict count ties.
    "passes_vs_count": ({"verifier": [ok(), ok(), bad("b1")] + [ok()] * 3, "corrector": [sol("s2")]},
                        5, {}, [2, 3], [3, 3], 1, 0),
    # s1: T F (1, 2); s2: T (1, 1): a tie in passes goes to the latest, the count picks s1.
    "tied_passes": ({"verifier": [ok(), bad("b1"), ok()], "corrector": [sol("s2")]}, 2, {},
                    [1, 1], [2, 1], 1, 0),
    # max_retries=0: s1: None None F (0 passes, 1 verdict); s2: T T (2, 2). A None verdict is
    # not a verification received, so both rules pick s2 (counting None would pick s1).
    "unusable_not_counted": ({"verifier": [garbage(), garbage(), bad("b1"), ok(), ok()],
                              "corrector": [sol("s2")]}, 4, {"max_retries": 0}, [0, 2], [1, 2], 1, 1),
}


@pytest.mark.parametrize("fallback", ["most_passed", "most_verified"])
@pytest.mark.parametrize("case", list(FALLBACK_CASES))
def test_fallback_rules_pick_the_hand_computed_candidate(case, fallback):
    script, n, extra, passes, verified, most_passed, most_verified = FALLBACK_CASES[case]
    result, _ = run_one({"solver": [sol("s1")], **script}, max_iterations=n, fallback=fallback, **extra)
    assert result.status == "fallback" and result.verifications == n + 1
    assert [c.passes for c in result.candidates] == passes
    assert [c.verified for c in result.candidates] == verified
    want = most_passed if fallback == "most_passed" else most_verified
    assert (result.final, result.answer) == (want, f"s{want + 1}")


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


def test_corrector_truncated_beyond_retries_returns_the_fallback_candidate():
    # s1 passes three times, then fails; no Corrector output ends: s1 is still the answer.
    result, calls = run_one({"solver": [sol("s1")], "verifier": [ok()] * 3 + [bad("b1")],
                             "corrector": [sol("x", "length")] * 2}, max_retries=1)
    assert calls == [S] + [V("s1")] * 4 + [C("s1", "b1"), C("s1", "b1")]
    assert (result.status, result.final, result.answer, result.verifications) == (
        "fallback", 0, "s1", 4)
    assert "corrector" in result.failure and "length" in result.failure


def test_an_output_that_is_all_thinking_is_retried():
    thought = Completion("<think>so it is s1</think>", "stop", 5)
    result, calls = run_one({"solver": [thought, sol("s1")], "verifier": [ok()] * 4})
    assert calls == [S, S] + [V("s1")] * 4
    assert (result.status, result.answer) == ("accepted", "s1")
    failed, _ = run_one({"solver": [thought] * 2}, max_retries=1)
    assert failed.status == "failed" and "no visible text" in failed.failure


def test_unusable_verification_is_retried_without_counting_an_iteration():
    result, calls = run_one({"solver": [sol("s1")], "verifier": [garbage(), ok(), garbage("length"), ok(), ok(), ok()]})
    assert calls == [S] + [V("s1")] * 6
    assert (result.status, result.verifications) == ("accepted", 4)  # retries are not verifications
    assert [s.verdict for s in result.steps[1:]] == [None, True, None, True, True, True]


def test_verification_unusable_beyond_retries_breaks_the_streak_and_reverifies():
    verifier = [ok(), ok()] + [garbage()] * 3 + [ok()] * 4
    result, calls = run_one({"solver": [sol("s1")], "verifier": verifier})
    assert calls == [S] + [V("s1")] * 9
    assert (result.status, result.verifications) == ("accepted", 7)
    assert result.candidates[0].verdicts == (True, True, None, True, True, True, True)


def test_zero_iterations_verifies_the_solver_once():
    result, calls = run_one({"solver": [sol("s1")], "verifier": [bad("b1")]}, max_iterations=0)
    assert calls == [S, V("s1")]  # the failure is not corrected
    assert (result.status, result.final, result.verifications, result.iterations) == ("fallback", 0, 1, 0)
    accepted, _ = run_one({"solver": [sol("s1")], "verifier": [ok()]}, max_iterations=0, k_accept=1)
    assert (accepted.status, accepted.final) == ("accepted", 0)


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
    assert not loop.done
    loop.advance(bad("b1"))
    assert loop.done
    with pytest.raises(RuntimeError):
        loop.next_request()


def test_config_validation():
    with pytest.raises(ValueError):
        LoopConfig(max_new_tokens={"solver": 1})
    with pytest.raises(ValueError, match="k_accept: must be >= 1, got 0"):
        LoopConfig(k_accept=0)
    with pytest.raises(ValueError, match="max_retries"):
        LoopConfig(max_retries=-1)
    with pytest.raises(ValueError, match="max_new_tokens: must be >= 1 .*'verifier': 0"):
        LoopConfig(max_new_tokens={"solver": 5, "verifier": 0, "corrector": 5})
    with pytest.raises(ValueError, match="fallback"):
        LoopConfig(fallback="latest")


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
