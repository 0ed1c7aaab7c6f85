"""The continuous-batching engine against `generate`, HF generate, the full forward, itself."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from mars_jax import sharding
from mars_jax.layers.attention_mask import AttentionMask
from mars_jax.models import from_pretrained
from mars_jax.sampling import Engine, engine as engine_module, engine_programs, generate
from mars_jax.sampling.precompile import compile_ahead
from tests import hf_fixtures
from tests.compile_events import ENGINE_PROGRAMS, compiled_programs

STOP = (3,)
SETTINGS = [dict(temperature=1.0), dict(temperature=0.0), dict(temperature=0.8, top_p=0.9),
            dict(temperature=1.2, top_k=5)]


def _requests():
    """10 requests: prompt lengths 1..19 (buckets 16 and 32), budgets 1..29, four settings."""
    rng = np.random.default_rng(0)
    return [dict(prompt=rng.integers(4, 96, int(rng.integers(1, 20))).tolist(),
                 max_new_tokens=int(rng.integers(1, 30)), seed=100 + i, **SETTINGS[i % 4])
            for i in range(10)]


REQUESTS = _requests()
PAGING = [{}, dict(kv_pages=16, page_size=8)]  # reserved slots; a paged pool


@pytest.fixture(scope="module")
def model(hf_moe_dir):
    return from_pretrained(hf_moe_dir)


@pytest.fixture(scope="module")
def reference(model):
    """`generate` on each request alone (engine seed 0 = `generate`'s seed, request seed =
    its sequence seed)."""
    out = []
    for r in REQUESTS:
        sampling = {k: v for k, v in r.items() if k in ("temperature", "top_p", "top_k")}
        out.append(generate(model, [r["prompt"]], max_new_tokens=r["max_new_tokens"],
                            eos_token_ids=STOP, seed=0, sequence_seeds=[r["seed"]],
                            record_routing=True, **sampling))
    return out


def _serve(engine, order):
    ids = {}
    for i in order:
        r = dict(REQUESTS[i])
        ids[i] = engine.submit(r.pop("prompt"), stop_ids=STOP, **r)[0]
    outputs = engine.run()
    return {i: outputs[rid] for i, rid in ids.items()}


@pytest.mark.parametrize("order, scan", [(list(range(10)), False), (list(range(9, -1, -1)), False),
                                         ([3, 8, 0, 5, 9, 1, 6, 2, 7, 4], True)])
def test_tokens_equal_generate_whatever_the_neighbours(model, reference, order, scan):
    """Layers unrolled, or scanned (one scan per run of alike layers: the fixture's dense
    layer 1 between MoE layers 0 and 2 makes three)."""
    engine = Engine(model, num_slots=4, max_length=64, chunk_steps=4, record_routing=True,
                    min_span=16,  # decode chunks over KV spans of 16, 24, 32, 48 and 64 positions
                    scan_layers=scan)
    outputs = _serve(engine, order)
    assert engine.stats["prefills"] == 10
    for i, ref in enumerate(reference):
        assert outputs[i].tokens == ref.tokens[0], i
        assert outputs[i].finish_reason == ref.finish_reasons[0]
        np.testing.assert_allclose(outputs[i].logprobs, ref.logprobs[0], atol=1e-5)
        np.testing.assert_array_equal(outputs[i].expert_ids, ref.expert_ids[0])
    assert {o.finish_reason for o in outputs.values()} == {"stop", "length"}


def test_a_request_that_fills_max_length_keeps_its_routing_while_a_neighbour_decodes(model):
    """Requests 8 and 9 without stop tokens, to max_length 40 (11 + 29 and 4 + 36 positions):
    request 8 ends in the middle of a chunk and its slot sits idle at length 40 while 9 decodes
    on. Each equals `generate` alone, token for token and expert for expert."""
    engine = Engine(model, num_slots=2, max_length=40, chunk_steps=8, record_routing=True)
    ids, alone = [], []
    for i in (8, 9):
        r = dict(REQUESTS[i], max_new_tokens=40 - len(REQUESTS[i]["prompt"]))
        prompt = r.pop("prompt")
        sampling = {k: r.pop(k) for k in ("temperature", "top_p", "top_k") if k in r}
        ids.append(engine.submit(prompt, **r, **sampling)[0])
        alone.append(generate(model, [prompt], max_new_tokens=r["max_new_tokens"],
                              eos_token_ids=(), seed=0, sequence_seeds=[r["seed"]],
                              record_routing=True, **sampling))
    outputs = engine.run()
    for rid, ref in zip(ids, alone):
        assert outputs[rid].tokens == ref.tokens[0] and len(ref.tokens[0]) > 28
        np.testing.assert_array_equal(outputs[rid].expert_ids, ref.expert_ids[0])


def test_greedy_equals_transformers_generate_on_a_padded_batch(model, hf_moe_dir):
    prompts = [r["prompt"] for r in REQUESTS[:4]]
    engine = Engine(model, num_slots=2, max_length=48, chunk_steps=4, min_span=16)
    ids = [engine.submit(p, max_new_tokens=16, temperature=0.0)[0] for p in prompts]
    outputs = engine.run()
    width = max(len(p) for p in prompts)
    batch = np.zeros((len(prompts), width), np.int64)
    mask = np.zeros_like(batch)
    for i, p in enumerate(prompts):
        batch[i, width - len(p):], mask[i, width - len(p):] = p, 1
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_moe_dir).eval()
    expected = hf.generate(torch.tensor(batch), attention_mask=torch.tensor(mask),
                           max_new_tokens=16, do_sample=False, pad_token_id=0)[:, width:]
    for rid, row in zip(ids, expected.tolist()):
        assert outputs[rid].tokens == row


def test_logprobs_equal_full_forward_log_softmax(model):
    width = 64  # the engine's max_length: every request fits, so one padded program serves all
    engine = Engine(model, num_slots=4, max_length=width, chunk_steps=4, record_routing=True)
    outputs = _serve(engine, range(10))
    graphdef, state = nnx.split(model)

    @jax.jit
    def full_logits(state, ids, valid, expert_ids):
        m = nnx.merge(graphdef, state)
        fwd = m.forward(ids, positions=jnp.arange(width)[None], mask=AttentionMask.causal(valid),
                        expert_ids=expert_ids)
        return m.logits(fwd.hidden)[0]

    for i, r in enumerate(REQUESTS):
        out = outputs[i]
        tokens = r["prompt"] + out.tokens
        length = len(tokens)
        ids = np.zeros((1, width), np.int32)
        ids[0, :length] = tokens
        expert_ids = np.zeros(out.expert_ids.shape[:1] + (1, width) + out.expert_ids.shape[2:],
                              np.int32)
        expert_ids[:, 0, :length] = out.expert_ids
        valid = (np.arange(width) < length)[None].astype(np.int32)
        logits = full_logits(state, ids, valid, expert_ids)
        temperature = r.get("temperature", 1.0)
        scaled = logits / (temperature if temperature > 0 else 1.0)
        expected = jax.nn.log_softmax(scaled, axis=-1)[
            np.arange(len(r["prompt"]) - 1, length - 1), np.asarray(out.tokens)]
        np.testing.assert_allclose(out.logprobs, np.asarray(expected), atol=1e-5)


def test_8_device_mesh_gives_the_same_tokens(hf_moe_dir, reference):
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 1, "expert": 2})
    sharded = from_pretrained(hf_moe_dir, mesh=mesh)
    engine = Engine(sharded, num_slots=8, max_length=64, chunk_steps=4, mesh=mesh, min_span=16)
    outputs = _serve(engine, range(10))
    for i, ref in enumerate(reference):
        assert outputs[i].tokens == ref.tokens[0], i
        np.testing.assert_allclose(outputs[i].logprobs, ref.logprobs[0], atol=1e-5)


def test_one_row_reads_are_slices_unless_the_mesh_splits_the_slots():
    """A mesh whose batch axes have size 1 splits nothing: one slot's read is then a dynamic
    slice, not a masked sum over every slot (which made each decode chunk on the trainer's
    one-device mesh ~20x slower)."""
    one = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1, "expert": 1},
                             devices=jax.devices()[:1])
    split = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 1, "expert": 2})
    with sharding.use_mesh(one):
        assert not engine_programs._slots_sharded(256)
    with sharding.use_mesh(split):
        assert engine_programs._slots_sharded(256) and not engine_programs._slots_sharded(3)
    assert not engine_programs._slots_sharded(256)  # no mesh


@pytest.mark.parametrize("span, scan", [(1024, False), (2048, False), (2048, True)])
def test_a_decode_chunk_holds_no_second_copy_of_the_cache(tmp_path, span, scan):
    """The chunk writes the slots' cache (stacked over the layers) in place and reads one
    layer's span at a time, its layers unrolled or scanned: its temporaries stay under two
    layers' KV (XLA:CPU copies the layer's span out of the stack for the matmuls), with
    blockwise attention configured and over a span shorter than the cache (a chunk that copied
    the span, or read each layer's cache transposed, held a span of every layer: half the cache
    or more)."""
    layers = 6
    model = from_pretrained(hf_fixtures.save_tiny_hf(tmp_path, moe=False,
                                                     num_hidden_layers=layers),
                            attention_impl="flash", attention_block=4)
    engine = Engine(model, num_slots=8, max_length=2048, chunk_steps=4, scan_layers=scan)
    state = engine.state
    kv_bytes = state.cache.k.nbytes + state.cache.v.nbytes
    compiled = engine_programs.decode_chunk.lower(
        engine.graphdef, engine.weights, state, None, None, jnp.int32(0), steps=4,
        span=span).compile()
    assert compiled.memory_analysis().temp_size_in_bytes < 2 * kv_bytes / layers


def test_prefill_ahead_prefills_queued_prompts_in_few_calls_with_the_same_tokens(model,
                                                                             reference):
    """4 slots, 10 requests: each admission's prefill call also takes the next queued prompts
    (up to 8 per call), which later take freed slots one at a time without a prefill."""
    engine = Engine(model, num_slots=4, max_length=64, chunk_steps=4, record_routing=True,
                    min_span=16, prefill_ahead=8)
    outputs = _serve(engine, list(range(10)))
    assert engine.stats["prefills"] == 10
    # The first call takes 8 prompts (two prompt buckets: 2 calls), the next admission the last 2
    # (7 calls without prefill_ahead).
    assert engine.stats["prefill_calls"] <= 4
    for i, ref in enumerate(reference):
        assert outputs[i].tokens == ref.tokens[0], i
        np.testing.assert_allclose(outputs[i].logprobs, ref.logprobs[0], atol=1e-5)


def test_group_prompt_is_prefilled_once(model, monkeypatch):
    calls = []
    prefill = engine_programs.prefill
    monkeypatch.setattr(engine_programs, "prefill",
                        lambda *a, **k: calls.append(k["bucket"]) or prefill(*a, **k))
    prompt = REQUESTS[2]["prompt"]
    grouped = Engine(model, num_slots=3, max_length=48, chunk_steps=4)
    group_ids = grouped.submit(prompt, max_new_tokens=20, temperature=1.0, seed=40, n=5)
    group_out = grouped.run()
    assert len(calls) == 1 and grouped.stats["prefills"] == 1  # 5 requests, 3 slots, one prefill
    alone = Engine(model, num_slots=3, max_length=48, chunk_steps=4)
    alone_ids = [alone.submit(prompt, max_new_tokens=20, temperature=1.0, seed=40 + i)[0]
                 for i in range(5)]
    alone_out = alone.run()
    assert alone.stats["prefills"] == 5
    tokens = [group_out[g].tokens for g in group_ids]
    assert tokens == [alone_out[a].tokens for a in alone_ids]
    assert len({tuple(t) for t in tokens}) > 1  # different sequence seeds, different samples


def _alone(model, prompt, *, chunk_steps: int, **settings):
    """`prompt`'s output decoded alone, in one go."""
    engine = Engine(model, num_slots=2, max_length=64, chunk_steps=chunk_steps, min_span=16)
    rid = engine.submit(prompt, **settings)[0]
    return engine.run()[rid]


