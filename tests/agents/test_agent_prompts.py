"""Prompt structure, bug-report extraction and the stage parsers."""

import pytest

from mars_jax.agents import prompts, stages
from mars_jax.agents.policy import Completion

REPORT = """<think>Let me check step 3 carefully.
Correctness: Correct?</think>
**Final Verdict:** The solution has a critical error.

**List of Findings:**
* **Location:** "hence x = 3"
  **Issue:** Critical Error - the correctness of this step depends on x > 0, never shown.

**Correctness:** Wrong"""


def test_solver_prompt_is_the_problem_and_the_boxed_instruction():
    [turn] = prompts.solver_messages("  What is 1+1?\n")
    assert turn["role"] == "user"
    assert turn["content"].startswith("What is 1+1?\n\n")
    assert "\\boxed{}" in turn["content"]


def test_verifier_prompt_has_three_part_instructions_and_strips_thinking():
    system, user = prompts.verifier_messages("What is 1+1?", "<think>scratch work</think>It is \\boxed{2}.")
    assert (system["role"], user["role"]) == ("system", "user")
    for part in ("Final Verdict", "List of Findings", "Location", "Issue", "Critical Error",
                 "Justification Gap", "Correctness", "Correct or Wrong"):
        assert part in system["content"]
    content = user["content"]
    assert content.index("## Problem\nWhat is 1+1?") < content.index("## Solution\nIt is \\boxed{2}.") \
        < content.index("## Reminder")
    assert "scratch work" not in content


def test_corrector_prompt_is_three_turns():
    turns = prompts.corrector_messages("What is 1+1?", "<think>hmm</think>It is \\boxed{3}.", "**Final Verdict:** x")
    assert [t["role"] for t in turns] == ["user", "assistant", "user"]
    assert turns[0] == prompts.solver_messages("What is 1+1?")[0]
    assert turns[1]["content"] == "It is \\boxed{3}."
    assert turns[2]["content"].endswith("## Bug Report\n**Final Verdict:** x")
    assert "explain" in turns[2]["content"]


def test_bug_report_keeps_verdict_and_findings_only():
    report = prompts.bug_report(REPORT)
    assert report.startswith("**Final Verdict:** The solution has a critical error.")
    assert "the correctness of this step depends on x > 0" in report  # not a Correctness heading
    assert report.endswith("never shown.")
    assert "Wrong" not in report and "Let me check" not in report


def test_bug_report_heading_variants():
    assert prompts.bug_report("Verdict: bad.\n\n### Correctness\nWrong") == "Verdict: bad."
    assert prompts.bug_report("Verdict: bad.\nCorrectness: Wrong\n") == "Verdict: bad."
    assert prompts.bug_report("Verdict: fine.") == "Verdict: fine."


def test_parse_verification_and_solution():
    v = stages.parse_verification(Completion(REPORT, "stop", 5))
    assert v.passed is False and v.usable and v.report == prompts.bug_report(REPORT)
    assert not stages.parse_verification(Completion(REPORT, "length", 5)).usable
    assert not stages.parse_verification(Completion("no verdict here", "stop", 5)).usable
    s = stages.parse_solution(Completion("<think>try 3</think>\nSo the answer is \\boxed{2}.", "stop", 9))
    assert (s.solution, s.answer, s.usable) == ("So the answer is \\boxed{2}.", "2", True)
    assert not stages.parse_solution(Completion("\\boxed{2}", "length", 9)).usable
    assert not stages.parse_solution(Completion("<think>it is 2</think>\n", "stop", 9)).usable


class EchoPolicy:
    def __init__(self, text):
        self.text, self.requests = text, []

    def complete(self, requests):
        self.requests.append(list(requests))
        return [Completion(self.text, "stop", 1) for _ in requests]


def test_complete_makes_one_batched_call_and_none_for_no_requests():
    policy = EchoPolicy("\\boxed{4}")
    requests = [stages.solver_request("p1", 7), stages.corrector_request("p1", "s1", "r1", 6)]
    completions = stages.complete(policy, requests)
    assert [stages.parse_solution(c).answer for c in completions] == ["4", "4"]
    [batch] = policy.requests
    assert [(r.role, r.max_new_tokens) for r in batch] == [("solver", 7), ("corrector", 6)]
    assert batch[1].messages[1]["content"] == "s1"
    assert stages.complete(policy, []) == [] and len(policy.requests) == 1


@pytest.mark.parametrize("report", ["Verdict: bad.\n3. **Correctness:** Wrong",
                                    "Verdict: bad.\n**3. Correctness:** Wrong",
                                    "Verdict: bad.\r\n**Correctness**\r\nWrong\r\n"])
def test_bug_report_drops_numbered_and_crlf_headings(report):
    assert prompts.bug_report(report) == "Verdict: bad."


# With the Qwen3-Thinking-2507 template the prompt opens `<think>`: the reply has only `</think>`.
THOUGHT = "2+2 is \\boxed{4}, let me double-check that"


@pytest.mark.parametrize("text, reason, opened, right", [
    ("<think>2+2</think>So \\boxed{4}.", "stop", False, True),
    ("<think>2+2</think>So \\boxed{5}.", "stop", False, False),
    ("So the answer is 4.", "stop", False, False),  # no boxed answer
    (THOUGHT, "length", True, False),
    (THOUGHT, "length", False, False),  # ended by length: the text is not read
    (THOUGHT, "stop", True, False),  # never closed the thought its prompt opened: no answer
    (THOUGHT + "</think>So \\boxed{4}.", "stop", True, True),
    ("<think>" + THOUGHT + "</think>So \\boxed{4}.", "stop", False, True),
    ("\\boxed{4}", "error", False, False),
])
def test_correct_grades_usable_solutions_only(text, reason, opened, right):
    output = stages.parse_solution(Completion(text, reason, 9, thinking_open=opened))
    assert stages.correct([output], ["4"]) == [right]


def test_a_verdict_needs_a_report_that_ended_by_itself_outside_the_opened_thought():
    report = "**Final Verdict:** fine.\n**List of Findings:** None\n**Correctness:** Correct"
    assert stages.parse_verification(Completion(report, "stop", 9)).verdict is True
    assert stages.parse_verification(Completion(report, "length", 9)).verdict is None
    assert stages.parse_verification(Completion(report, "stop", 9, thinking_open=True)).verdict \
        is None
    assert stages.parse_verification(Completion("no verdict", "stop", 9)).verdict is None
