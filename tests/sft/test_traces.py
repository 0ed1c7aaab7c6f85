"""Generated role traces are right, checked by recomputing every claim from the text alone."""
import ast
import operator
import random
import re

import pytest

from mars_jax.agents import prompts
from mars_jax.data import arith
from mars_jax.rewards.agent_rewards import parse_verdict
from mars_jax.rewards.grader import extract_answer
from mars_jax.sft import traces

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
_CLAIM = re.compile(r"^(.+) = (-?\d+)(?:: (.+))?$")
_CHECK = re.compile(r"^(.+) -> (-?\d+)(?:: (.+))?$")
_FINDING = re.compile(r"^\* (.+ = -?\d+): Critical Error, off by (\d) mod 10$", re.MULTILINE)
_NUMBER = re.compile(r"\d+")
PROBLEMS = arith.load_split("test") + arith.load_split("train")[:1500]


def value(expression: str) -> int:
    """Evaluates integer arithmetic text with Python's own parser (independent of `traces`)."""
    def walk(node):
        if isinstance(node, ast.BinOp):
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -walk(node.operand)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        raise ValueError(f"unexpected {ast.dump(node)}")
    return walk(ast.parse(expression, mode="eval").body)


def claims(solution: str) -> list[tuple[str, int, str | None]]:
    """(left side, claimed result, rest) of every line of a solution before its boxed answer."""
    lines = solution.splitlines()
    assert lines[-1].startswith("\\boxed{")
    return [_CLAIM.fullmatch(line).groups() for line in lines[:-1]]


def problem_value(problem: str) -> int:
    return value(problem.removeprefix("What is ").removesuffix("?"))


def test_parse_and_render_round_trip_and_agree_with_the_gold_answer():
    for p in PROBLEMS:
        expr = traces.parse_problem(p["problem"])
        assert traces.render(expr) == p["problem"].removeprefix("What is ").removesuffix("?")
        assert traces.evaluate(expr) == int(p["answer"]) == problem_value(p["problem"])


def split_reply(reply: str) -> tuple[list[str], str]:
    """The thinking lines (none without thinking) and what follows the thinking."""
    if not reply.startswith("<think>\n"):
        return [], reply
    thought, after = reply.removeprefix("<think>\n").split("\n</think>\n")
    return thought.splitlines(), after


def steps_of(lines: list[str]) -> list[tuple[str, int, str | None]]:
    """(operation, result, rest) of each `a op b -> c: rest` thinking line."""
    return [(m[1], int(m[2]), m[3]) for m in map(_CHECK.fullmatch, lines)]


def test_solver_replies_think_step_by_step_and_flawed_ones_slip_once():
    rng = random.Random(0)
    for p in PROBLEMS:
        expr = traces.parse_problem(p["problem"])
        gold = int(p["answer"])
        for steps, is_right in ((traces.solve(expr), True), (traces.flawed_steps(expr, rng), False)):
            lines, solution = split_reply(traces.answer_text(expr, steps))
            thought = steps_of(lines)
            (left, claimed, rest), = claims(solution)
            assert left == p["problem"].removeprefix("What is ").removesuffix("?") and rest is None
            assert int(claimed) == int(extract_answer(solution)) and (int(claimed) == gold) is is_right
            # A slip always reaches the units digit, as the Verifier's check needs.
            assert (int(claimed) % 10 == gold % 10) is is_right
            if p["num_ops"] == 1:
                assert not thought
                continue
            assert len(thought) == p["num_ops"] and thought[-1][1] == int(claimed)
            slipped = [i for i, (operation, result, _) in enumerate(thought)
                       if value(operation) != result]
            assert all(abs(value(thought[i][0]) - thought[i][1]) <= 2 for i in slipped)
            assert len(slipped) == (0 if is_right else 1), thought
            # What remains after a step has the problem's value before the slip, the claim's after.
            first_slip = slipped[0] if slipped else len(thought)
            for i, (_, _, rest) in enumerate(thought[:-1]):
                assert value(rest) == (gold if i < first_slip else int(claimed)), thought


