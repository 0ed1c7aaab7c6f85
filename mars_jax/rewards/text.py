"""Text helpers shared by the agents and the grader: thinking removal and boxed answers, each a
linear-time scan.
"""

from __future__ import annotations

import re

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"

# Tokens that matter for brace matching: a box opener, an escaped character
# (so `\{`, `\}` and `\\` never count as grouping braces) or a bare brace.
_BRACE_TOKENS = re.compile(r"\\(?:boxed|fbox)\s*\{|\\.|[{}]", re.DOTALL)


def strip_thinking(text: str, *, thinking_open: bool = False) -> str:
    """The part of `text` a reader should see: everything up to the last `</think>` dropped, and
    from a `<think>` left open after it to the end (an unfinished thought has no answer). With
    `thinking_open` (the prompt opened a `<think>`), text without `</think>` is all thought.
    Whitespace is kept."""
    close = text.rfind(THINK_CLOSE)
    if close >= 0:
        text = text[close + len(THINK_CLOSE) :]
    elif thinking_open:
        return ""
    unclosed = text.find(THINK_OPEN)
    if unclosed >= 0:
        text = text[:unclosed]
    return text


def last_boxed(text: str) -> str | None:
    """Content of the last complete `\\boxed{...}` / `\\fbox{...}` in `text` (the one closing
    last, unstripped), or None. Braces nest; escaped braces do not count; an unclosed box is
    ignored."""
    stack: list[int | None] = []  # per open brace: content start if it opened a box
    best: tuple[int, int] | None = None
    for match in _BRACE_TOKENS.finditer(text):
        token = match.group()
        if token[-1] == "{" and token[0] == "\\" and len(token) > 2:
            stack.append(match.end())
        elif token == "{":
            stack.append(None)
        elif token == "}" and stack:
            start = stack.pop()
            if start is not None:
                best = (start, match.start())
    if best is None:
        return None
    return text[best[0] : best[1]]
