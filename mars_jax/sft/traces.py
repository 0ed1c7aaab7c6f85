"""Generated SFT traces for the three MarsRL roles on `arith` problems, in short texts.

A tiny model with the byte-level tokenizer pays one token per character, so every trace is terse.
A solution reduces the expression one operation at a time, each line `a op b = c` followed by
what remains (`: rest`), then the boxed answer:

    12 - 5 = 7: 7 + 3 * 7
    3 * 7 = 21: 7 + 21
    7 + 21 = 28
    \\boxed{28}

A *flawed* solution has one step whose result is off (the error then propagates, so the final
answer is wrong). The Verifier first thinks: for every claimed step it copies the operation,
computes its result itself, then copies the claimed result and marks the line `ok` or `bad`, so
each mark compares two adjacent numbers and the verdict only has to read the marks (checking
stays local: one fact per line, never the whole expression at once). The result it computes
comes before the claimed one and after `->`, not `=`: in these traces `a op b =` may be followed
by a wrong result (a flawed solution), `a op b ->` only by the true one. Its report then names
the first wrong step and its right result; the Corrector rewrites the whole solution correctly.
The Verifier's Wrong reply for the solution above with `3 * 7 = 20` reads

    <think>
    12 - 5 -> 7, says 7 ok
    3 * 7 -> 21, says 20 bad
    7 + 20 -> 27, says 27 ok
    </think>
    **Final Verdict:** Critical Error.
    **List of Findings:**
    * 3 * 7 = 20: Critical Error, it is 21
    **Correctness:** Wrong

Operations are reduced leftmost-first among those whose operands are both numbers; negative
numbers are written `(-7)` inside expressions.
"""
from __future__ import annotations

import dataclasses
import random
import re
from collections.abc import Sequence

from mars_jax.agents import prompts
from mars_jax.data.arith import APPLY, PRECEDENCE, evaluate, render
from mars_jax.rewards.text import THINK_CLOSE, THINK_OPEN

Expr = int | tuple[str, "Expr", "Expr"]

_TOKEN = re.compile(r"\s*(\d+|[-+*()])")
# Result offsets of an injected error: small slips and a wrong tens digit.
_SLIPS = (-10, -2, -1, 1, 2, 10)


@dataclasses.dataclass(frozen=True)
class Step:
    """One reduction `left op right = result`; `rest` is the expression left afterwards."""

    left: int
    op: str
    right: int
    result: int
    rest: Expr

    @property
    def operation(self) -> str:
        return f"{_operand(self.left)} {self.op} {_operand(self.right)}"

    @property
    def true_result(self) -> int:
        return APPLY[self.op](self.left, self.right)

    @property
    def claim(self) -> str:
        return f"{self.operation} = {self.result}"

    @property
    def line(self) -> str:
        return self.claim if isinstance(self.rest, int) else f"{self.claim}: {render(self.rest)}"

    @property
    def is_right(self) -> bool:
        return self.true_result == self.result


@dataclasses.dataclass(frozen=True)
class Example:
    """One SFT example: the role's chat messages and the assistant's reply."""

    role: str
    messages: tuple[dict[str, str], ...]
    response: str


def parse_problem(text: str) -> Expr:
    """The expression of `What is <expr>?` (standard precedence, left-associative)."""
    body = text.strip().removeprefix("What is").removesuffix("?")
    tokens = _TOKEN.findall(body)
    if "".join(tokens) != re.sub(r"\s+", "", body):
        raise ValueError(f"not an arith problem: {text!r}")
    expr, end = _parse(tokens, 0, 1)
    if end != len(tokens):
        raise ValueError(f"trailing tokens in {text!r}")
    return expr


def _parse(tokens: list[str], i: int, min_precedence: int) -> tuple[Expr, int]:
    if tokens[i] == "(":
        left, i = _parse(tokens, i + 1, 1)
        i += 1  # ")"
    else:
        left, i = int(tokens[i]), i + 1
    while i < len(tokens) and tokens[i] in PRECEDENCE and PRECEDENCE[tokens[i]] >= min_precedence:
        op = tokens[i]
        right, i = _parse(tokens, i + 1, PRECEDENCE[op] + 1)
        left = (op, left, right)
    return left, i


