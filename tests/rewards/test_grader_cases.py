"""Agreement of our grader with 362 external answer-equivalence cases (shared/data).

The cases come from seven projects' grader test suites (grader_cases_SOURCES.md).
Rows whose source harness is a reward on a whole response (`openr1_accuracy_reward`,
`rllm_reward_math`) go through `grade`; all others compare answers with
`is_equivalent`. Run with `-s` to see the per-source table and the misses.

This measures the equivalence rules, not the time bound (see test_grader_safety.py):
a few cases need up to ~0.5 s of sympy on an idle core, so on a loaded shared machine
the 1 s default would turn them into timeouts. The test therefore allows 5 s per case.
"""

import collections
import json
import os

import pytest

from mars_jax.rewards import grader

RESPONSE_HARNESSES = {"openr1_accuracy_reward", "rllm_reward_math"}
# The cases we disagree with, each read by hand: golds of several boxes or solution sets, which
# we grade by their last box (gc-0177, gc-0262, gc-0263, gc-0264); rounded decimals inside a
# matrix or interval (gc-0127, gc-0133); an inequality for an interval (gc-0179); f(y) for f(x)
# (gc-0245); and two harnesses' own conventions we do not follow: spaces inside math delimiters
# fail (gc-0028, gc-0029), lists are ordered (gc-0321, gc-0327). A new miss, or a new match,
# fails: update this set deliberately.
KNOWN_MISSES = {"gc-0028", "gc-0029", "gc-0127", "gc-0133", "gc-0177", "gc-0179", "gc-0245",
                "gc-0262", "gc-0263", "gc-0264", "gc-0321", "gc-0327"}
TIMEOUT_S = 5.0


@pytest.fixture(scope="module")
def cases(data_mirror) -> list[dict]:
    path = os.path.join(data_mirror, "grader_cases.jsonl")
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _verdicts(cases: list[dict], timeout: float = TIMEOUT_S) -> list[bool]:
    response_rows = [i for i, c in enumerate(cases) if c["harness"] in RESPONSE_HARNESSES]
    answer_rows = [i for i, c in enumerate(cases) if c["harness"] not in RESPONSE_HARNESSES]
    verdicts = [False] * len(cases)
    graded = grader.grade_many(
        [cases[i]["pred"] for i in response_rows], [cases[i]["gold"] for i in response_rows], timeout=timeout
    )
    compared = grader.is_equivalent_many(
        [cases[i]["pred"] for i in answer_rows], [cases[i]["gold"] for i in answer_rows], timeout=timeout
    )
    for rows, values in ((response_rows, graded), (answer_rows, compared)):
        for i, value in zip(rows, values):
            verdicts[i] = value
    return verdicts


def test_agreement_with_external_cases(cases):
    assert len(cases) == 362
    grader.warm_up()
    verdicts = _verdicts(cases)
    # A comparison that timed out reads as a miss; under a loaded test run (two xdist workers
    # compiling beside it) one of ~0.5 s can pass 5 s. New misses are graded once more with
    # 60 s each: what still disagrees is a rule, not the machine.
    new = [i for i, (case, verdict) in enumerate(zip(cases, verdicts))
           if verdict != case["expected"] and case["id"] not in KNOWN_MISSES]
    for i, verdict in zip(new, _verdicts([cases[i] for i in new], timeout=60.0)):
        verdicts[i] = verdict
    total, agree = collections.Counter(), collections.Counter()
    misses, missed = [], set()
    for case, verdict in zip(cases, verdicts):
        source = case["source"].split("@")[0]
        total[source] += 1
        if verdict == case["expected"]:
            agree[source] += 1
        else:
            missed.add(case["id"])
            misses.append(f"{case['id']} expected={case['expected']} [{case['harness']}] "
                          f"gold={case['gold'][:60]!r} pred={case['pred'][-80:]!r}")
    print(f"\n{'source':28s} {'agree':>7s} {'n':>4s}")
    for source in sorted(total):
        print(f"{source:28s} {agree[source]:7d} {total[source]:4d}")
    overall = sum(agree.values()) / len(cases)
    print(f"{'overall':28s} {sum(agree.values()):7d} {len(cases):4d}  ({100 * overall:.1f}%)")
    print("misses:\n  " + "\n  ".join(misses))
    print(f"worker outcomes: {grader.worker_stats()}")
    assert missed == KNOWN_MISSES, (f"new misses {sorted(missed - KNOWN_MISSES)}, new matches "
                                    f"{sorted(KNOWN_MISSES - missed)}")
