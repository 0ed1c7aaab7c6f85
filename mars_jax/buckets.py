"""Shape buckets: the padded sizes programs compile for, so that a few shapes serve all inputs.
Sampling (prompt, budget, batch and KV-span buckets) and the update (batch lengths and
micro-batch counts) round through these two functions."""
from __future__ import annotations


def pow2_at_least(n: int, minimum: int) -> int:
    """max(`minimum`, the smallest power of two >= `n`)."""
    return max(minimum, 1 << max(0, n - 1).bit_length())


def length_bucket(n: int, minimum: int) -> int:
    """`n` rounded up to the next 2^k or 3 * 2^(k-1), at least `minimum`: at most a third of a
    bucket is padding, for two programs per doubling of the length."""
    power = pow2_at_least(n, minimum)
    three_quarters = 3 * power // 4
    return three_quarters if n <= three_quarters and three_quarters >= minimum else power
