"""`Engine`'s request interface over `generate`: the simple, exact reference decode.

Each `stream` round decodes every queued request to its end (one call per prompt bucket) and yields
outputs in submission order; `Engine`'s PRNG keys, so both decode alike up to rounding.
"""
from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Iterator, Sequence

from mars_jax.sampling.engine import EngineOutput
from mars_jax.sampling.sampler import generate, prompt_bucket


@dataclasses.dataclass(frozen=True)
class _Queued:
    id: int
    prompt: tuple[int, ...]
    max_new: int
    sampling: tuple[float, float, int]  # temperature, top_p, top_k
    sequence_seed: int
    stop_ids: tuple[int, ...]


class StaticBatchEngine:
    """`decode.DecodeEngine` on `generate` (no partial output to continue). `stats` counts
    `tokens` and `slot_steps` (a call's rows times its longest output)."""

    def __init__(self, model, *, seed: int, record_routing: bool = False, mesh=None,
                 max_rows: int = 0):
        self.model, self.seed, self.mesh = model, seed % (1 << 32), mesh
        self.record_routing, self.max_rows = record_routing, max_rows
        self.stats: collections.Counter = collections.Counter()
        self._queue: list[_Queued] = []
        self._next_id = 0

    def update_weights(self, model) -> None:
        self.model = model

    def free_kv(self) -> None:
        """Nothing to free: `generate` holds its cache only within a call."""

    def submit(self, prompt_ids: Sequence[int], *, max_new_tokens: int, temperature: float = 1.0,
               top_p: float = 1.0, top_k: int = 0, seed: int = 0, stop_ids: Sequence[int] = (),
               n: int = 1) -> list[int]:
        """Queues `n` requests on one prompt (sequence seeds `seed`, `seed + 1`, ...)."""
        if n < 1:
            raise ValueError(f"n: need n >= 1, got {n}")
        ids = list(range(self._next_id, self._next_id + n))
        self._next_id += n
        self._queue += [_Queued(i, tuple(int(t) for t in prompt_ids), int(max_new_tokens),
                                (float(temperature), float(top_p), int(top_k)), int(seed) + k,
                                tuple(int(s) for s in stop_ids)) for k, i in enumerate(ids)]
        return ids

    def stream(self, stop: Callable[[], bool] | None = None
               ) -> Iterator[tuple[int, EngineOutput]]:
        """Decodes everything queued (unless `stop()`) and yields outputs in submission order."""
        if (stop is not None and stop()) or not self._queue:
            return
        queued, self._queue = self._queue, []
        batches: dict[tuple, list[_Queued]] = {}
        for q in queued:
            batches.setdefault((q.sampling, prompt_bucket(len(q.prompt))), []).append(q)
        outputs: dict[int, EngineOutput] = {}
        for (sampling, _), members in sorted(batches.items(), key=lambda kv: kv[0][1]):
            size = self.max_rows or len(members)
            for start in range(0, len(members), size):
                outputs.update(self._decode(members[start:start + size], *sampling))
        for q in queued:
            yield q.id, outputs[q.id]

    def run(self) -> dict[int, EngineOutput]:
        """Decodes everything queued; outputs by request id."""
        return dict(self.stream())

    def finished(self) -> list[tuple[int, EngineOutput]]:
        return []  # `stream` yields every output of its round

    def in_slots(self) -> list[int]:
        return []  # nothing is in flight between rounds

    def partial(self, request_id: int) -> tuple[list[int], list[float]]:
        """A queued request's tokens so far: none (a round decodes a request to its end)."""
        if not any(q.id == request_id for q in self._queue):
            raise KeyError(f"request {request_id} is not queued")
        return [], []

    def recompute(self, request_ids: Sequence[int]) -> None:
        """Re-prefills requests holding a slot: none ever does between rounds."""
        if request_ids:
            raise ValueError("recompute: every request must hold a slot (none is in flight "
                             "between the rounds of a static batch)")

    def _decode(self, members: list[_Queued], temperature: float, top_p: float, top_k: int
                ) -> dict[int, EngineOutput]:
        result = generate(self.model, [q.prompt for q in members],
                          max_new_tokens=[q.max_new for q in members],
                          temperature=temperature, top_p=top_p, top_k=top_k,
                          eos_token_ids=[q.stop_ids for q in members], seed=self.seed,
                          sequence_seeds=[q.sequence_seed for q in members],
                          record_routing=self.record_routing, mesh=self.mesh)
        experts = result.expert_ids or [None] * len(members)
        self.stats["tokens"] += sum(map(len, result.tokens))
        self.stats["slot_steps"] += len(members) * max(map(len, result.tokens), default=0)
        return {q.id: EngineOutput(list(t), list(lp), reason, e)
                for q, t, lp, reason, e in zip(members, result.tokens, result.logprobs,
                                               result.finish_reasons, experts)}
