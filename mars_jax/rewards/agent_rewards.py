"""MarsRL's agent-specific 0/1 rewards.

* Solver and Corrector: 1 iff the response boxes an answer equivalent to the reference.
* Verifier: 1 iff its Correctness verdict equals the judged solution's actual
  correctness; a verdict that cannot be read earns 0.

For batches use `grader.grade_many` (parallel) and `verifier_reward` per item.
"""

from __future__ import annotations

import re

from mars_jax.rewards.grader import grade
from mars_jax.rewards.text import strip_thinking

# The Correctness heading, as a line of its own or followed by a colon:
# "**Correctness:** Wrong", "Correctness: Correct", "### Correctness" + next line.
_HEADING = re.compile(r"^[ \t>#*_-]*correctness[ \t*_]*(?::|$)", re.IGNORECASE | re.MULTILINE)
_COMMANDS = re.compile(r"\\(?:boxed|text|textbf|mathrm|mathbf)\s*\{")
_DECORATION = " \t*_`#>\"'[](){}$"
# The verdict word, alone or followed by punctuation ("Wrong.", "Correct (see above)").
# Not "/" or "|": "Correct/Wrong" is ambiguous.
_VERDICT = re.compile(r"(correct|wrong|incorrect)(?:\s*[^\w\s/|].*)?", re.IGNORECASE | re.DOTALL)
_VALUES = {"correct": True, "wrong": False, "incorrect": False}


def parse_verdict(text: str) -> bool | None:
    """The Verifier's verdict: True for "Correct", False for "Wrong" (or "Incorrect").

    Reads the value of the last Correctness heading after thinking is stripped: the
    rest of the heading line, or the next non-empty line when that is empty. Markdown,
    quotes, brackets and `\\boxed{}`/`\\text{}` around the word are ignored. None when
    there is no heading or the value is not exactly one of the words (optionally
    followed by punctuation): "Not correct", "Correct or Wrong", "Partially correct"
    are None. Matching is whole-word, so "Incorrect" never reads as "Correct".
    """
    visible = strip_thinking(text)
    headings = list(_HEADING.finditer(visible))
    if not headings:
        return None
    after = visible[headings[-1].end() :]
    for line in after.splitlines():
        value = _COMMANDS.sub("", line).strip(_DECORATION)
        if value:
            match = _VERDICT.fullmatch(value)
            return _VALUES[match.group(1).lower()] if match else None
    return None


def solver_reward(response: str, gold: str) -> float:
    """1.0 iff the Solver's response boxes an answer equivalent to `gold`."""
    return float(grade(response, gold))


def corrector_reward(response: str, gold: str) -> float:
    """1.0 iff the Corrector's revised solution boxes an answer equivalent to `gold`."""
    return float(grade(response, gold))


def verifier_reward(verdict_text: str, solution_is_correct: bool) -> float:
    """1.0 iff the Verifier's verdict equals `solution_is_correct`; unreadable verdict: 0.0."""
    verdict = parse_verdict(verdict_text)
    return float(verdict is not None and verdict == solution_is_correct)
