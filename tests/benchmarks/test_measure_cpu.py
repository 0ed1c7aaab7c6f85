"""measure_cpu's span grid: each labelled KV span is the span the engine decodes over."""
import pytest

from benchmarks.sim.measure_cpu import chunk_spans, prompt_length, span_error
from mars_jax.models import create_model, get_preset
from mars_jax.sampling import Engine


@pytest.mark.parametrize("span", [128, 512, 2048])
def test_default_spans_are_the_spans_decoded(span):
    # measure_cpu's defaults: --steps=32, --max_length=2432, chunks of 16.
    assert span_error(span, 32, 2432) is None
    assert chunk_spans(prompt_length(span, 32), 32, 2432) == (span, span)


def test_prompts_of_half_the_span_decode_over_a_smaller_bucket():
    # What the grid measured before the 2^k / 3 * 2^(k-1) buckets were taken as labelled.
    assert chunk_spans(256, 32, 2432) == (384, 384)
    assert chunk_spans(1024, 32, 2432) == (1536, 1536)


def test_a_span_between_buckets_is_refused():
    assert "(192, 256)" in span_error(200, 32, 2432)


@pytest.mark.parametrize("prompt_len", [128, prompt_length(256, 8)])
def test_chunk_spans_are_the_engine_spans(prompt_len):
    engine = Engine(create_model(get_preset("tiny"), seed=0), num_slots=2, max_length=320,
                    chunk_steps=4)
    spans, span = [], engine._span
    engine._span = lambda: spans.append(span()) or spans[-1]
    engine.submit(list(range(1, prompt_len + 1)), max_new_tokens=8, seed=0)
    engine.run()
    low, high = chunk_spans(prompt_len, 8, 320, chunk_steps=4)
    assert spans and min(spans) == low and max(spans) == high
