"""Hostile grader inputs: each call returns False, none hangs (the pool's deadline is 1 s; the
checks allow HANG_GUARD_S, so a loaded machine does not fail them), and no model text runs."""

import os
import signal
import time

import pytest

from mars_jax.rewards import grader
from mars_jax.rewards.pool import GraderPool

BOUND_S = 1.0
HANG_GUARD_S = 15.0  # far above the deadline, far below what an unbounded evaluation takes

HOSTILE = {
    "power tower": "9^{9^{9^{9}}}",
    "power tower, no braces": "9^9^9^9",
    "python power tower": "9**9**9**9",
    "huge power": "99999999999^{99999999999}",
    "nested huge power": "(10^{5000})^{5000}",
    "division by zero": "\\frac{1}{0}",
    "100k characters": "1+" * 50_000 + "1",
    "100k letters": "x" * 100_000,
    "5000 nested braces": "{" * 5000 + "1" + "}" * 5000,
    "huge factorial": "100000!",
    "long sum": "1+" * 3000 + "1",
}


@pytest.fixture(scope="module", autouse=True)
def workers_up():
    grader.warm_up()


def _timed(fn, *args):
    start = time.perf_counter()
    value = fn(*args)
    return value, time.perf_counter() - start


@pytest.mark.parametrize("text", HOSTILE.values(), ids=HOSTILE.keys())
def test_hostile_answer_is_false_within_bound(text):
    for value, elapsed in (
        _timed(grader.is_equivalent, text, "1"),
        _timed(grader.is_equivalent, "1", text),
        _timed(grader.grade, f"<think>...</think> The answer is \\boxed{{{text}}}.", "1"),
    ):
        assert value is False
        assert elapsed <= HANG_GUARD_S, f"took {elapsed:.2f} s"


@pytest.mark.parametrize(
    "response, expected",
    [
        ("reasoning " * 10_000 + "\\boxed{5}", True),
        ("{" * 5000 + "}" * 5000 + " so \\boxed{5}", True),
        ("\\boxed{" * 5000 + "5" + "}" * 5000, False),  # the answer itself nests 4999 boxes
    ],
    ids=["100k-character response", "5000 nested braces before the box", "5000 nested boxes"],
)
def test_long_responses_are_graded_within_bound(response, expected):
    value, elapsed = _timed(grader.grade, response, "5")
    assert value is expected
    assert elapsed <= HANG_GUARD_S


def test_hostile_batch_is_bounded_per_item():
    responses = [f"\\boxed{{{text}}}" for text in HOSTILE.values()] + ["\\boxed{\\frac{1}{2}}"]
    golds = ["1"] * len(HOSTILE) + ["0.5"]
    results, elapsed = _timed(grader.grade_many, responses, golds)
    assert results == [False] * len(HOSTILE) + [True]
    assert elapsed <= HANG_GUARD_S


def test_model_text_is_never_executed(tmp_path):
    marker = tmp_path / "pwned"
    payloads = [
        f"__import__('os').system('touch {marker}')",
        f"eval(\"__import__('os').system('touch {marker}')\")",
        f"exec(\"import os; os.system('touch {marker}')\")",
        f"(lambda: __import__('os').system('touch {marker}'))()",
        f"1 + __import__('os').system('touch {marker}')",
    ]
    for payload in payloads:
        for text in (payload, f"${payload}$", f"The answer is {payload}."):
            assert grader.is_equivalent(text, "0") is False
            assert grader.is_equivalent("0", text) is False
            assert grader.grade(f"\\boxed{{{text}}}", "0") is False
    assert not marker.exists()


def test_stuck_worker_is_killed_at_the_deadline_and_replaced():
    """A worker that never answers (here: stopped) is killed; the call returns False in time."""
    pool = GraderPool(1)
    try:
        pool.wait_ready()
        os.kill(pool.pids[0], signal.SIGSTOP)
        results, elapsed = _timed(pool.map, [("1", "1")], BOUND_S)
        assert results == [False]
        assert elapsed <= HANG_GUARD_S  # a stopped worker never answers: only the kill returns
        assert pool.stats["killed"] == 1
        assert pool.map([("\\frac{2}{4}", "0.5")], BOUND_S) == [True]  # a fresh worker took over
    finally:
        pool.close()


def _wait_until_dead(pid: int, timeout: float = 30.0) -> None:
    """Until `pid` has exited (a zombie until the pool reaps it)."""
    deadline = time.monotonic() + timeout
    while open(f"/proc/{pid}/stat").read().split(")")[-1].split()[0] != "Z":
        assert time.monotonic() < deadline, f"worker {pid} still alive"
        time.sleep(0.01)


def test_a_crashed_worker_is_replaced_and_its_comparison_counts_false():
    pool = GraderPool(1)
    try:
        pool.wait_ready()
        [dead] = pool.pids
        os.kill(dead, signal.SIGKILL)
        _wait_until_dead(dead)
        # One worker: the first pair goes to the dead one (False, counted as crashed); its
        # replacement starts and answers the second.
        assert pool.map([("\\frac{1}{2}", "0.5"), ("\\frac{2}{4}", "0.5")], BOUND_S) == [False, True]
        assert pool.stats["crashed"] == 1 and pool.stats["killed"] == 0
        [fresh] = pool.pids
        assert fresh != dead
        assert pool.map([("\\frac{1}{2}", "0.5"), ("x+1", "1+x")], BOUND_S) == [True, True]
        assert pool.pids == [fresh] and pool.stats["crashed"] == 1
    finally:
        pool.close()


def test_slow_comparison_times_out_in_the_worker():
    """Alarm path: sympy runs past the soft limit and the worker itself answers False."""
    before = grader.worker_stats().get("timeout", 0)
    value, elapsed = _timed(grader.is_equivalent, "\\left(9^{999}\\right)^{999999}", "1")
    assert value is False
    assert elapsed <= HANG_GUARD_S
    assert grader.worker_stats().get("timeout", 0) == before + 1