@pytest.mark.parametrize("seed", [0, 1])
def test_examples_verdicts_findings_and_fixes_are_right(seed):
    rng = random.Random(seed)
    roles = {"solver": 0, "verifier": 0, "corrector": 0}
    solver_flawed = verifier_wrong = 0
    for p in PROBLEMS:
        gold = problem_value(p["problem"])
        for ex in traces.make_examples(p["problem"], rng, solver_error_rate=0.3,
                                       verifier_flawed_rate=0.5):
            roles[ex.role] += 1
            if ex.role == "solver":
                assert ex.messages == prompts.solver_messages(p["problem"], "compact")
                solver_flawed += extract_answer(split_reply(ex.response)[1]) != str(gold)
            elif ex.role == "verifier":
                judged = ex.messages[1]["content"].split("## Solution\n")[1].split("\n\n## ")[0]
                (left, claimed, _), = claims(judged)
                is_right = int(claimed) == gold
                assert parse_verdict(ex.response) is is_right, (judged, ex.response)
                # Thinking casts out tens: the claim's units digit, subtracted from the problem's
                # numbers modulo 10, reduced one true operation modulo 10 a line, each rest keeping
                # the value (problem - claim) modulo 10; the last line is marked by whether it is 0.
                lines, _ = split_reply(ex.response)
                says, header, *reduction = lines
                digit, difference = int(claimed) % 10, (gold - int(claimed)) % 10
                assert says == f"says {claimed} -> {digit}"
                assert header == "mod 10: " + _NUMBER.sub(lambda m: str(int(m[0]) % 10), left) + \
                    f" - {digit}"
                reduction[-1], mark = reduction[-1].rsplit(" ", 1)
                assert mark == ("ok" if is_right else "bad")
                steps = steps_of(reduction)
                for operation, result, rest in steps:
                    assert value(operation) % 10 == result, lines
                    remaining = rest if rest is not None else str(result)
                    assert value(remaining) % 10 == difference, lines
                assert steps[-1][2] is None and len(steps) == p["num_ops"] + 1
                verifier_wrong += not is_right
                if not is_right:  # the finding names the claim and how far off its units digit is
                    location, off_by = _FINDING.search(ex.response).groups()
                    assert location == f"{left} = {claimed}" and int(off_by) == difference
            else:
                previous, report = ex.messages[1]["content"], ex.messages[2]["content"]
                assert extract_answer(previous) != str(gold)
                assert _FINDING.search(report) and "Correctness" not in report
                lines, solution = split_reply(ex.response)
                assert extract_answer(solution) == str(gold)
                assert all(value(operation) == result for operation, result, _ in steps_of(lines))
    n = len(PROBLEMS)
    assert roles == {"solver": n, "verifier": n, "corrector": n}
    # Controlled rates, within 4 standard deviations of a binomial.
    assert abs(solver_flawed / n - 0.3) < 4 * (0.3 * 0.7 / n) ** 0.5
    assert abs(verifier_wrong / n - 0.5) < 4 * (0.25 / n) ** 0.5


def test_negative_intermediate_values_are_parenthesised():
    steps = traces.solve(traces.parse_problem("What is 2 * (3 - 10) - 1?"))
    assert [s.line for s in steps] == ["3 - 10 -> -7: 2 * (-7) - 1",
                                             "2 * (-7) -> -14: (-14) - 1", "(-14) - 1 -> -15"]


def test_the_verifier_casts_out_tens_on_a_hand_checked_example():
    expr = traces.parse_problem("What is 2 * (3 - 10) - 1?")  # -15
    assert traces.verifier_text(expr, -17) == (
        "<think>\nsays -17 -> 3\nmod 10: 2 * (3 - 0) - 1 - 3\n3 - 0 -> 3: 2 * 3 - 1 - 3\n"
        "2 * 3 -> 6: 6 - 1 - 3\n6 - 1 -> 5: 5 - 3\n5 - 3 -> 2 bad\n</think>\n"
        "**Final Verdict:** Critical Error.\n**List of Findings:**\n"
        "* 2 * (3 - 10) - 1 = -17: Critical Error, off by 2 mod 10\n**Correctness:** Wrong")
    # A tens error passes the check.
    assert "\n6 - 1 -> 5: 5 - 5\n5 - 5 -> 0 ok\n" in traces.verifier_text(expr, -25)