def _assert_same_output(out, expected):
    assert out.tokens == expected.tokens and out.finish_reason == expected.finish_reason
    np.testing.assert_allclose(out.logprobs, expected.logprobs, atol=1e-6)


def test_slots_are_reused_without_recompiling(model, monkeypatch):
    """After one warm-up pass, further requests compile no prefill or insert; decode chunks
    exist once per (slot bucket, KV span) pair run (4 slots, and 2 and 1 once the tail is
    compacted; spans 16, 24, 32, 48) and shrinking once per slot bucket."""
    fixed = (engine_programs.prefill, engine_programs.insert)
    decode, take = engine_programs.decode_chunk, engine_programs.take_slots
    before = decode._cache_size(), take._cache_size()
    chunks = set()
    monkeypatch.setattr(engine_programs, "decode_chunk", lambda graphdef, weights, state, *a, **k:
                        chunks.add((state.length.shape[0], k["span"]))
                        or decode(graphdef, weights, state, *a, **k))
    rng = np.random.default_rng(1)

    def serve(engine):
        ids = [engine.submit(rng.integers(4, 96, int(rng.integers(1, 16))).tolist(),
                             max_new_tokens=int(rng.integers(1, 24)), temperature=1.0,
                             top_p=float(rng.choice([1.0, 0.8])), seed=i)[0] for i in range(12)]
        outputs = engine.run()
        assert sorted(outputs) == sorted(ids)
        assert all(o.finish_reason == "length" for o in outputs.values())

    engine = Engine(model, num_slots=4, max_length=48, chunk_steps=4, min_span=16)
    serve(engine)  # warm-up: 12 requests through 4 slots
    compiled = [p._cache_size() for p in fixed]
    serve(engine)
    serve(Engine(model, num_slots=4, max_length=48, chunk_steps=4, min_span=16))
    assert [p._cache_size() for p in fixed] == compiled
    assert {span for _, span in chunks} == {16, 24, 32, 48} and {rows for rows, _ in chunks} > {4}
    assert decode._cache_size() - before[0] <= len(chunks)  # (earlier tests compiled some)
    assert take._cache_size() - before[1] <= 2  # slot buckets 2 and 1
    assert engine.stats["shrinks"] > 0


