"""Table tests for parse_verdict and read_verification (what a reply earns: tests/agents, tests/rl/test_judged_alike.py)."""

import pytest

from mars_jax.rewards.agent_rewards import Verification, parse_verdict, read_verification


@pytest.mark.parametrize(
    "text, verdict",
    [
        ("**Correctness:** Correct", True),
        ("**Correctness:** Wrong", False),
        ("Correctness: correct", True),
        ("**Correctness**: **Wrong**", False),
        ("### Correctness\n\nCorrect\n", True),
        ("Correctness: Wrong.", False),
        ("Correctness: Correct (no issues found)", True),
        ("Correctness: [Correct]", True),
        ("Correctness: \\boxed{\\text{Wrong}}", False),
        # "Incorrect" means wrong; it must never read as "Correct" (substring match would).
        ("**Correctness:** Incorrect", False),
        ("**Final Verdict:** The solution is correct.\n**List of Findings:** None\n**Correctness:** Correct", True),
        ("**Final Verdict:** correct.\n**Correctness:** Wrong", False),
        # The last heading counts; thinking is ignored.
        ("**Correctness:** Correct\nOn reflection:\n**Correctness:** Wrong", False),
        ("<think>**Correctness:** Wrong</think>\n**Correctness:** Correct", True),
        # Numbered headings and CRLF line ends.
        ("3. **Correctness:** Wrong", False),
        ("**3. Correctness:** Wrong", False),
        ("1) Correctness: Correct", True),
        ("**Correctness**\r\nWrong", False),
        ("**Final Verdict:** fine.\r\n### Correctness\r\n\r\nCorrect\r\n", True),
        # More text after the verdict, not naming the opposite one.
        ("Correctness: Incorrect. The final answer is wrong.", False),
        ("Correctness: Correct, and the answer is correct.", True),
        # Missing or ambiguous: None.
        ("The solution is correct.", None),
        ("Correctness:", None),
        ("Correctness: Not correct", None),
        ("Correctness: Partially correct", None),
        ("Correctness: Correct or Wrong", None),
        ("Correctness: Correct/Wrong", None),
        ("Correctness: **Correct** or **Wrong**", None),
        ("**Correctness:** *Correct* / *Wrong*", None),
        ("Correctness: Correct; actually Wrong", None),
        ("Correctness: Wrong. The answer is correct but step 2 is unjustified.", None),
        ("Correctness: Incorrect (or correct)", None),
        ("Correctness: Correctly argued", None),
        ("Correctness - Correct", None),
        ("<think>**Correctness:** Correct", None),
        ("", None),
    ],
)
def test_parse_verdict(text, verdict):
    assert parse_verdict(text) is verdict


def test_a_verdict_inside_the_thought_the_prompt_opened_is_no_verdict():
    report = "**Final Verdict:** fine.\n**List of Findings:** None\n**Correctness:** Correct"
    assert parse_verdict(report) is True
    assert parse_verdict(report, thinking_open=True) is None
    assert parse_verdict(report + "</think>" + report, thinking_open=True) is True


def test_read_verification_splits_at_the_last_heading_of_the_visible_text():
    # Hand-checked: the thought (with its own heading) is dropped; the visible text has two
    # Correctness headings, the last one ("3. Correctness" + "Wrong." on the next line) decides the
    # verdict and everything before it, stripped, is the report.
    text = ("<think>**Correctness:** Correct</think>\n"
            "**Final Verdict:** the sum is off.\n"
            "Correctness: a word I use loosely here\n"
            "**List of Findings:** step 2 adds 3 + 4 = 8.\n"
            "3. Correctness:\n\n  Wrong.\n")
    report = ("**Final Verdict:** the sum is off.\n"
              "Correctness: a word I use loosely here\n"
              "**List of Findings:** step 2 adds 3 + 4 = 8.")
    assert read_verification(text) == Verification(False, report)
    assert read_verification("  no heading at all\n") == Verification(None, "no heading at all")
    assert read_verification(text, thinking_open=True) == Verification(False, report)
    assert read_verification("**Correctness:** Correct", thinking_open=True) == Verification(None, "")
