"""What every decode user needs of an engine: `DecodeEngine`, `EngineSettings` + `make_engine`, and
`decode_batch`.
"""
from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

from mars_jax.sampling.engine import Engine, EngineOutput
from mars_jax.sampling.precompile import compile_ahead
from mars_jax.sampling.static_engine import StaticBatchEngine

ENGINE_KINDS = ("engine", "generate")


class DecodeEngine(Protocol):
    """Requests in, `EngineOutput`s out; only on `Engine` is a request in flight between `stream`
    rounds, so only there do `partial` and `recompute` matter."""

    stats: collections.Counter

    def submit(self, prompt_ids: Sequence[int], *, max_new_tokens: int, temperature: float,
               top_p: float, top_k: int, seed: int, stop_ids: Sequence[int], n: int
               ) -> list[int]: ...

    def stream(self, stop: Callable[[], bool] | None = None
               ) -> Iterator[tuple[int, EngineOutput]]: ...

    def run(self) -> dict[int, EngineOutput]: ...

    def finished(self) -> list[tuple[int, EngineOutput]]: ...

    def in_slots(self) -> list[int]: ...

    def partial(self, request_id: int) -> tuple[list[int], list[float]]: ...

    def recompute(self, request_ids: Sequence[int]) -> None: ...

    def update_weights(self, model) -> None: ...

    def free_kv(self) -> None: ...


class ContinuingEngine(DecodeEngine, Protocol):
    """A `DecodeEngine` that also continues a request from the tokens and log-probabilities it
    already has (`Engine.submit(generated=...)`; a checkpoint's partial outputs)."""

    def submit(self, prompt_ids: Sequence[int], *, max_new_tokens: int, temperature: float,
               top_p: float, top_k: int, seed: int, stop_ids: Sequence[int], n: int,
               generated: tuple[Sequence[int], Sequence[float]] | None = None) -> list[int]: ...


def decode_batch(engine: DecodeEngine, prompts: Sequence[Sequence[int]],
                 budgets: Sequence[int], *, stop_ids: Sequence[int], first_seed: int,
                 temperature: float, top_p: float, top_k: int = 0) -> list[EngineOutput]:
    """Decodes request i = (`prompts[i]`, `budgets[i]`) on `engine`, outputs in request order;
    equal requests are one `submit`, groups taking sequence seeds from `first_seed` in order."""
    groups: dict[tuple, list[int]] = {}
    for index, (prompt, budget) in enumerate(zip(prompts, budgets, strict=True)):
        groups.setdefault((tuple(prompt), int(budget)), []).append(index)
    ids: dict[int, int] = {}
    seed = first_seed
    for (prompt, budget), indices in groups.items():
        submitted = engine.submit(prompt, max_new_tokens=budget, stop_ids=stop_ids, seed=seed,
                                  n=len(indices), temperature=temperature, top_p=top_p,
                                  top_k=top_k)
        seed += len(indices)
        ids.update(zip(indices, submitted))
    outputs = engine.run()
    return [outputs[ids[i]] for i in range(len(prompts))]


@dataclasses.dataclass(frozen=True)
class EngineSettings:
    """A decode engine: 'engine' (continuous batching, `options` its other `Engine` settings) or
    'generate' (`StaticBatchEngine`, calls of at most `max_rows` rows, 0: all)."""

    kind: str = "generate"
    seed: int = 0
    slots: int = 0
    max_length: int = 0
    record_routing: bool = False
    options: dict = dataclasses.field(default_factory=dict)
    precompile: bool = False
    max_prompt_tokens: int = 0
    max_rows: int = 0


def make_engine(settings: EngineSettings, model, stop_ids: Sequence[int], *, mesh=None
                ) -> DecodeEngine:
    """The engine `settings` describe over `model`'s arrays (on `mesh`)."""
    if settings.kind not in ENGINE_KINDS:
        raise ValueError(f"kind: {settings.kind!r} is not one of {ENGINE_KINDS}")
    if settings.kind == "generate":
        return StaticBatchEngine(model, seed=settings.seed, record_routing=settings.record_routing,
                                 mesh=mesh, max_rows=settings.max_rows)
    engine = Engine(model, num_slots=settings.slots, max_length=settings.max_length,
                    max_stop_ids=max(8, len(tuple(stop_ids))), seed=settings.seed % (1 << 32),
                    record_routing=settings.record_routing, mesh=mesh, **settings.options)
    if settings.precompile:
        compile_ahead(engine, range(1, settings.max_prompt_tokens + 1))
    return engine
