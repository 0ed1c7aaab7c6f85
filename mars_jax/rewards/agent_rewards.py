"""MarsRL's agent-specific 0/1 rewards.

* Solver and Corrector (`answer_reward`): 1 iff the response ended by itself and boxes,
  outside its thinking, an answer equivalent to the reference. An unfinished response (it
  ended by length) is never graded from its text: it earns `truncated_reward` (default 0).
* Verifier (`verifier_reward`): 1 iff the response ended by itself and its Correctness
  verdict equals the judged solution's actual correctness; a verdict that cannot be read,
  or a truncated report (it has no verdict), earns 0.

`thinking_open`: the response continues a `<think>` its prompt opened (see
`text.strip_thinking`); text inside an unclosed thought is never read as an answer or verdict.
For batches use `grader.grade_many` (parallel) on the finished responses.
"""

from __future__ import annotations

import re

from mars_jax.rewards.grader import grade
from mars_jax.rewards.text import strip_thinking

# The Correctness heading, as a line of its own or followed by a colon, maybe numbered:
# "**Correctness:** Wrong", "3. Correctness: Correct", "### Correctness" + next line.
CORRECTNESS_HEADING = re.compile(r"^[ \t>#*_-]*(?:\d+[.)][ \t>#*_-]*)?correctness[ \t*_]*(?::|\r?$)",
                                 re.IGNORECASE | re.MULTILINE)
_COMMANDS = re.compile(r"\\(?:boxed|text|textbf|mathrm|mathbf)\s*\{")
_DECORATION = " \t*_`#>\"'[](){}$"
# The verdict word, alone or followed by punctuation ("Wrong.", "Correct (see above)").
# Not "/" or "|": "Correct/Wrong" is ambiguous.
_VERDICT = re.compile(r"(correct|wrong|incorrect)(?:\s*[^\w\s/|].*)?", re.IGNORECASE | re.DOTALL)
_VALUES = {"correct": True, "wrong": False, "incorrect": False}
_VERDICT_WORD = re.compile(r"\b(?:correct|wrong|incorrect)\b", re.IGNORECASE)


def parse_verdict(text: str, *, thinking_open: bool = False) -> bool | None:
    """The Verifier's verdict: True for "Correct", False for "Wrong" (or "Incorrect").

    Reads the value of the last Correctness heading after thinking is stripped: the
    rest of the heading line, or the next non-empty line when that is empty. Markdown,
    quotes, brackets and `\\boxed{}`/`\\text{}` around the word are ignored. None when
    there is no heading, the value is not one of the words (optionally followed by
    punctuation and more text), or it also names the opposite verdict: "Not correct",
    "Correct or Wrong", "Correct; actually Wrong", "Partially correct" are None.
    Matching is whole-word, so "Incorrect" never reads as "Correct".
    """
    visible = strip_thinking(text, thinking_open=thinking_open)
    headings = list(CORRECTNESS_HEADING.finditer(visible))
    if not headings:
        return None
    after = visible[headings[-1].end() :]
    for line in after.splitlines():
        value = _COMMANDS.sub("", line).strip(_DECORATION)
        if value:
            match = _VERDICT.fullmatch(value)
            if not match or len({_VALUES[word.lower()] for word in _VERDICT_WORD.findall(value)}) > 1:
                return None
            return _VALUES[match.group(1).lower()]
    return None


def answer_reward(text: str, gold: str, finished: bool, *, truncated_reward: float = 0.0,
                  thinking_open: bool = False) -> float:
    """Solver / Corrector: 1.0 iff `finished` and `text` boxes an answer equivalent to `gold`
    outside its thinking, else 0.0; `truncated_reward` when not `finished` (text unread)."""
    if not finished:
        return truncated_reward
    return float(grade(text, gold, thinking_open=thinking_open))


def verifier_reward(text: str, judged_correct: bool, finished: bool, *,
                    thinking_open: bool = False) -> float:
    """1.0 iff `finished` and the verdict of `text` equals `judged_correct` (whether the judged
    solution is actually correct); an unreadable verdict or a truncated report: 0.0."""
    verdict = parse_verdict(text, thinking_open=thinking_open) if finished else None
    return float(verdict is not None and verdict == judged_correct)