@pytest.mark.parametrize("free", [None, 10 ** 12, 1])
def test_the_tail_is_gathered_only_where_its_rows_fit_beside_the_slots(model, reference,
                                                                        monkeypatch, free):
    """Free device memory unreported (CPU) or ample: the tail's rows are gathered into a smaller
    slot bucket; one byte free: they are not (the gather holds them beside every slot's cache).
    The tokens are `generate`'s either way."""
    monkeypatch.setattr(engine_module, "device_free_bytes", lambda devices: free)
    engine = Engine(model, num_slots=4, max_length=64, chunk_steps=4)
    outputs = _serve(engine, range(10))
    for i, ref in enumerate(reference):
        assert outputs[i].tokens == ref.tokens[0], i
    gathered = free != 1
    assert (engine.stats["shrinks"] > 0) == gathered
    assert (engine.stats["shrinks_skipped"] > 0) != gathered


@pytest.mark.parametrize("paging, on_mesh", [
    ({}, False), pytest.param(dict(kv_pages=8, page_size=8), False, marks=pytest.mark.slow),
    (dict(kv_pages=64, page_size=8), True)])
def test_precompile_leaves_serving_nothing_to_compile(model, hf_moe_dir, reference, paging,
                                                       on_mesh):
    """One device, 4 slots of 64 positions, prefill pieces of 16: 3 slot buckets (4, 2, 1) x
    5 spans (16, 24, 32, 48, 64) = 15 decode chunks, gathers 4->2, 4->1, 2->1, 2 put-backs;
    prompt buckets 16, 24, 32 x batch buckets 1, 2, 4: 9 first pieces, 6 second (24 and 32
    tokens take two), 9 inserts; 44 programs. Or 8 slots on an 8-device
    mesh with a paged pool per batch shard (arguments placed on the mesh as serving places
    them). Serving the requests afterwards (a pool of 64 positions preempts some) compiles no
    engine program and gives `generate`'s tokens."""
    lengths = [len(r["prompt"]) for r in REQUESTS] + [32]
    if on_mesh:
        mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 1, "expert": 2})
        engine = Engine(from_pretrained(hf_moe_dir, mesh=mesh), num_slots=8, max_length=64,
                        chunk_steps=4, min_span=16, mesh=mesh, **paging)
        compile_ahead(engine, lengths, threads=2)
    else:
        engine = Engine(model, num_slots=4, max_length=64, chunk_steps=4, min_span=16,
                        prefill_chunk=16, **paging)
        assert compile_ahead(engine, lengths, threads=2) == 44
        with pytest.raises(ValueError, match=r"prompt_lengths: each must be in \[1, max_le"):
            compile_ahead(engine, [0, 65])
    with compiled_programs() as compiled:
        outputs = _serve(engine, range(10))
    assert not ENGINE_PROGRAMS.intersection(compiled)
    for i, ref in enumerate(reference):
        assert outputs[i].tokens == ref.tokens[0], i
    assert on_mesh or engine.stats["shrinks"] > 0
    assert not paging or on_mesh or engine.stats["preemptions"] > 0


