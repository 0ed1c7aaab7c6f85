"""`EngineGenerator`: rollout requests on the engine equal their own `generate` decodes."""
import numpy as np
import pytest

from mars_jax.models import create_model, get_preset
from mars_jax.rl.generator import EngineGenerator
from mars_jax.rl.rollout import GenerationRequest
from mars_jax.sampling import generate
from tests.compile_events import ENGINE_PROGRAMS, compiled_programs


def test_requests_equal_their_own_decode_and_a_group_is_prefilled_once():
    model = create_model(get_preset("tiny"), seed=0)
    rng = np.random.default_rng(0)
    shared = tuple(int(t) for t in rng.integers(1, 500, size=9))
    prompts = [tuple(int(t) for t in rng.integers(1, 500, size=n)) for n in (5, 40, 7)]
    requests = ([GenerationRequest(p, 6 + i, "solver") for i, p in enumerate(prompts)]
                + [GenerationRequest(shared, 12, "verifier")] * 4)
    generator = EngineGenerator(model, (), temperature=0.0, top_p=1.0, top_k=0, seed=0,
                                record_routing=False, num_slots=4, max_length=64, chunk_steps=4)
    outputs = generator(requests)
    assert generator.engine.stats["prefills"] == 4  # three prompts + the group's shared one
    for request, output in zip(requests, outputs):
        alone = generate(model, [list(request.prompt_ids)], max_new_tokens=request.max_new_tokens,
                         temperature=0.0)
        assert list(output.token_ids) == alone.tokens[0]
        np.testing.assert_allclose(output.logprobs, alone.logprobs[0], atol=1e-5)
        assert output.finish_reason == "length"



def test_set_model_starts_the_seed_series_again():
    model = create_model(get_preset("tiny"), seed=0)
    requests = [GenerationRequest((5, 9, 13), 8, "solver")] * 3
    generator = EngineGenerator(model, (), temperature=1.0, top_p=1.0, top_k=0, seed=0,
                                record_routing=False, num_slots=4, max_length=32, chunk_steps=4)
    first = generator(requests)
    assert len({o.token_ids for o in first}) > 1  # each request its own sequence seed
    assert generator(requests) != first  # the series goes on
    generator.set_model(model, seed=0)
    assert generator(requests) == first
    generator.set_model(model, seed=1)
    assert generator(requests) != first


@pytest.mark.parametrize("kv_pages", [0, 6])
def test_batched_admission_from_the_config_decodes_the_same_tokens(kv_pages):
    """`rollout.engine_admit_batch` / `engine_prefill_ahead` change when requests enter the
    engine, not what they decode (greedy); so does a pool of 6 pages of 8 positions
    (`engine_kv_pages`), fewer than the two longest requests need together."""
    from ml_collections import ConfigDict

    model = create_model(get_preset("tiny"), seed=0)
    rng = np.random.default_rng(1)
    requests = [GenerationRequest(tuple(int(t) for t in rng.integers(1, 500, size=n)), m, "solver")
                for n, m in zip((5, 30, 9, 17, 3, 11), (3, 9, 14, 5, 8, 12))]
    rollout = ConfigDict(dict(engine_slots=2, max_decode_rows=0, max_prompt_tokens=32,
                              max_new_tokens={"solver": 16}, engine_chunk_steps=4,
                              engine_admit_batch=2, engine_prefill_ahead=3, temperature=0.0,
                              top_p=1.0, top_k=0, engine_kv_pages=kv_pages,
                              engine_page_size=8, engine_paged_attention="auto"))
    config = ConfigDict(dict(rollout=rollout, learner=dict(routing_replay=False)))
    generator = EngineGenerator.from_config(config, model, (), seed=0)
    assert (generator.engine.admit_batch, generator.engine.prefill_ahead) == (2, 3)
    assert generator.engine.kv_pages == (kv_pages or None)
    outputs = generator(requests)
    assert generator.engine.stats["prefill_calls"] < len(requests)
    for request, output in zip(requests, outputs):
        alone = generate(model, [list(request.prompt_ids)], max_new_tokens=request.max_new_tokens,
                         temperature=0.0)
        assert list(output.token_ids) == alone.tokens[0]


def test_engine_precompile_from_the_config_leaves_the_rollout_nothing_to_compile():
    """`rollout.engine_precompile` compiles the engine's programs when the generator is built,
    for prompts up to `max_prompt_tokens` (1..24 here: buckets 16 and 24): decoding the
    requests afterwards compiles no engine program."""
    from ml_collections import ConfigDict

    model = create_model(get_preset("tiny"), seed=0)
    rng = np.random.default_rng(2)
    requests = [GenerationRequest(tuple(int(t) for t in rng.integers(1, 500, size=n)), m, "solver")
                for n, m in zip((5, 24, 9, 17, 3), (3, 9, 14, 5, 8))]
    rollout = ConfigDict(dict(engine_slots=2, max_decode_rows=0, max_prompt_tokens=24,
                              max_new_tokens={"solver": 16}, engine_chunk_steps=4,
                              engine_admit_batch=1, engine_prefill_ahead=0, temperature=1.0,
                              top_p=1.0, top_k=0, engine_kv_pages=0, engine_page_size=8,
                              engine_paged_attention="auto", engine_precompile=True))
    config = ConfigDict(dict(rollout=rollout, learner=dict(routing_replay=False)))
    generator = EngineGenerator.from_config(config, model, (), seed=0)
    with compiled_programs() as compiled:
        outputs = generator(requests)
    assert [len(o.token_ids) for o in outputs] == [r.max_new_tokens for r in requests]
    assert not ENGINE_PROGRAMS.intersection(compiled)
