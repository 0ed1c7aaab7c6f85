"""A static decode's rows capped by free memory: the per-row estimate against XLA's own analysis
of the compiled program, and a call far larger than memory allows in one program decoded in
several, each under the cap, to the tokens one program gives."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mars_jax.models.presets import get_preset
from mars_jax.models.qwen3 import Qwen3
from mars_jax.sampling import EngineSettings, decode_batch, make_engine, sampler
from mars_jax.sampling.batch_memory import static_fixed_bytes, static_row_bytes


@pytest.fixture(scope="module")
def model():
    return Qwen3(get_preset("tiny"), rngs=nnx.Rngs(0))


def test_row_estimate_bounds_the_compiled_program(model):
    rows, prompt_len, num_new, routing = 4, 96, 32, True
    graphdef, weights = nnx.split(model)
    params = sampler.SamplingParams(greedy=False, top_k=0, top_p=1.0, record_routing=routing)
    args = (np.zeros((rows, prompt_len), np.int32), np.ones((rows, prompt_len), np.int32),
            np.full((rows,), num_new, np.int32), np.full((rows, 1), -1, np.int32),
            jax.random.split(jax.random.key(0), rows))
    compiled = sampler.prefill_and_decode.lower(
        graphdef, weights, *args, jnp.float32(1.0), jnp.int32(num_new), num_new=num_new,
        params=params).compile()
    xla = compiled.memory_analysis()
    taken = xla.temp_size_in_bytes + xla.output_size_in_bytes
    estimate = (rows * static_row_bytes(model.config, prompt_len, num_new, record_routing=routing)
                + static_fixed_bytes(model.config, prompt_len))
    assert taken <= estimate


def test_rows_fit_half_the_free_memory(model):
    per_row = static_row_bytes(model.config, 64, 16, record_routing=False)
    rows = lambda free: sampler.static_rows(model.config, 1000, 64, 16, record_routing=False,
                                            mesh=None, free=free)
    assert rows(None) == 1000
    assert rows(2 * 1024 * per_row) == 1000   # its bucket, 1024 rows, fits
    assert rows(2 * 1023 * per_row) == 512
    assert rows(2 * 37 * per_row) == 32
    assert rows(0) == 1                        # never fewer than the batch shards


def test_a_call_far_over_memory_decodes_in_capped_programs(model, monkeypatch):
    """16 requests (one prompt bucket) with room for 2.5 rows: 8 programs of 2 rows, and each
    request gets the tokens one 16-row program gives it."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 500, size=int(rng.integers(25, 33))).tolist() for _ in range(16)]
    budgets = [int(b) for b in rng.integers(1, 16, size=16)]
    decode = lambda: decode_batch(make_engine(EngineSettings(kind="generate", seed=7), model, ()),
                                  prompts, budgets, stop_ids=(3,), first_seed=0,
                                  temperature=1.0, top_p=1.0)
    monkeypatch.setattr(sampler, "_free_bytes", lambda mesh: None)
    whole = decode()
    per_row = static_row_bytes(model.config, sampler.prompt_bucket(32),
                               sampler.new_tokens_bucket(15), record_routing=False)
    monkeypatch.setattr(sampler, "_free_bytes", lambda mesh: 5 * per_row)
    batches = []
    program = sampler.prefill_and_decode

    def recorded(graphdef, weights, tokens, *args, **kwargs):
        batches.append(tokens.shape[0])
        return program(graphdef, weights, tokens, *args, **kwargs)

    monkeypatch.setattr(sampler, "prefill_and_decode", recorded)
    capped = decode()
    assert batches == [2] * 8
    assert [o.tokens for o in capped] == [o.tokens for o in whole]
    np.testing.assert_allclose(np.concatenate([o.logprobs for o in capped]),
                               np.concatenate([o.logprobs for o in whole]), rtol=1e-6, atol=1e-6)