@pytest.mark.parametrize("kwargs, message", [
    (dict(prompt_ids=[]), "at least one token"),
    (dict(prompt_ids=[1000]), "token ids must be in"),
    (dict(max_new_tokens=60), "must fit max_length"),
    (dict(top_p=0.0), "0 < top_p"),
    (dict(n=0), "n: need"),
])
def test_bad_requests_name_the_field(model, kwargs, message):
    engine = Engine(model, num_slots=2, max_length=48)
    kwargs = {"prompt_ids": [1, 2], "max_new_tokens": 4, **kwargs}
    with pytest.raises(ValueError, match=message):
        engine.submit(**kwargs)


def test_a_continuation_from_generated_tokens_equals_the_uninterrupted_decode(model):
    prompt = REQUESTS[3]["prompt"]
    settings = dict(max_new_tokens=30, temperature=0.9, top_p=0.9, seed=11, stop_ids=STOP)
    engine = Engine(model, num_slots=2, max_length=64, chunk_steps=4)
    rid = engine.submit(prompt, **settings)[0]
    whole = engine.run()[rid]
    assert len(whole.tokens) > 12
    engine = Engine(model, num_slots=2, max_length=64, chunk_steps=4)
    rid = engine.submit(prompt, generated=(whole.tokens[:12], whole.logprobs[:12]), **settings)[0]
    out = engine.run()[rid]
    assert out.tokens == whole.tokens and out.finish_reason == whole.finish_reason
    np.testing.assert_allclose(out.logprobs, whole.logprobs, atol=1e-5)


