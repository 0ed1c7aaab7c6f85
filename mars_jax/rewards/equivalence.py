"""The full answer-equivalence check: math-verify plus our normalisation.

It has no time bound of its own: it runs inside the grader workers (`grader_worker`), which bound
every call. Math-verify never evaluates text (an ANTLR grammar into sympy objects, or regex-checked
digits).
"""

from __future__ import annotations

import functools
import logging

from math_verify import parse, verify

from mars_jax.rewards import normalize

# Our workers bound time themselves; math-verify's own alarm-based timeouts are off.
_PARSE = dict(parsing_timeout=None)
_VERIFY = dict(timeout_seconds=None)

logging.getLogger("math_verify").setLevel(logging.ERROR)


@functools.lru_cache(maxsize=8192)
def _parse_gold(gold: str) -> list:
    """Parsed gold answer; golds repeat across a batch, so they are cached."""
    return parse(normalize.for_math_verify(gold), **_PARSE)


def _parse_pred(pred: str) -> list:
    return parse(normalize.for_math_verify(pred), **_PARSE)


def equivalent(pred: str, gold: str) -> bool:
    """Whether answer `pred` is mathematically equivalent to reference `gold`:
    `normalize.quick_verdict`, math-verify on both, then a decimal comma
    (`normalize.comma_decimal`) and a correctly rounded decimal (`0.3333` = 1/3) when every
    decimal in `pred` has at least `normalize.MIN_ROUNDED_SIG_DIGITS` significant digits."""
    quick = normalize.quick_verdict(pred, gold)
    if quick is not None:
        return quick
    gold_parsed = _parse_gold(gold)
    pred_parsed = _parse_pred(pred)
    if not gold_parsed or not pred_parsed:
        return False
    if verify(gold_parsed, pred_parsed, **_VERIFY):
        return True
    gold_comma, pred_comma = normalize.comma_decimal(gold), normalize.comma_decimal(pred)
    if gold_comma or pred_comma:
        gold_alt = _parse_gold(gold_comma) if gold_comma else gold_parsed
        pred_alt = _parse_pred(pred_comma) if pred_comma else pred_parsed
        if verify(gold_alt, pred_alt, **_VERIFY):
            return True
    # math-verify's last parse result is the extracted answer text.
    extracted = pred_parsed[-1] if isinstance(pred_parsed[-1], str) else pred
    decimals = normalize.decimal_literals(extracted)
    if decimals and min(sig for _, sig in decimals) >= normalize.MIN_ROUNDED_SIG_DIGITS:
        places = min(frac for frac, _ in decimals)
        return verify(gold_parsed, pred_parsed, float_rounding=places, **_VERIFY)
    return False


def warm_up() -> None:
    """Load the LaTeX grammar and sympy caches so the first real call is fast."""
    equivalent("\\sqrt{2}/2", "\\frac{\\sqrt{2}}{2}")
    equivalent("x^2+1", "1+x^{2}")
