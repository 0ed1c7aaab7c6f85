"""Table tests for parse_verdict and the agent rewards."""

import pytest

from mars_jax.rewards.agent_rewards import corrector_reward, parse_verdict, solver_reward, verifier_reward


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
        # Missing or ambiguous: None.
        ("The solution is correct.", None),
        ("Correctness:", None),
        ("Correctness: Not correct", None),
        ("Correctness: Partially correct", None),
        ("Correctness: Correct or Wrong", None),
        ("Correctness: Correct/Wrong", None),
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
    assert verifier_reward(verdict_text, solution_is_correct) == reward


@pytest.mark.parametrize("reward_fn", [solver_reward, corrector_reward])
def test_answer_rewards(reward_fn):
    assert reward_fn("<think>2+2</think>So \\boxed{4}.", "4") == 1.0
    assert reward_fn("<think>2+2</think>So \\boxed{5}.", "4") == 0.0
    assert reward_fn("So the answer is 4.", "4") == 0.0  # no boxed answer, no reward