@pytest.mark.parametrize("paging", PAGING)
def test_recompute_of_a_decoding_request_equals_a_fresh_prefill_under_new_weights(
        model, tmp_path, paging):
    new_model = from_pretrained(hf_fixtures.save_tiny_hf(tmp_path / "new", moe=True, seed=1))
    """Its KV is the new weights'; its recorded routing stays the old weights' for the positions
    decoded before (the tokens were sampled under it) and is the new weights' after."""
    prompt = REQUESTS[2]["prompt"]
    engine = Engine(model, num_slots=2, max_length=64, chunk_steps=4, record_routing=True,
                    **paging)
    rid = engine.submit(prompt, max_new_tokens=30, temperature=0.0)[0]
    short = engine.submit(REQUESTS[4]["prompt"], max_new_tokens=3, temperature=0.0)[0]
    assert next(engine.stream())[0] == short  # `rid` is mid-decode in its slot
    engine.update_weights(new_model)
    engine.recompute(engine.in_slots())
    done, _ = engine.partial(rid)
    assert engine.in_slots() == [rid] and 0 < len(done) < 30
    sequence = prompt + done
    fresh = new_model.forward(jnp.asarray([sequence], jnp.int32),
                              positions=jnp.arange(len(sequence))[None],
                              mask=AttentionMask.causal(jnp.ones((1, len(sequence)), jnp.int32)),
                              cache=new_model.init_cache(1, len(sequence)), cache_index=0).cache
    for got, want in zip(engine.kv_cache(rid), fresh):
        np.testing.assert_allclose(got.k, np.asarray(want.k[0]), atol=1e-5)
        np.testing.assert_allclose(got.v, np.asarray(want.v[0]), atol=1e-5)
    out = engine.run()[rid]
    continued = generate(new_model, [sequence], max_new_tokens=30 - len(done), temperature=0,
                         record_routing=True)
    assert out.tokens == done + continued.tokens[0]
    before = generate(model, [prompt], max_new_tokens=len(done), temperature=0,
                      record_routing=True)
    assert before.tokens[0] == done
    np.testing.assert_array_equal(out.expert_ids[:, :len(sequence)],
                                  before.expert_ids[0][:, :len(sequence)])
    np.testing.assert_array_equal(out.expert_ids[:, len(sequence):],
                                  continued.expert_ids[0][:, len(sequence):])


