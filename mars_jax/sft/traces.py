"""Generated SFT traces for the three MarsRL roles on `arith` problems, in short texts.

Every role thinks in terse steps, one fact a line (`12 - 5 -> 7: 7 + 3`, the last `7 + 3 -> 10`);
thinking is stripped before a reply reaches the next agent, so a solution reaches the Verifier as
one line (`12 - 5 + 3 = 10` and the boxed value). A flawed solution has one step off by 1 or 2,
carried on to a final value with a wrong units digit; the Corrector's reply is the right solution.

The Verifier casts out tens instead of redoing the arithmetic: it reduces the expression minus the
claim's units digit modulo 10 (100 facts an operation instead of one per pair of values), so the
deciding fact is an ordinary reduction line; sound for `+ - *`, it misses only errors that keep the
units digit. Its Wrong reply for `12 - 5 + 3 = 12`:

    <think>
    says 12 -> 2
    mod 10: 2 - 5 + 3 - 2
    2 - 5 -> 7: 7 + 3 - 2
    7 + 3 -> 0: 0 - 2
    0 - 2 -> 8 bad
    </think>
    **Final Verdict:** Critical Error.
    **List of Findings:**
    * 12 - 5 + 3 = 12: Critical Error, off by 8 mod 10
    **Correctness:** Wrong
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
# Result offsets of an injected error, small slips in the units digit as the models' own errors
# are; the Verifier's check works modulo 10.
_SLIPS = (-2, -1, 1, 2)
MODULUS = 10


@dataclasses.dataclass(frozen=True)
class Step:
    """One reduction `left op right -> result` (off when slipped); `rest`: what is left after it."""

    left: int
    op: str
    right: int
    result: int
    rest: Expr

    @property
    def operation(self) -> str:
        return f"{_operand(self.left)} {self.op} {_operand(self.right)}"

    @property
    def line(self) -> str:
        """The thinking line: `12 - 5 -> 7: 7 + 3`, or `7 + 3 -> 10` for the last step."""
        line = f"{self.operation} -> {self.result}"
        return line if isinstance(self.rest, int) else f"{line}: {render(self.rest)}"


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


def solve(expr: Expr, *, slip_at: int | None = None, slip: int = 0,
          modulus: int | None = None) -> list[Step]:
    """The reduction steps of `expr`, leftmost-first; step `slip_at` gets `slip` added (later
    steps carry it on); with `modulus`, every result is taken modulo it (in `[0, modulus)`)."""
    steps: list[Step] = []
    while isinstance(expr, tuple):
        left, op, right = _next_op(expr)
        result = APPLY[op](left, right) + (slip if len(steps) == slip_at else 0)
        if modulus is not None:
            result %= modulus
        expr = _substitute(expr, result)
        steps.append(Step(left, op, right, result, expr))
    return steps


def residues(expr: Expr, modulus: int = MODULUS) -> Expr:
    """`expr` with every number replaced by its residue modulo `modulus`."""
    if isinstance(expr, int):
        return expr % modulus
    op, left, right = expr
    return op, residues(left, modulus), residues(right, modulus)


def flawed_steps(expr: Expr, rng: random.Random) -> list[Step]:
    """Steps with one slipped result that gives the final value a wrong units digit (a random step
    and slip among those that do; a slip in the last step always does)."""
    gold = evaluate(expr) % MODULUS
    options = [(i, s) for i in range(len(solve(expr))) for s in _SLIPS]
    rng.shuffle(options)
    spoiled = (solve(expr, slip_at=i, slip=s) for i, s in options)
    return next(steps for steps in spoiled if steps[-1].result % MODULUS != gold)


def thinking_text(lines: Sequence[str]) -> str:
    """`<think>`, one line each, `</think>`."""
    return f"{THINK_OPEN}\n" + "\n".join(lines) + f"\n{THINK_CLOSE}\n"


def solution_text(expr: Expr, value: int) -> str:
    """A solution as the next agent sees it: the expression and `value` on one line, then boxed."""
    return f"{render(expr)} = {value}\n\\boxed{{{value}}}"


def answer_text(expr: Expr, steps: Sequence[Step]) -> str:
    """The Solver / Corrector reply: thinking through `steps` (if several), then the solution."""
    solution = solution_text(expr, steps[-1].result)
    return solution if len(steps) == 1 else thinking_text([s.line for s in steps]) + solution


def verifier_text(expr: Expr, claimed: int) -> str:
    """The Verifier's reply on a solution claiming `claimed` (module docstring): the last line
    `ok` at 0 else `bad`; the report Correct, or Wrong naming the claim and the difference."""
    says = claimed % MODULUS
    check = ("-", residues(expr), says)
    steps = solve(check, modulus=MODULUS)
    difference = steps[-1].result
    mark = "ok" if difference == 0 else "bad"
    lines = [f"says {claimed} -> {says}", f"mod {MODULUS}: {render(check)}",
             *(s.line for s in steps[:-1]), f"{steps[-1].line} {mark}"]
    thinking = thinking_text(lines)
    if difference == 0:
        report = "**Final Verdict:** Correct.\n**List of Findings:** None\n**Correctness:** Correct"
    else:
        report = ("**Final Verdict:** Critical Error.\n**List of Findings:**\n"
                  f"* {render(expr)} = {claimed}: Critical Error, off by {difference} "
                  f"mod {MODULUS}\n**Correctness:** Wrong")
    return thinking + report


def make_examples(problem: str, rng: random.Random, *, solver_error_rate: float,
                  verifier_flawed_rate: float, style: str = "compact") -> list[Example]:
    """A Solver, a Verifier and a Corrector example for one problem, flawed with probabilities
    `solver_error_rate` (Solver) and `verifier_flawed_rate` (the Verifier's judged solution)."""
    expr = parse_problem(problem)
    good, bad = solve(expr), flawed_steps(expr, rng)
    wrong = bad[-1].result
    solver = bad if rng.random() < solver_error_rate else good
    judged = wrong if rng.random() < verifier_flawed_rate else good[-1].result
    report = prompts.bug_report(verifier_text(expr, wrong))
    return [Example("solver", prompts.solver_messages(problem, style), answer_text(expr, solver)),
            Example("verifier", prompts.verifier_messages(problem, solution_text(expr, judged), style),
                    verifier_text(expr, judged)),
            Example("corrector", prompts.corrector_messages(problem, solution_text(expr, wrong),
                                                            report, style),
                    answer_text(expr, good))]
