"""The probe grades each role's decisions as hand-counted for scripted policies."""
import re

import pytest

from mars_jax.agents.policy import Completion
from mars_jax.data import arith
from mars_jax.sft.probe import probe

PROBLEMS = arith.load_split("test", num_ops=(2, 2), max_operand=9, operators="+-")[:20]
BUDGETS = dict(solver=32, verifier=200, corrector=32)
GOLD = {p["problem"]: int(p["answer"]) for p in PROBLEMS}  # tests/sft/test_traces checks these
_PROBLEM = re.compile(r"What is .+\?")
_CLAIM = re.compile(r"## Solution\n(.+) = (-?\d+)\n")


def truth(text: str) -> int:
    return GOLD[_PROBLEM.search(text).group(0)]


class Scripted:
    """Solver right on the first `solver_right` requests; Verifier always Correct, or right when
    `verifier` is 'oracle'; Corrector copies the previous answer (fixes nothing), or, with
    `corrector` 'oracle', answers right."""

    def __init__(self, solver_right: int, verifier: str, corrector: str):
        self.solver_right, self.verifier, self.corrector = solver_right, verifier, corrector

    def complete(self, requests):
        out, solved = [], 0
        for r in requests:
            text = "\n".join(m["content"] for m in r.messages)
            gold = truth(text)
            if r.role == "solver":
                value = gold if solved < self.solver_right else gold + 1
                solved += 1
                reply = f"x = {value}\n\\boxed{{{value}}}"
            elif r.role == "verifier":
                right = int(_CLAIM.search(text).group(2)) == gold
                correct = right or self.verifier == "always_correct"
                reply = f"**Correctness:** {'Correct' if correct else 'Wrong'}"
            else:
                previous = int(re.search(r"\\boxed\{(-?\d+)\}", text).group(1))
                value = gold if self.corrector == "oracle" else previous
                reply = f"x = {value}\n\\boxed{{{value}}}"
            out.append(Completion(reply, "stop", len(reply)))
        return out


@pytest.mark.parametrize("solver_right,verifier,corrector,expected", [
    (20, "oracle", "oracle", dict(solver_accuracy=1.0, verifier_recall=1.0,
                                  verifier_specificity=1.0, verifier_balanced_accuracy=1.0,
                                  corrector_fix_rate=1.0)),
    (5, "always_correct", "copy", dict(solver_accuracy=0.25, verifier_recall=0.0,
                                       verifier_specificity=1.0, verifier_balanced_accuracy=0.5,
                                       corrector_fix_rate=0.0)),
])
def test_probe_counts_scripted_decisions(solver_right, verifier, corrector, expected):
    metrics = probe(Scripted(solver_right, verifier, corrector), PROBLEMS, max_new_tokens=BUDGETS,
                    seed=0)
    assert metrics == {f"probe/{k}": v for k, v in expected.items()}


def test_cut_off_replies_count_as_misses():
    class Truncated(Scripted):
        def complete(self, requests):
            return [Completion(c.text, "length", c.num_tokens) for c in super().complete(requests)]

    metrics = probe(Truncated(20, "oracle", "oracle"), PROBLEMS, max_new_tokens=BUDGETS, seed=0)
    assert set(metrics.values()) == {0.0}