def test_prefill_parts_by_hand(model, monkeypatch):
    """Longest first; a part grows while its prompt cache (rows to a power of two, at its first
    sequence's bucket: 24 for 20 tokens, 16 for 12 and fewer) takes at most half the free
    memory, here 2 rows of 24 positions' KV; unreported memory: one part."""
    engine = Engine(model, num_slots=4, max_length=64, chunk_steps=4)
    sequences = [[5] * 5, [5] * 20, [5] * 12, [5] * 3]
    assert engine._prefill_parts(sequences) == [[1, 2, 0, 3]]  # CPU: no memory stats
    free = 2 * (2 * 24 * engine.kv_bytes_per_token)
    monkeypatch.setattr(engine_module, "device_free_bytes", lambda devices: free)
    assert engine._prefill_parts(sequences) == [[1, 2], [0, 3]]
    monkeypatch.setattr(engine_module, "device_free_bytes", lambda devices: 0)
    assert engine._prefill_parts(sequences) == [[1], [2], [0], [3]]


@pytest.mark.parametrize("paging", PAGING)
def test_an_admission_prefilled_in_parts_gives_generates_tokens(model, reference, monkeypatch,
                                                               paging):
    """No free memory reported: each admitted prompt is prefilled alone (and queued ones ahead),
    each request inserted once its prompt is; the tokens are `generate`'s."""
    monkeypatch.setattr(engine_module, "device_free_bytes", lambda devices: 0)
    engine = Engine(model, num_slots=4, max_length=64, chunk_steps=4, admit_batch=3,
                    prefill_ahead=4, **paging)
    outputs = _serve(engine, range(10))
    for i, ref in enumerate(reference):
        assert outputs[i].tokens == ref.tokens[0], i
    assert engine.stats["prefill_calls"] == engine.stats["prefills"]


