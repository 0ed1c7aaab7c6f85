"""The `arith` task: answers recomputed independently, determinism, knobs, splits."""

import ast
import re

import pytest

from mars_jax.data import arith, datasets

_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b}


def _independent_value(expression: str) -> int:
    """Evaluate + - * over integer literals by walking Python's own parse tree."""

    def walk(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        raise AssertionError(f"unexpected syntax in {expression!r}: {ast.dump(node)}")

    return walk(ast.parse(expression, mode="eval").body)


def _expression(problem: str) -> str:
    match = re.fullmatch(r"What is (.+)\?", problem)
    assert match, problem
    return match.group(1)


@pytest.mark.parametrize("split", ["train", "test"])
def test_answers_recomputed(split):
    problems = datasets.load("arith", split)
    assert len(problems) == arith.SPLITS[split][1]
    for problem in problems:
        assert problem["answer"] == str(_independent_value(_expression(problem["problem"])))


def test_small_alphabet_and_knobs():
    problems = arith.generate_problems(300, seed=7, num_ops=(2, 4), max_operand=9, operators="+*")
    for problem in problems:
        expression = _expression(problem["problem"])
        assert set(expression) <= set("0123456789+* ()")
        operands = [int(n) for n in re.findall(r"\d+", expression)]
        assert max(operands) <= 9
        assert 2 <= problem["num_ops"] == len(re.findall(r"[+*]", expression)) <= 4
        assert int(problem["answer"]) >= 0
    assert set(arith.load_split("train")[0]) == {"id", "problem", "answer", "num_ops"}


def test_deterministic_and_distinct():
    first = arith.generate_problems(200, seed=3)
    assert first == arith.generate_problems(200, seed=3)
    assert first != arith.generate_problems(200, seed=4)
    assert len({p["problem"] for p in first}) == 200
    assert len({p["id"] for p in first}) == 200


def test_precedence_parentheses():
    # Minimal parentheses must still encode the tree: check values where they matter.
    problems = arith.generate_problems(2000, seed=11, num_ops=3, max_operand=9)
    with_parens = [p for p in problems if "(" in p["problem"]]
    assert with_parens, "some trees need parentheses"
    for problem in with_parens:
        assert problem["answer"] == str(_independent_value(_expression(problem["problem"])))


def test_train_and_test_are_disjoint():
    train = {p["problem"] for p in arith.load_split("train")}
    test = {p["problem"] for p in arith.load_split("test")}
    assert not train & test


def test_bad_knobs():
    with pytest.raises(ValueError, match="num_ops"):
        arith.generate_problems(1, seed=0, num_ops=0)
    with pytest.raises(ValueError, match="operators"):
        arith.generate_problems(1, seed=0, operators="/")
    with pytest.raises(ValueError, match="distinct problems"):
        arith.generate_problems(500, seed=0, num_ops=1, max_operand=2, operators="+")
    with pytest.raises(ValueError, match=r"num_ops: an int or a \(low, high\) pair"):
        arith.generate_problems(1, seed=0, num_ops=(1,))
    with pytest.raises(ValueError, match=r"sizes: a \(train, test\) pair"):
        arith.load_split("test", sizes=(90,))


def test_split_difficulty_from_config():
    """`data.arith` knobs reach the split through `builders.load_problems`; splits stay disjoint."""
    from ml_collections import ConfigDict

    from mars_jax import builders

    data = ConfigDict(dict(name="arith", split="train", arith=dict(num_ops=(1, 2), max_operand=12)))
    train, test = builders.load_problems(data), builders.load_problems(data, "test")
    assert (len(train), len(test)) == (arith.SPLITS["train"][1], arith.SPLITS["test"][1])
    assert not {p["problem"] for p in train} & {p["problem"] for p in test}
    for problem in list(train[:500]) + list(test):
        expression = _expression(problem["problem"])
        assert max(int(n) for n in re.findall(r"\d+", expression)) <= 12
        assert 1 <= len(re.findall(r"[-+*]", expression)) <= 2
        assert problem["answer"] == str(_independent_value(expression))
    with pytest.raises(ValueError, match="max_operands"):
        arith.load_split("test", max_operands=3)


def test_split_sizes_knob_covers_a_small_problem_space():
    """The 100 one-digit additions split 90 / 10, disjoint: together, all of them."""
    knobs = dict(num_ops=1, max_operand=9, operators="+", sizes=(90, 10))
    train, test = arith.load_split("train", **knobs), arith.load_split("test", **knobs)
    assert (len(train), len(test)) == (90, 10)
    every = {f"What is {a} + {b}?" for a in range(10) for b in range(10)}
    assert {p["problem"] for p in train} | {p["problem"] for p in test} == every
    assert not {p["problem"] for p in train} & {p["problem"] for p in test}
    with pytest.raises(ValueError, match="distinct problems"):
        arith.load_split("train", **{**knobs, "sizes": (91, 10)})
