"""Table tests for parse_verdict and the agent rewards."""

import pytest

from mars_jax.rewards.agent_rewards import answer_reward, parse_verdict, verifier_reward


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


@pytest.mark.parametrize(
    "verdict_text, solution_is_correct, reward",
    [
        ("**Correctness:** Correct", True, 1.0),  # true positive
        ("**Correctness:** Wrong", False, 1.0),  # true negative
        ("**Correctness:** Correct", False, 0.0),  # false positive
        ("**Correctness:** Wrong", True, 0.0),  # false negative
        ("**Correctness:** Incorrect", False, 1.0),
        ("**Correctness:** Incorrect", True, 0.0),
        ("no verdict at all", True, 0.0),
        ("no verdict at all", False, 0.0),
    ],
)
def test_verifier_reward(verdict_text, solution_is_correct, reward):
    assert verifier_reward(verdict_text, solution_is_correct, True) == reward


def test_answer_reward():
    assert answer_reward("<think>2+2</think>So \\boxed{4}.", "4", True) == 1.0
    assert answer_reward("<think>2+2</think>So \\boxed{5}.", "4", True) == 0.0
    assert answer_reward("So the answer is 4.", "4", True) == 0.0  # no boxed answer, no reward


# With the Qwen3-Thinking-2507 template the prompt opens `<think>`: the response has only `</think>`.
THOUGHT = "2+2 is \\boxed{4}, let me double-check that"


def test_a_truncated_thought_with_the_right_box_earns_nothing():
    assert answer_reward(THOUGHT, "4", False, thinking_open=True) == 0.0
    assert answer_reward(THOUGHT, "4", False) == 0.0  # ended by length: the text is not read
    # Ended by itself but never closed the thought its prompt opened: all thought, no answer.
    assert answer_reward(THOUGHT, "4", True, thinking_open=True) == 0.0


def test_the_same_thought_closed_with_a_final_box_earns_one():
    assert answer_reward(THOUGHT + "</think>So \\boxed{4}.", "4", True, thinking_open=True) == 1.0
    assert answer_reward("<think>" + THOUGHT + "</think>So \\boxed{4}.", "4", True) == 1.0


def test_truncated_reward_is_configurable():
    assert answer_reward("\\boxed{5}", "4", False, truncated_reward=-1.0) == -1.0


REPORT = "**Final Verdict:** fine.\n**List of Findings:** None\n**Correctness:** Correct"


def test_a_truncated_verifier_report_earns_nothing():
    assert verifier_reward(REPORT, True, True) == 1.0
    assert verifier_reward(REPORT, True, False) == 0.0  # truncated: no verdict
    # A verdict inside the thought the prompt opened is not a verdict.
    assert verifier_reward(REPORT, True, True, thinking_open=True) == 0.0
    assert verifier_reward(REPORT + "</think>" + REPORT, True, True, thinking_open=True) == 1.0
    assert parse_verdict(REPORT, thinking_open=True) is None
