"""Rollout decoding: `SamplerGenerator` (static batches of `mars_jax.sampling.generate`) and
`EngineGenerator` (the continuous-batching `mars_jax.sampling.Engine`).

`EngineGenerator`:
One engine (its slots and KV caches) lives across training steps; each step hands it the current
weights (`set_model`). A call submits every request at once: requests with the same prompt and
budget (the G rollouts of a group) are one `submit(n=G)`, so their prompt is prefilled once; slots
are refilled as requests finish, so no request waits for the call's longest one. A segment's
continuation arrives as a new request (prompt + response so far), which the engine prefills
under the current weights (the engine's `recompute` resume: exactly on-policy KV).
With several processes a call is a collective: every host's requests are gathered and submitted
in the same order on every host (the engine's host logic is deterministic, so every host runs the
same programs), and each host gets its own outputs back.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
from ml_collections import ConfigDict

from mars_jax import distributed
from mars_jax.rl.rollout import GenerationOutput, GenerationRequest
from mars_jax.sampling import Engine, batch_shards, generate, prompt_bucket


def across_hosts(requests: Sequence[GenerationRequest],
                 decode: Callable[[Sequence[GenerationRequest]], list[GenerationOutput]]
                 ) -> list[GenerationOutput]:
    """`decode(requests)`; with several processes a collective: every host's requests are
    gathered (in process order) and decoded together, and each host gets its own outputs back."""
    if jax.process_count() == 1:
        return decode(requests)
    everyone = distributed.allgather_json([[list(r.prompt_ids), r.max_new_tokens, r.role]
                                           for r in requests])
    start = sum(len(rows) for rows in everyone[:jax.process_index()])
    merged = [GenerationRequest(tuple(ids), budget, role)
              for rows in everyone for ids, budget, role in rows]
    return decode(merged)[start:start + len(requests)]


class SamplerGenerator:
    """Decodes `GenerationRequest`s with `mars_jax.sampling.generate` on one model version.

    A pipeline step mixes short Solver prompts with long Verifier/Corrector prompts. `generate`
    left-pads every row to the batch's prompt bucket, so requests are decoded in one call per
    prompt-length bucket (`sampling.prompt_bucket`): no Solver row pays for a 512-token prefill.
    `max_rows` caps the rows of one call (a decode's KV cache grows with its rows).
    With several processes a call is a collective: every host's requests are gathered and decoded
    together (same buckets, same calls on every host), and each host gets its own outputs back.
    """

    def __init__(self, model, eos: Sequence[int], *, temperature: float, top_p: float,
                 top_k: int, seed: int, record_routing: bool, mesh=None, max_rows: int = 0):
        self.model, self.eos, self.seed, self.mesh = model, tuple(eos), seed, mesh
        self.max_rows = max_rows
        self.kwargs = dict(temperature=temperature, top_p=top_p, top_k=top_k,
                           record_routing=record_routing)
        self.calls = 0

    def __call__(self, requests: Sequence[GenerationRequest]) -> list[GenerationOutput]:
        return across_hosts(requests, self._decode_by_bucket)

    def _decode_by_bucket(self, requests: Sequence[GenerationRequest]) -> list[GenerationOutput]:
        by_bucket: dict[int, list[int]] = {}
        for index, request in enumerate(requests):
            by_bucket.setdefault(prompt_bucket(len(request.prompt_ids)), []).append(index)
        outputs: list[GenerationOutput | None] = [None] * len(requests)
        for bucket in sorted(by_bucket):
            indices = by_bucket[bucket]
            size = self.max_rows or len(indices)
            for start in range(0, len(indices), size):
                chunk = indices[start:start + size]
                for index, output in zip(chunk, self._decode([requests[i] for i in chunk])):
                    outputs[index] = output
        return outputs

    def _decode(self, requests: Sequence[GenerationRequest]) -> list[GenerationOutput]:
        result = generate(self.model, [list(r.prompt_ids) for r in requests],
                          max_new_tokens=[r.max_new_tokens for r in requests],
                          eos_token_ids=self.eos, seed=self.seed + self.calls, mesh=self.mesh,
                          **self.kwargs)
        self.calls += 1
        experts = result.expert_ids or [None] * len(requests)
        return [GenerationOutput(tuple(t), tuple(lp), "stop" if reason == "stop" else "length", e)
                for t, lp, reason, e in zip(result.tokens, result.logprobs,
                                            result.finish_reasons, experts)]


def engine_shape(config: ConfigDict, mesh=None) -> tuple[int, int]:
    """(slots, positions per slot) of a config's engine: `rollout.engine_slots` (0:
    `max_decode_rows`, else 16) rounded up to the mesh's batch shards; the longest prompt plus
    the largest budget."""
    r = config.rollout
    multiple = batch_shards(mesh)
    slots = r.engine_slots or r.max_decode_rows or 16
    return (-(-slots // multiple) * multiple,
            r.max_prompt_tokens + max(dict(r.max_new_tokens).values()))


def engine_options(config: ConfigDict) -> dict:
    """The `Engine` settings a config's `rollout.engine_*` fields give (`engine_kv_pages` 0:
    every slot reserves its positions; else that many pages)."""
    r = config.rollout
    return dict(chunk_steps=r.engine_chunk_steps, admit_batch=r.engine_admit_batch,
                prefill_ahead=r.engine_prefill_ahead, kv_pages=r.engine_kv_pages or None,
                page_size=r.engine_page_size, paged_attention=r.engine_paged_attention)


def precompiled(engine: Engine, config: ConfigDict) -> Engine:
    """`engine`, with `rollout.engine_precompile` its programs compiled ahead for prompts of
    up to `rollout.max_prompt_tokens` (`Engine.precompile`; a recomputed request's prompt +
    tokens past that compile when met)."""
    if config.rollout.get("engine_precompile"):
        engine.precompile(range(1, config.rollout.max_prompt_tokens + 1))
    return engine


def stream_engine(config: ConfigDict, model, eos: Sequence[int], *, mesh=None) -> Engine:
    """The streaming scheduler's engine: `engine_shape(config, mesh)`, one base seed for the
    whole run (a request's key depends only on it and the rollout's sequence seed)."""
    slots, length = engine_shape(config, mesh)
    return precompiled(Engine(
        model, num_slots=slots, max_length=length, max_stop_ids=max(8, len(tuple(eos))),
        seed=(config.seed * 1_000_003) % (1 << 32), record_routing=config.learner.routing_replay,
        mesh=mesh, **engine_options(config)), config)


class EngineGenerator:
    """A `rollout.Generator` on an `Engine` of `num_slots` slots of `max_length` positions
    (`engine_options`: the engine's other settings). Sequence seeds count the requests
    submitted since the last `set_model` (whose `seed` is the engine's base seed), so a step's
    draws are reproducible from its seed."""

    def __init__(self, model, eos: Sequence[int], *, temperature: float, top_p: float,
                 top_k: int, seed: int, record_routing: bool, num_slots: int, max_length: int,
                 mesh=None, **engine_options):
        self.eos = tuple(int(e) for e in eos)
        self.sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k)
        self.engine = Engine(model, num_slots=num_slots, max_length=max_length,
                             max_stop_ids=max(8, len(self.eos)), seed=seed % (1 << 32),
                             record_routing=record_routing, mesh=mesh, **engine_options)
        self.submitted = 0

    @classmethod
    def from_config(cls, config: ConfigDict, model, eos: Sequence[int], *, seed: int,
                    mesh=None) -> "EngineGenerator":
        """The engine of `engine_shape(config, mesh)` with the config's sampling settings."""
        r = config.rollout
        slots, length = engine_shape(config, mesh)
        generator = cls(model, eos, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                        seed=seed, record_routing=config.learner.routing_replay,
                        num_slots=slots, max_length=length, mesh=mesh, **engine_options(config))
        precompiled(generator.engine, config)
        return generator

    def set_model(self, model, *, seed: int) -> None:
        """Decodes with `model`'s current arrays from now on; `seed` starts a new seed series."""
        self.engine.update_weights(model)
        self.engine.seed = seed % (1 << 32)
        self.submitted = 0

    def __call__(self, requests: Sequence[GenerationRequest]) -> list[GenerationOutput]:
        return across_hosts(requests, self._decode)

    def _decode(self, requests: Sequence[GenerationRequest]) -> list[GenerationOutput]:
        groups: dict[tuple, list[int]] = {}
        for index, request in enumerate(requests):
            groups.setdefault((tuple(request.prompt_ids), request.max_new_tokens), []).append(index)
        request_ids: dict[int, int] = {}
        for (prompt, budget), indices in groups.items():
            ids = self.engine.submit(prompt, max_new_tokens=budget, stop_ids=self.eos,
                                     seed=self.submitted, n=len(indices), **self.sampling)
            self.submitted += len(indices)
            request_ids.update(zip(indices, ids))
        outputs = self.engine.run()
        result = []
        for index in range(len(requests)):
            out = outputs[request_ids[index]]
            result.append(GenerationOutput(tuple(out.tokens), tuple(out.logprobs),
                                           "stop" if out.finish_reason == "stop" else "length",
                                           out.expert_ids))
        return result
