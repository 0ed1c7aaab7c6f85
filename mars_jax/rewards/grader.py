"""Safe, time-bounded math answer grading: the 0/1 reward of MarsRL's Solver and Corrector.

Model text is never evaluated; costly inputs are turned away (`normalize.cost_reason`) and every
sympy comparison runs in a worker with a hard deadline (`pool.GraderPool`), False on timeout.
"""

from __future__ import annotations

import atexit
import os
import threading
from collections.abc import Sequence

from mars_jax.rewards import normalize
from mars_jax.rewards.pool import GraderPool
from mars_jax.rewards.text import last_boxed, strip_thinking

DEFAULT_TIMEOUT = 1.0  # seconds per comparison

_pool: GraderPool | None = None
_pool_lock = threading.Lock()


def extract_answer(text: str, *, thinking_open: bool = False) -> str | None:
    """The last complete `\\boxed{}` / `\\fbox{}` content outside thinking, stripped, or None."""
    boxed = last_boxed(strip_thinking(text, thinking_open=thinking_open))
    return None if boxed is None else boxed.strip()


def default_num_workers() -> int:
    """One worker per available core, at least 2 (so one can cover while another restarts)."""
    return max(2, len(os.sched_getaffinity(0)))


def _shared_pool(num_workers: int | None = None) -> GraderPool:
    """The process-wide pool, (re)created when missing, closed, forked, or of another size."""
    global _pool
    with _pool_lock:
        stale = _pool is None or not _pool.usable
        if not stale and num_workers is not None and _pool.num_workers != num_workers:
            _pool.close()
            stale = True
        if stale:
            _pool = GraderPool(num_workers or default_num_workers())
        return _pool


def warm_up(num_workers: int | None = None) -> None:
    """Start the grader workers now and wait until they are ready."""
    _shared_pool(num_workers).wait_ready()


def worker_stats() -> dict[str, int]:
    """Outcome counts of the current workers' comparisons, by status."""
    return {} if _pool is None else dict(_pool.stats)


def worker_pids() -> list[int]:
    """Process ids of the current grader workers (for monitoring)."""
    return [] if _pool is None else _pool.pids


def shutdown() -> None:
    """Stop the grader workers (they restart on the next call). Runs at exit."""
    global _pool
    with _pool_lock:
        if _pool is not None and _pool.usable:
            _pool.close()
        _pool = None


atexit.register(shutdown)


def _check_str(name: str, value: object) -> None:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be str, got {type(value).__name__}")


def _equivalent_pairs(pairs: list[tuple[str, str]], timeout: float, num_workers: int | None) -> list[bool]:
    """Quick verdicts here; each distinct remaining pair once, in the worker pool."""
    results: list[bool] = []
    pending: dict[tuple[str, str], list[int]] = {}
    for index, pair in enumerate(pairs):
        quick = normalize.quick_verdict(*pair)
        results.append(bool(quick))
        if quick is None:
            pending.setdefault(pair, []).append(index)
    if pending:
        decided = _shared_pool(num_workers).map(list(pending), timeout)
        for indices, value in zip(pending.values(), decided):
            for index in indices:
                results[index] = value
    return results


def is_equivalent(pred: str, gold: str, *, timeout: float = DEFAULT_TIMEOUT) -> bool:
    """Whether answer `pred` equals reference `gold` (`equivalence.equivalent`, in a worker
    unless `normalize.quick_verdict` decides); empty answers never match; False on timeout."""
    return is_equivalent_many([pred], [gold], timeout=timeout)[0]


def is_equivalent_many(
    preds: Sequence[str],
    golds: Sequence[str],
    num_workers: int | None = None,
    *,
    timeout: float = DEFAULT_TIMEOUT,
) -> list[bool]:
    """`is_equivalent` for each (pred, gold) pair, in parallel (see `grade_many`)."""
    if len(preds) != len(golds):
        raise ValueError(f"{len(preds)} preds but {len(golds)} golds")
    for index, (pred, gold) in enumerate(zip(preds, golds)):
        _check_str(f"preds[{index}]", pred)
        _check_str(f"golds[{index}]", gold)
    return _equivalent_pairs(list(zip(preds, golds)), timeout, num_workers)


def grade(response: str, gold: str, *, timeout: float = DEFAULT_TIMEOUT,
          thinking_open: bool = False) -> bool:
    """Whether `response` boxes an answer equivalent to `gold` outside thinking."""
    return grade_many([response], [gold], timeout=timeout, num_workers=None,
                      thinking_open=thinking_open)[0]


def grade_many(
    responses: Sequence[str],
    golds: Sequence[str],
    num_workers: int | None = None,
    *,
    timeout: float = DEFAULT_TIMEOUT,
    thinking_open: bool = False,
) -> list[bool]:
    """`grade` for each (response, gold) pair on `num_workers` processes (None: the current pool,
    or one per available core), each comparison bounded by `timeout` seconds."""
    if len(responses) != len(golds):
        raise ValueError(f"{len(responses)} responses but {len(golds)} golds")
    pairs: list[tuple[str, str]] = []
    slots: list[int] = []
    for index, (response, gold) in enumerate(zip(responses, golds)):
        _check_str(f"responses[{index}]", response)
        _check_str(f"golds[{index}]", gold)
        answer = extract_answer(response, thinking_open=thinking_open)
        if answer is not None:
            pairs.append((answer, gold))
            slots.append(index)
    results = [False] * len(responses)
    for index, value in zip(slots, _equivalent_pairs(pairs, timeout, num_workers)):
        results[index] = value
    return results
