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
_FINDING = re.compile(r"^\* (.+ = -?\d+): Critical Error, it is (-?\d+)$", re.MULTILINE)
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
    """(left side, claimed result, rest) of every step line of a solution."""
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


def test_correct_solutions_recompute_step_by_step():
    for p in PROBLEMS:
        text = traces.solution_text(traces.solve(traces.parse_problem(p["problem"])))
        steps = claims(text)
        for left, result, rest in steps:
            assert value(left) == int(result), text
            # What remains still has the problem's value.
            assert value(rest if rest is not None else result) == int(p["answer"]), text
        assert steps[-1][2] is None and extract_answer(text) == p["answer"]


def test_flawed_solutions_have_exactly_one_wrong_step_and_a_wrong_answer():
    rng = random.Random(0)
    for p in PROBLEMS:
        steps = traces.flawed_steps(traces.parse_problem(p["problem"]), rng)
        text = traces.solution_text(steps)
        wrong = [i for i, (left, result, _) in enumerate(claims(text)) if value(left) != int(result)]
        assert len(wrong) == 1, text
        assert extract_answer(text) != p["answer"]


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
                solver_flawed += extract_answer(ex.response) != str(gold)
            elif ex.role == "verifier":
                judged = ex.messages[1]["content"].split("## Solution\n")[1].split("\n\n## ")[0]
                is_right = extract_answer(judged) == str(gold)
                assert parse_verdict(ex.response) is is_right, (judged, ex.response)
                # Thinking computes every claimed operation, then copies its claim and marks it.
                thought = ex.response.split("<think>\n")[1].split("\n</think>\n")[0]
                for line, (left, result, _) in zip(thought.splitlines(), claims(judged),
                                                   strict=True):
                    mark = "ok" if value(left) == int(result) else "bad"
                    assert line == f"{left} -> {value(left)}, says {result} {mark}", (judged, line)
                verifier_wrong += not is_right
                if not is_right:  # the finding names the first false step and its true result
                    first = next(f"{left} = {result}" for left, result, _ in claims(judged)
                                 if value(left) != int(result))
                    location, fix = _FINDING.search(ex.response).groups()
                    assert location == first and int(fix) == value(first.split(" = ")[0])
            else:
                previous, report = ex.messages[1]["content"], ex.messages[2]["content"]
                assert extract_answer(previous) != str(gold)
                assert _FINDING.search(report) and "Correctness" not in report
                assert extract_answer(ex.response) == str(gold)
    n = len(PROBLEMS)
    assert roles == {"solver": n, "verifier": n, "corrector": n}
    # Controlled rates, within 4 standard deviations of a binomial.
    assert abs(solver_flawed / n - 0.3) < 4 * (0.3 * 0.7 / n) ** 0.5
    assert abs(verifier_wrong / n - 0.5) < 4 * (0.25 / n) ** 0.5


def test_negative_intermediate_values_are_parenthesised():
    steps = traces.solve(traces.parse_problem("What is 2 * (3 - 10) - 1?"))
    assert [s.line for s in steps] == ["3 - 10 = -7: 2 * (-7) - 1", "2 * (-7) = -14: (-14) - 1",
                                       "(-14) - 1 = -15"]