def test_a_recompute_in_parts_continues_every_request_as_in_one_prefill(model, monkeypatch):
    """Four requests mid-decode re-prefilled one per call (no free memory reported) or all in
    one: the same tokens, and as many prefill calls as parts."""
    def run(free):
        monkeypatch.setattr(engine_module, "device_free_bytes", lambda devices: free)
        engine = Engine(model, num_slots=4, max_length=64, chunk_steps=4)
        ids = [engine.submit(REQUESTS[i]["prompt"], max_new_tokens=20, temperature=0.8,
                             seed=i)[0] for i in range(4)]
        engine._step()
        in_slots = engine.in_slots()
        calls = engine.stats["prefill_calls"]
        engine.recompute(in_slots)
        calls = engine.stats["prefill_calls"] - calls
        outputs = engine.run()
        return [outputs[i].tokens for i in ids], len(in_slots), calls

    whole, held, one_call_each_bucket = run(None)
    parts, _, calls = run(0)
    assert parts == whole and held == 4
    assert calls == held > one_call_each_bucket


@pytest.mark.parametrize("paging", PAGING)
def test_after_free_kv_the_requests_in_slots_go_on_as_after_a_recompute(model, paging):
    """The cache's arrays are deleted; the next decode allocates it and re-prefills the
    requests holding slots: the tokens of a run that recomputed them instead."""
    def run(free):
        engine = Engine(model, num_slots=4, max_length=64, chunk_steps=4, **paging)
        ids = [engine.submit(REQUESTS[i]["prompt"], max_new_tokens=20, temperature=0.0)[0]
               for i in range(6)]
        engine._step()
        held = engine.in_slots()
        if free:
            cache = jax.tree.leaves((engine.state.cache, engine.pool))
            engine.free_kv()
            assert all(array.is_deleted() for array in cache)
        else:
            engine.recompute(held)
        outputs = engine.run()
        return [outputs[i].tokens for i in ids], held

    recomputed, held = run(free=False)
    freed, _ = run(free=True)
    assert len(held) == 4 and freed == recomputed


def test_update_weights_drops_a_group_prefill_made_under_the_old_weights(model, tmp_path):
    new_model = from_pretrained(hf_fixtures.save_tiny_hf(tmp_path / "new", moe=True, seed=1))
    prompt = REQUESTS[5]["prompt"]
    engine = Engine(model, num_slots=1, max_length=64, chunk_steps=4)
    first, second = engine.submit(prompt, max_new_tokens=5, temperature=0.0, n=2)
    assert next(engine.stream())[0] == first  # `second` waits with the old prefill
    engine.update_weights(new_model)
    out = engine.run()[second]
    assert out.tokens == generate(new_model, [prompt], max_new_tokens=5,
                                  temperature=0).tokens[0]


@pytest.mark.parametrize("pages, order, kernel, scan", [
    (64, range(10), "gather", False), (8, [3, 8, 0, 5, 9, 1, 6, 2, 7, 4], "gather", True),
    (8, range(10), "interpret", False)])
def test_a_paged_cache_gives_generates_tokens(model, reference, pages, order, kernel, scan):
    """64 pages of 8 hold every request at once; 8 pages (64 positions) hold about one, so
    requests are preempted and re-prefilled from their tokens: the outputs stay `generate`'s,
    with the pages gathered for attention or read by the Pallas GPU kernel (interpreted), the
    layers unrolled or scanned, and the routing recorded before a preemption put back in the
    new slot."""
    engine = Engine(model, num_slots=4, max_length=64, chunk_steps=4, min_span=16,
                    kv_pages=pages, page_size=8, paged_attention=kernel, record_routing=True,
                    scan_layers=scan)
    outputs = _serve(engine, order)
    for i, ref in enumerate(reference):
        assert outputs[i].tokens == ref.tokens[0], i
        np.testing.assert_allclose(outputs[i].logprobs, ref.logprobs[0], atol=1e-5)
        np.testing.assert_array_equal(outputs[i].expert_ids, ref.expert_ids[0])
    assert (engine.stats["preemptions"] > 0) == (pages == 8)
    assert sorted(engine.page_table.free[0]) == list(range(1, pages + 1))
    assert engine.state.cache == ()
    assert engine.kv_bytes == engine.kv_bytes_per_token * 8 * (pages + 1) == (
        engine.pool.k.nbytes + engine.pool.v.nbytes)


