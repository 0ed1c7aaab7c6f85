"""Text helpers shared by the agents and the grader: thinking removal and boxed answers.

Every function is a linear-time scan, safe on any input size.
"""

from __future__ import annotations

import re

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"

# Tokens that matter for brace matching: a box opener, an escaped character
# (so `\{`, `\}` and `\\` never count as grouping braces) or a bare brace.
_BRACE_TOKENS = re.compile(r"\\(?:boxed|fbox)\s*\{|\\.|[{}]", re.DOTALL)


def strip_thinking(text: str, *, thinking_open: bool = False) -> str:
    """The part of `text` a reader should see: thinking removed.

    Everything up to and including the last `</think>` is dropped. A `<think>` left
    after that point was never closed (e.g. a generation truncated mid-thought), so
    everything from it to the end is dropped too: an unfinished thought has no final
    answer. `thinking_open`: the text continues a `<think>` its prompt opened (the
    Qwen3-Thinking-2507 template), so without a `</think>` all of it is thought and
    nothing is visible. Whitespace is kept as is.
    """
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
    """Content of the last complete `\\boxed{...}` / `\\fbox{...}` in `text`, or None.

    Braces nest; escaped braces (`\\{`, `\\}`) do not count. "Last" is the box that
    closes last, so in `\\boxed{a \\boxed{b}}` it is the outer one. A box that never
    closes is ignored. The content is returned unstripped.
    """
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
