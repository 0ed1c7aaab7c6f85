"""The pipeline benchmarks' workload: long-tailed output lengths forced on a real engine, and
grades drawn at seeded rates instead of read from a random model's text."""
from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Sequence

import numpy as np

from mars_jax.rewards.text import THINK_CLOSE, THINK_OPEN
from mars_jax.rl.rollout import AgenticRollouts


@dataclasses.dataclass(frozen=True)
class LengthModel:
    """Log-normal output lengths (median, sigma), at least `floor`, cut at `cap` tokens."""

    median: float
    sigma: float
    cap: int
    floor: int = 2

    def draw(self, key: str) -> int:
        rng = np.random.default_rng(zlib.crc32(key.encode()))
        return int(min(self.cap, max(self.floor, rng.lognormal(np.log(self.median), self.sigma))))


class SeededGrades(AgenticRollouts):
    """Rewards at fixed rates, seeded by rollout uid: a Solver / Corrector output is right with
    probability `solve_rate`, a Verifier's verdict is right with probability `verify_rate`
    (judging the actual correctness of its parent), so selection and the Corrector's
    eligibility behave as on real text. With `visible` > 0 an output reads as a thinking
    model's does: a thought, then `visible` characters of answer, all the next stage's prompt
    embeds (the trained tokens are unchanged)."""

    solve_rate = 0.5
    verify_rate = 0.8
    visible = 0  # > 0: an output is a thought and its last `visible` characters (see _grade)

    def _grade(self, finished) -> None:
        for r in finished:
            if self.visible:  # what a thinking model's text reads as: only the tail is shown
                thought, answer = r.text[:-self.visible], r.text[-self.visible:]
                r.text = f"{THINK_OPEN}{thought}{THINK_CLOSE}{answer}"
            u = np.random.default_rng(zlib.crc32(r.uid.encode())).random()
            if r.role == "verifier":
                right = u < self.verify_rate
                r.verdict = bool(r.judged_correct) if right else not r.judged_correct
                r.reward = float(right)
            else:
                r.reward = float(u < self.solve_rate)


class ForcedLengths:
    """Wraps an engine so that each request stops after its `LengthModel` length (drawn from its
    sequence seed), reported as a stop: every mode decodes exactly the same lengths."""

    def __init__(self, engine, lengths: LengthModel):
        self.engine, self.lengths = engine, lengths
        self.num_slots = engine.num_slots
        self._budgets: dict[int, int] = {}

    @property
    def stats(self):
        return self.engine.stats

    def submit(self, prompt_ids: Sequence[int], *, max_new_tokens: int, seed: int, n: int = 1,
               stop_ids: Sequence[int] = (), generated=None, **sampling) -> list[int]:
        ids = []
        for i in range(n):
            budget = min(max_new_tokens, self.lengths.draw(str(seed + i)))
            part = generated if generated and len(generated[0]) < budget else None
            (rid,) = self.engine.submit(prompt_ids, max_new_tokens=budget, seed=seed + i, n=1,
                                        stop_ids=(), generated=part, **sampling)
            self._budgets[rid] = budget
            ids.append(rid)
        return ids

    def _as_stop(self, item):
        rid, out = item
        if out.finish_reason == "length" and len(out.tokens) == self._budgets.pop(rid, -1):
            out = dataclasses.replace(out, finish_reason="stop")
        return rid, out

    def stream(self, stop=None):
        return map(self._as_stop, self.engine.stream(stop))

    def finished(self):
        return [self._as_stop(item) for item in self.engine.finished()]

    def in_slots(self):
        return self.engine.in_slots()

    def partial(self, request_id):
        return self.engine.partial(request_id)

    def recompute(self, request_ids):
        self.engine.recompute(request_ids)

    def update_weights(self, model):
        self.engine.update_weights(model)