def _operand(value: int) -> str:
    """A number as it appears inside an expression: negative ones in parentheses."""
    return str(value) if value >= 0 else f"({value})"


def _next_op(expr: tuple) -> tuple[int, str, int]:
    """The leftmost operation whose operands are both numbers."""
    op, left, right = expr
    if isinstance(left, tuple):
        return _next_op(left)
    if isinstance(right, tuple):
        return _next_op(right)
    return left, op, right


def _substitute(expr: tuple, value: int) -> Expr:
    """`expr` with the operation `_next_op` picks replaced by `value`."""
    op, left, right = expr
    if isinstance(left, tuple):
        return op, _substitute(left, value), right
    if isinstance(right, tuple):
        return op, left, _substitute(right, value)
    return value


def solve(expr: Expr, *, slip_at: int | None = None, slip: int = 0) -> list[Step]:
    """The reduction steps of `expr`; step `slip_at` (if any) gets `slip` added to its result."""
    steps: list[Step] = []
    while isinstance(expr, tuple):
        left, op, right = _next_op(expr)
        result = APPLY[op](left, right) + (slip if len(steps) == slip_at else 0)
        expr = _substitute(expr, result)
        steps.append(Step(left, op, right, result, expr))
    return steps


def flawed_steps(expr: Expr, rng: random.Random) -> list[Step]:
    """Steps with one wrong result that makes the final answer wrong (a random step and slip among
    those that do; a slip in the last step always does)."""
    gold = evaluate(expr)
    options = [(i, s) for i in range(len(solve(expr))) for s in _SLIPS]
    rng.shuffle(options)
    spoiled = (solve(expr, slip_at=i, slip=s) for i, s in options)
    return next(steps for steps in spoiled if steps[-1].result != gold)


def solution_text(steps: Sequence[Step]) -> str:
    """The Solver / Corrector reply: one line per step, then the boxed answer."""
    return "\n".join([*(s.line for s in steps), f"\\boxed{{{steps[-1].result}}}"])


def check_text(steps: Sequence[Step]) -> str:
    """The Verifier's thinking: each claimed step's operation with its true result, then the claimed
    result and the mark (`3 * 7 -> 21, says 20 bad`, `12 - 5 -> 7, says 7 ok`)."""
    lines = [f"{s.operation} -> {s.true_result}, says {s.result} {'ok' if s.is_right else 'bad'}"
             for s in steps]
    return f"{THINK_OPEN}\n" + "\n".join(lines) + f"\n{THINK_CLOSE}\n"


def verifier_text(steps: Sequence[Step]) -> str:
    """The Verifier's reply: the step check (`check_text`), then the three-part report, Wrong
    naming the first wrong step, else Correct."""
    wrong = next((s for s in steps if not s.is_right), None)
    if wrong is None:
        report = "**Final Verdict:** Correct.\n**List of Findings:** None\n**Correctness:** Correct"
    else:
        report = ("**Final Verdict:** Critical Error.\n**List of Findings:**\n"
                  f"* {wrong.claim}: Critical Error, it is {wrong.true_result}\n"
                  "**Correctness:** Wrong")
    return check_text(steps) + report


def make_examples(problem: str, rng: random.Random, *, solver_error_rate: float,
                  verifier_flawed_rate: float, style: str = "compact") -> list[Example]:
    """A Solver, a Verifier and a Corrector example for one problem.

    The Solver's reply is flawed with probability `solver_error_rate`; the Verifier judges a flawed
    solution with probability `verifier_flawed_rate`, else a correct one; the Corrector fixes a
    flawed solution given the right report.
    """
    expr = parse_problem(problem)
    good, bad = solve(expr), flawed_steps(expr, rng)
    good_text, bad_text = solution_text(good), solution_text(bad)
    solver = bad_text if rng.random() < solver_error_rate else good_text
    judged = bad if rng.random() < verifier_flawed_rate else good
    report = prompts.bug_report(verifier_text(bad))
    return [Example("solver", prompts.solver_messages(problem, style), solver),
            Example("verifier", prompts.verifier_messages(problem, solution_text(judged), style),
                    verifier_text(judged)),
            Example("corrector", prompts.corrector_messages(problem, bad_text, report, style),
                    good_text)]