def test_paged_admission_leaves_the_running_requests_their_next_chunk(model):
    """4 pages of 8. After A's first chunk (8 + 8 positions, 2 pages) its next chunk needs a
    third; B's first chunk needs 2 of the 2 left, so B waits for A (admitting it would have it
    preempted, its prefill wasted, before it decoded a token)."""
    rng = np.random.default_rng(1)
    prompt_a, prompt_b = rng.integers(4, 96, 8).tolist(), rng.integers(4, 96, 8).tolist()
    settings = dict(max_new_tokens=24, temperature=0.0)
    engine = Engine(model, num_slots=2, max_length=64, chunk_steps=8, min_span=16, kv_pages=4,
                    page_size=8)
    a = engine.submit(prompt_a, **settings)[0]
    chunks = iter([False, True])
    assert not dict(engine.stream(stop=lambda: next(chunks)))  # one chunk: A half done
    b = engine.submit(prompt_b, **settings)[0]
    outputs = engine.run()
    assert engine.stats["preemptions"] == 0 and engine.stats["prefills"] == 2
    _assert_same_output(outputs[a], _alone(model, prompt_a, chunk_steps=8, **settings))
    _assert_same_output(outputs[b], _alone(model, prompt_b, chunk_steps=8, **settings))


@pytest.mark.parametrize("axes, pool_spec, kernel", [
    (dict(data=1, fsdp=1, tensor=2, expert=1), (None, "tensor"), "gather"),  # KV heads split
    (dict(data=2, fsdp=2, tensor=1, expert=2), (("data", "fsdp", "expert"),), "interpret"),
])
def test_a_paged_cache_on_a_mesh(hf_moe_dir, reference, axes, pool_spec, kernel):
    """A pool per batch shard of the slots (its pages on that shard's chips), KV heads split
    inside each. 16 slots over 64 pages of 8: one pool of 64, or 8 pools of 8 for 2 slots
    each, which hold fewer positions than their two slots' longest requests; the kernel runs
    on each shard's rows and pool (`shard_map`). The tail's rows are gathered into fewer slots
    (8 pools: shard by shard, each row staying in its pool's block)."""
    devices = jax.devices()[:math.prod(axes.values())]
    mesh = sharding.make_mesh(axes, devices=devices)
    sharded = from_pretrained(hf_moe_dir, mesh=mesh)
    engine = Engine(sharded, num_slots=16, max_length=64, chunk_steps=4, mesh=mesh, min_span=16,
                    kv_pages=64, page_size=8, paged_attention=kernel)
    assert tuple(engine.pool.k.sharding.spec)[:len(pool_spec)] == pool_spec
    outputs = _serve(engine, range(10))
    for i, ref in enumerate(reference):
        assert outputs[i].tokens == ref.tokens[0], i
        np.testing.assert_allclose(outputs[i].logprobs, ref.logprobs[0], atol=1e-5)
    assert engine.stats["shrinks"] > 0
    if engine.batch_shards > 1:
        with pytest.raises(ValueError, match="kv_pages: 60 is not a multiple"):
            Engine(sharded, num_slots=16, max_length=64, mesh=mesh, kv_pages=60)


def test_a_request_larger_than_the_page_pool_is_refused(model):
    engine = Engine(model, num_slots=2, max_length=64, kv_pages=4, page_size=8)
    with pytest.raises(ValueError, match="must fit kv_pages"):
        engine.submit([1, 2, 3], max_new_tokens=30)
