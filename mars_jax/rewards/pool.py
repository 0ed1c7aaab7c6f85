"""A persistent pool of grader worker processes with a hard time bound per comparison.

Workers run under `subprocess` (safe beside JAX threads); one past its deadline is killed and
replaced, and the pair counts as not equivalent.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
import selectors
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

import mars_jax

SOFT_FRACTION = 0.7  # the worker's alarm, as a fraction of the per-call timeout
HARD_FRACTION = 0.9  # the parent's kill deadline, as a fraction of the per-call timeout
STARTUP_TIMEOUT = 120.0
MAX_FAILED_STARTS = 3

_PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(mars_jax.__file__)))


@dataclasses.dataclass(eq=False)
class _Worker:
    proc: subprocess.Popen
    buffer: bytes = b""
    ready: bool = False
    task: int | None = None  # index in the current batch
    request_id: int = -1
    deadline: float = 0.0


class GraderPool:
    """`num_workers` grader processes; `map` compares (pred, gold) pairs in parallel."""

    def __init__(self, num_workers: int) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.num_workers = num_workers
        self.stats: collections.Counter[str] = collections.Counter()
        self._pid = os.getpid()
        self._closed = False
        self._lock = threading.RLock()
        self._selector = selectors.DefaultSelector()
        self._workers: list[_Worker] = []
        self._next_id = 0
        self._failed_starts = 0
        for _ in range(num_workers):
            self._spawn()

    @property
    def usable(self) -> bool:
        """False once closed, and in a forked child (which must not use its parent's workers)."""
        return not self._closed and self._pid == os.getpid()

    @property
    def pids(self) -> list[int]:
        """Process ids of the current workers."""
        return [worker.proc.pid for worker in self._workers]

    def _spawn(self) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_PARENT, env.get("PYTHONPATH")) if p)
        proc = subprocess.Popen(
            [sys.executable, "-m", "mars_jax.rewards.grader_worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            close_fds=True,
        )
        os.set_blocking(proc.stdout.fileno(), False)
        worker = _Worker(proc)
        self._workers.append(worker)
        self._selector.register(proc.stdout, selectors.EVENT_READ, worker)

    def _retire(self, worker: _Worker) -> None:
        self._selector.unregister(worker.proc.stdout)
        self._workers.remove(worker)
        worker.proc.kill()
        worker.proc.wait()
        with contextlib.suppress(BrokenPipeError):  # a request to a dead worker is still buffered
            worker.proc.stdin.close()
        worker.proc.stdout.close()

    def _replace(self, worker: _Worker) -> None:
        if not worker.ready:
            self._failed_starts += 1
            if self._failed_starts > MAX_FAILED_STARTS * self.num_workers:
                code = worker.proc.poll()
                self.close()
                raise RuntimeError(f"grader workers keep failing to start (last exit code {code}); see stderr")
        self._retire(worker)
        self._spawn()

    def _messages(self, worker: _Worker) -> list[dict] | None:
        """Complete messages from `worker`, or None if its output closed."""
        chunks = []
        while True:
            try:
                chunk = os.read(worker.proc.stdout.fileno(), 1 << 16)
            except BlockingIOError:
                break
            if not chunk:
                return None
            chunks.append(chunk)
        *lines, worker.buffer = (worker.buffer + b"".join(chunks)).split(b"\n")
        return [json.loads(line) for line in lines if line.strip()]

    def _send(self, worker: _Worker, index: int, pair: tuple[str, str], timeout: float) -> None:
        self._next_id += 1
        worker.task, worker.request_id = index, self._next_id
        request = {"id": self._next_id, "pred": pair[0], "gold": pair[1], "soft": timeout * SOFT_FRACTION}
        worker.deadline = time.monotonic() + timeout * HARD_FRACTION
        try:
            worker.proc.stdin.write(json.dumps(request).encode() + b"\n")
            worker.proc.stdin.flush()
        except BrokenPipeError:
            worker.deadline = 0.0  # dead worker: the deadline check replaces it

    def map(self, pairs: Sequence[tuple[str, str]], timeout: float) -> list[bool]:
        """Equivalence of each (pred, gold) pair; False for any pair past `timeout` seconds."""
        results = [False] * len(pairs)
        todo = collections.deque(range(len(pairs)))
        with self._lock:
            startup_deadline = time.monotonic() + STARTUP_TIMEOUT
            while todo or any(w.task is not None for w in self._workers):
                for worker in list(self._workers):
                    if worker.ready and worker.task is None and todo:
                        index = todo.popleft()
                        self._send(worker, index, pairs[index], timeout)
                self._wait_and_collect(results, startup_deadline)
        return results

    def _wait_and_collect(self, results: list[bool], startup_deadline: float) -> None:
        busy = [w for w in self._workers if w.task is not None]
        wake = min((w.deadline for w in busy), default=startup_deadline)
        for key, _ in self._selector.select(max(0.0, wake - time.monotonic())):
            worker = key.data
            messages = self._messages(worker)
            for message in messages or ():
                if message.get("ready"):
                    worker.ready = True
                    self._failed_starts = 0
                elif message.get("id") == worker.request_id and worker.task is not None:
                    results[worker.task] = bool(message["value"])
                    self.stats[message["status"]] += 1
                    worker.task = None
            if messages is None:
                if worker.task is not None:
                    self.stats["crashed"] += 1
                self._replace(worker)
        now = time.monotonic()
        for worker in [w for w in self._workers if w.task is not None and w.deadline <= now]:
            self.stats["killed"] += 1
            self._replace(worker)
        if not any(w.ready for w in self._workers) and now > startup_deadline:
            self.close()
            raise RuntimeError(f"no grader worker became ready within {STARTUP_TIMEOUT:.0f} s")

    def wait_ready(self) -> None:
        """Block until every worker has started (at most STARTUP_TIMEOUT seconds)."""
        with self._lock:
            deadline = time.monotonic() + STARTUP_TIMEOUT
            while not all(w.ready for w in self._workers):
                self._wait_and_collect([], deadline)
                if time.monotonic() > deadline:
                    raise RuntimeError(f"grader workers not ready within {STARTUP_TIMEOUT:.0f} s")

    def close(self) -> None:
        """Stop all workers."""
        with self._lock:
            for worker in list(self._workers):
                self._retire(worker)
            self._selector.close()
            self._closed = True
