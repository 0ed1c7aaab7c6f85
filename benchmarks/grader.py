"""Grader throughput: `grade_many` on 10,000 (response, gold) pairs from MATH-500 answers.

Half the responses box an equivalent rewrite of the gold answer (dfrac, spacing,
`\\left(`, decimals, `\\text{}` wrappers, integer fractions...), half a wrong answer
(a digit changed, or another problem's answer). Each response has a short
`<think>...</think>` part and a sentence around the box, as a policy would write.

Usage: python benchmarks/grader.py [--pairs 10000] [--repeats 3] [--num-workers N]
Prints, per repeat, wall time and responses/s, and the CPU seconds the parent and the
workers used (on a shared machine the wall figure depends on the other load; the CPU
figure gives the rate the same work reaches on idle cores). Then the medians, and how
often the grader agrees with the way each pair was built.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import statistics
import time
from collections.abc import Callable

import psutil

from mars_jax.data.paths import default_manual_dir
from mars_jax.rewards import grader


def _dfrac(answer: str) -> str | None:
    return answer.replace("\\frac", "\\dfrac") if "\\frac" in answer else None


def _spaces(answer: str) -> str | None:
    spaced = re.sub(r"\s*([+=-]|,(?!\\!))\s*", r" \1 ", answer).strip()
    return spaced if spaced != answer else None


def _left_right(answer: str) -> str | None:
    if answer.startswith("(") and answer.endswith(")") and "\\cup" not in answer:
        return f"\\left({answer[1:-1]}\\right)"
    return None


def _integer_forms(answer: str) -> str | None:
    if not re.fullmatch(r"-?\d+", answer):
        return None
    value = int(answer)
    return random.choice([f"{value}.0", f"\\frac{{{2 * value}}}{{2}}", f"{value}\\text{{ }}", f"0{answer}"])


def _fraction_as_slash(answer: str) -> str | None:
    match = re.fullmatch(r"(-?)\\frac\{(\d+)\}\{(\d+)\}", answer)
    return f"{match.group(1)}{match.group(2)}/{match.group(3)}" if match else None


EQUIVALENT: list[Callable[[str], str | None]] = [_dfrac, _spaces, _left_right, _integer_forms, _fraction_as_slash]


def _equivalent_rewrite(answer: str) -> str:
    options = [form for rewrite in EQUIVALENT if (form := rewrite(answer)) is not None]
    return random.choice(options) if options else answer


def _wrong(answer: str, answers: list[str]) -> str:
    digits = [i for i, char in enumerate(answer) if char.isdigit()]
    if digits and "\\mbox" not in answer and "\\text" not in answer and random.random() < 0.7:
        i = random.choice(digits)
        return answer[:i] + str((int(answer[i]) + random.randint(1, 9)) % 10) + answer[i + 1 :]
    other = random.choice(answers)
    return other if other != answer else answer + "+1"


def build_pairs(num_pairs: int, seed: int = 0) -> tuple[list[str], list[str], list[bool]]:
    """(responses, golds, built_equivalent) from the MATH-500 answers."""
    random.seed(seed)
    path = os.path.join(default_manual_dir(), "math500.jsonl")
    with open(path, encoding="utf-8") as f:
        answers = [json.loads(line)["answer"] for line in f]
    responses, golds, labels = [], [], []
    for i in range(num_pairs):
        gold = answers[i % len(answers)]
        equivalent = i % 2 == 0
        boxed = _equivalent_rewrite(gold) if equivalent else _wrong(gold, answers)
        responses.append(
            f"<think>\nLet me work through problem {i} step by step.\n</think>\n\n"
            f"Putting the pieces together, the answer is $\\boxed{{{boxed}}}$."
        )
        golds.append(gold)
        labels.append(equivalent)
    return responses, golds, labels


def _cpu_seconds() -> float:
    """CPU time of this process, its reaped children (replaced workers) and live workers."""
    total = sum(psutil.Process().cpu_times()[:4])
    for pid in grader.worker_pids():
        with contextlib.suppress(psutil.NoSuchProcess):  # replaced meanwhile: counted as reaped
            total += sum(psutil.Process(pid).cpu_times()[:2])
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-workers", type=int, default=None)
    args = parser.parse_args()

    responses, golds, labels = build_pairs(args.pairs)
    grader.warm_up(args.num_workers)
    workers = args.num_workers or grader.default_num_workers()
    rates, cpu_rates = [], []
    for repeat in range(args.repeats):
        cpu_before = _cpu_seconds()
        start = time.perf_counter()
        results = grader.grade_many(responses, golds, num_workers=args.num_workers)
        elapsed = time.perf_counter() - start
        cpu = _cpu_seconds() - cpu_before
        rates.append(len(responses) / elapsed)
        cpu_rates.append(len(responses) * min(workers, os.cpu_count()) / cpu)
        print(f"repeat {repeat}: {elapsed:.2f} s wall, {rates[-1]:.0f} responses/s; "
              f"{cpu:.1f} CPU s -> {cpu_rates[-1]:.0f} responses/s on idle cores")
    agree = sum(result == label for result, label in zip(results, labels))
    print(f"median: {statistics.median(rates):.0f} responses/s wall, "
          f"{statistics.median(cpu_rates):.0f} responses/s from CPU time; "
          f"{workers} worker processes, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    print(f"agreement with construction labels: {agree}/{len(labels)} "
          f"({100 * agree / len(labels):.1f}%)")
    print(f"worker outcomes: {grader.worker_stats()}")


if __name__ == "__main__":
    main()
