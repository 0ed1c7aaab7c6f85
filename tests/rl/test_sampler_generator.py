"""`SamplerGenerator`: one decode per prompt bucket, outputs back in request order."""
import numpy as np

from mars_jax.models import create_model, get_preset
from mars_jax.rl.rollout import GenerationRequest
from mars_jax.rl.generator import SamplerGenerator
from mars_jax.sampling import generate


def _requests(lengths):
    rng = np.random.default_rng(0)
    prompts = [tuple(int(t) for t in rng.integers(1, 500, size=n)) for n in lengths]
    return [GenerationRequest(role="solver", prompt_ids=p, max_new_tokens=6 + i)
            for i, p in enumerate(prompts)]


def _check_each_equals_its_own_decode(model, requests, outputs):
    for request, output in zip(requests, outputs):
        alone = generate(model, [list(request.prompt_ids)], max_new_tokens=request.max_new_tokens,
                         temperature=0.0)
        assert list(output.token_ids) == list(alone.tokens[0])
        np.testing.assert_allclose(output.logprobs, alone.logprobs[0], atol=1e-5)
        assert len(output.token_ids) == request.max_new_tokens


def _greedy(model, **kwargs):
    return SamplerGenerator(model, (), temperature=0.0, top_p=1.0, top_k=0, seed=0,
                            record_routing=False, **kwargs)


def test_mixed_prompt_lengths_decode_per_bucket_in_request_order():
    model = create_model(get_preset("tiny"), seed=0)
    requests = _requests([5, 40, 7, 300, 33])  # prompt buckets 16, 64, 16, 512, 64
    generator = _greedy(model)
    outputs = generator(requests)
    assert generator.calls == 3
    _check_each_equals_its_own_decode(model, requests, outputs)


def test_max_rows_splits_a_bucket_into_calls():
    model = create_model(get_preset("tiny"), seed=0)
    requests = _requests([5, 9, 7, 12, 3, 40, 6])  # six rows in bucket 16, one in bucket 64
    generator = _greedy(model, max_rows=4)
    outputs = generator(requests)
    assert generator.calls == 3  # bucket 16: 4 + 2 rows; bucket 64: 1 row
    _check_each_equals_its_own_decode(model, requests, outputs)
