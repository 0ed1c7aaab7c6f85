"""The decode engines' typed settings (`EngineSettings`) from a run's `ml_collections` config:
the rollout engine (config.rollout) and the evaluation's and probe's (config.eval)."""
from __future__ import annotations

from ml_collections import ConfigDict

from mars_jax.sampling.decode import EngineSettings
from mars_jax.sampling.sampler import batch_shards


def engine_shape(config: ConfigDict, mesh=None) -> tuple[int, int]:
    """(slots, positions per slot) of a config's engine: `rollout.engine_slots` (0: 16) rounded
    up to the mesh's batch shards; the longest prompt plus the largest budget."""
    r = config.rollout
    multiple = batch_shards(mesh)
    slots = r.engine_slots or 16
    return (-(-slots // multiple) * multiple,
            r.max_prompt_tokens + max(dict(r.max_new_tokens).values()))


def _engine_options(config: ConfigDict) -> dict:
    r = config.rollout
    return dict(chunk_steps=r.engine_chunk_steps, admit_batch=r.engine_admit_batch,
                prefill_ahead=r.engine_prefill_ahead, kv_pages=r.engine_kv_pages or None,
                page_size=r.engine_page_size, paged_attention=r.engine_paged_attention)


def engine_settings(config: ConfigDict, mesh=None) -> EngineSettings:
    """The rollout decode engine on `mesh` (its rollout mesh): one base seed for the whole run
    (a request's key depends only on it and the rollout's sequence seed)."""
    r = config.rollout
    slots, length = engine_shape(config, mesh)
    return EngineSettings(
        kind=r.decode_engine, seed=(config.seed * 1_000_003) % (1 << 32), slots=slots,
        max_length=length, record_routing=config.learner.routing_replay,
        options=_engine_options(config), precompile=bool(r.engine_precompile),
        max_prompt_tokens=r.max_prompt_tokens, max_rows=r.max_decode_rows)


def eval_engine_settings(config: ConfigDict, slots: int) -> EngineSettings:
    """The in-process evaluation's and probe's engine: `slots` > 0 slots with the rollout
    engine's options (paged KV, chunking, ...), else static batches; `seed` the run's."""
    length = config.rollout.max_prompt_tokens + max(dict(config.eval.max_new_tokens).values())
    if not slots:
        return EngineSettings(kind="generate", seed=config.seed,
                              max_rows=config.rollout.max_decode_rows)
    return EngineSettings(kind="engine", seed=config.seed, slots=slots, max_length=length,
                          options=_engine_options(config))
