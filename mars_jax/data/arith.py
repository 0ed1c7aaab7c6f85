"""`arith`: seeded multi-step integer arithmetic problems with exact answers.

Like `What is 7 + 3 * (12 - 5)?`, small enough for a tiny model; answers are evaluated on the
expression tree, never from text.
"""

from __future__ import annotations

import random
from collections.abc import Mapping

PRECEDENCE = {"+": 1, "-": 1, "*": 2}
APPLY = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}

# split -> (seed, number of problems); train never repeats a test problem.
SPLITS: Mapping[str, tuple[int, int]] = {"train": (1, 20_000), "test": (2, 500)}

Node = int | tuple[str, "Node", "Node"]


def _tree(rng: random.Random, num_ops: int, max_operand: int, operators: str) -> Node:
    if num_ops == 0:
        return rng.randint(0, max_operand)
    left_ops = rng.randint(0, num_ops - 1)
    return (
        rng.choice(operators),
        _tree(rng, left_ops, max_operand, operators),
        _tree(rng, num_ops - 1 - left_ops, max_operand, operators),
    )


def evaluate(node: Node) -> int:
    """The exact integer value of expression tree `node`."""
    if isinstance(node, int):
        return node
    op, left, right = node
    return APPLY[op](evaluate(left), evaluate(right))


def render(node: Node) -> str:
    """`node` with only the parentheses precedence needs; negative numbers as `(-7)` unless alone."""
    return str(node) if isinstance(node, int) else _render(node)


def _render(node: Node) -> str:
    if isinstance(node, int):
        return str(node) if node >= 0 else f"({node})"
    op, left, right = node
    left_text, right_text = _render(left), _render(right)
    if isinstance(left, tuple) and PRECEDENCE[left[0]] < PRECEDENCE[op]:
        left_text = f"({left_text})"
    if isinstance(right, tuple) and PRECEDENCE[right[0]] < PRECEDENCE[op] + (op == "-"):
        right_text = f"({right_text})"
    return f"{left_text} {op} {right_text}"


def generate_problems(
    num: int,
    seed: int,
    *,
    num_ops: int | tuple[int, int] = (1, 3),
    max_operand: int = 20,
    operators: str = "+-*",
    id_prefix: str | None = None,
    exclude: frozenset[str] = frozenset(),
) -> list[dict]:
    """`num` distinct problems, each {`id`, `problem`, `answer`, `num_ops`}, deterministic in the
    arguments, avoiding `exclude`; ValueError if the knobs allow fewer."""
    if not isinstance(num_ops, int) and len(num_ops) != 2:
        raise ValueError(f"num_ops: an int or a (low, high) pair, got {num_ops!r}")
    low, high = (num_ops, num_ops) if isinstance(num_ops, int) else num_ops
    if not 1 <= low <= high:
        raise ValueError(f"num_ops must be >= 1 (a range low <= high), got {num_ops}")
    if max_operand < 0 or not operators or set(operators) - set(PRECEDENCE):
        raise ValueError(f"need max_operand >= 0 and operators from '+-*', got {max_operand}, {operators!r}")
    prefix = id_prefix if id_prefix is not None else f"arith-s{seed}"
    rng = random.Random(seed)
    problems: list[dict] = []
    seen = set(exclude)
    attempts = 0
    while len(problems) < num:
        attempts += 1
        if attempts > 50 * num + 1000:
            raise ValueError(f"only {len(problems)} distinct problems found for these knobs, {num} asked")
        ops = rng.randint(low, high)
        tree = _tree(rng, ops, max_operand, operators)
        text = f"What is {render(tree)}?"
        if text in seen:
            continue
        seen.add(text)
        problems.append(
            {"id": f"{prefix}-{len(problems):05d}", "problem": text, "answer": str(evaluate(tree)), "num_ops": ops}
        )
    return problems


def load_split(split: str, *, sizes: tuple[int, int] | None = None, **knobs) -> list[dict]:
    """The fixed `arith` split (`SPLITS`): fixed seed, train disjoint from test drawn with the
    same `sizes` and `knobs`."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r} of 'arith'; valid splits: {', '.join(SPLITS)}")
    unknown = set(knobs) - {"num_ops", "max_operand", "operators"}
    if unknown:
        raise ValueError(f"unknown arith knob(s) {sorted(unknown)}; valid: num_ops, max_operand, "
                         "operators, sizes")
    if sizes is not None and (len(sizes) != len(SPLITS) or min(sizes) < 0):
        raise ValueError(f"sizes: a ({', '.join(SPLITS)}) pair of counts >= 0, got {sizes!r}")
    size = dict(zip(SPLITS, sizes)) if sizes is not None else {k: n for k, (_, n) in SPLITS.items()}
    seed, num = SPLITS[split][0], size[split]
    exclude: frozenset[str] = frozenset()
    if split == "train":
        test_seed = SPLITS["test"][0]
        exclude = frozenset(p["problem"] for p in generate_problems(size["test"], test_seed, **knobs))
    return generate_problems(num, seed, id_prefix=f"arith-{split}", exclude=exclude, **knobs)
