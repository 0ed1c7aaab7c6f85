"""Benchmark helpers: token agreement over requested tokens only, and FLOP counts."""
import pytest

from benchmarks.bench_utils import decode_flops, equal_tokens, forward_flops
from mars_jax.models import get_preset


def test_equal_tokens_counts_only_the_tokens_of_each_request():
    assert equal_tokens([[1, 2, 3], [4]], [[1, 2, 0], [4]]) == (3, 4)


def test_equal_tokens_counts_a_missing_token_as_unequal():
    assert equal_tokens([[1, 2]], [[1, 2, 3]]) == (2, 3)


def test_a_causal_forward_costs_its_decode_steps():
    config = get_preset("bench")
    steps = sum(decode_flops(config, 2, keys) for keys in range(1, 65))
    assert forward_flops(config, 2, 64) == pytest.approx(steps)
