"""A Verifier reply read once (`read_verification`): its verdict and its bug report, split at the
last Correctness heading. Text inside an unclosed thought is never read as a verdict.
"""

from __future__ import annotations

import dataclasses
import re

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


@dataclasses.dataclass(frozen=True)
class Verification:
    """A Verifier reply read once: `verdict` (`parse_verdict`) and `report`, the visible text
    before the last Correctness heading (all of it when there is none), stripped."""

    verdict: bool | None
    report: str


def read_verification(text: str, *, thinking_open: bool = False) -> Verification:
    """The verdict and bug report of a Verifier reply, from one scan for the Correctness heading
    in its visible text (thinking stripped, `thinking_open` as in `strip_thinking`)."""
    visible = strip_thinking(text, thinking_open=thinking_open)
    headings = list(CORRECTNESS_HEADING.finditer(visible))
    if not headings:
        return Verification(None, visible.strip())
    last = headings[-1]
    return Verification(_value(visible[last.end():]), visible[: last.start()].strip())


def parse_verdict(text: str, *, thinking_open: bool = False) -> bool | None:
    """The Verifier's verdict: True for "Correct", False for "Wrong" (or "Incorrect"), read
    whole-word from the value of the last Correctness heading outside thinking (its line, or the
    next non-empty one), ignoring markup around the word. None without a heading, for another
    word, or when the value also names the opposite verdict ("Not correct", "Correct or Wrong")."""
    return read_verification(text, thinking_open=thinking_open).verdict


def _value(after: str) -> bool | None:
    """The verdict word that follows a Correctness heading (`parse_verdict`'s rules)."""
    for line in after.splitlines():
        value = _COMMANDS.sub("", line).strip(_DECORATION)
        if value:
            match = _VERDICT.fullmatch(value)
            if not match or len({_VALUES[word.lower()] for word in _VERDICT_WORD.findall(value)}) > 1:
                return None
            return _VALUES[match.group(1).lower()]
    return None
