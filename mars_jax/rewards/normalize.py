"""Cheap, pure-Python answer handling that runs before (and around) math-verify.

`cost_reason` turns away what would make sympy slow, `quick_verdict` decides obvious pairs, the rest
normalise where math-verify falls short. Numbers are read from regex-checked digits only.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

from mars_jax.rewards.text import last_boxed

MAX_INPUT_CHARS = 20_000  # per side of an equivalence check (whole solutions fit)
MAX_BRACE_DEPTH = 64  # for {}, () and [] alike
MAX_OPERATORS = 256  # math-verify's parser gives up on longer chains and keeps only the last number
MAX_DIGITS = 10_000  # largest number (in decimal digits) a power may produce
MAX_FACTORIAL = 2_000
MIN_ROUNDED_SIG_DIGITS = 4  # a rounded decimal must carry this many significant digits

_OPERATOR = re.compile(r"[-+*/^=]|\\(?:cdot|times|div|pm)(?![a-zA-Z])")
_GROUPING = re.compile(r"[{}\s]")
# Both start only at the first digit of a run (`(?<!\d)`): without it, every digit of a
# long run is a start that scans the rest of the run, quadratic in its length.
_POWER_CHAIN = re.compile(r"(?<!\d)\d+(?:\.\d+)?(?:\^-?\d+(?:\.\d+)?)+")
_FACTORIAL = re.compile(r"(?<!\d)(\d+)\s*!")
_MATH_DELIMITER = re.compile(r"(?<!\\)\$|\\\(|\\\[|\\boxed|\\fbox")
_SPACE_THOUSANDS = re.compile(r"[+-]?\d{1,3}(?: \d{3})+(?:\.\d+)?")
_COMMA_DECIMAL = re.compile(r"([+-]?\d+),(\d{2}|\d{4,})")
_DECIMAL_LITERAL = re.compile(r"(?<![\d.])\d*\.(\d+)(?![\d.])")

# A run of whitespace, spacing commands and `\left`/`\right`: one space in `canonical`.
_SPACING = re.compile(r"(?:\\left(?![a-zA-Z])|\\right(?![a-zA-Z])|\\displaystyle|\\[!,;: ]|~|\s)+")
_FRAC_VARIANT = re.compile(r"\\[dtc]frac(?![a-zA-Z])")
_SPACE_NOT_BETWEEN_DIGITS = re.compile(r"(?<!\d) | (?!\d)")
_BASE_NUMBER = re.compile(r"([0-9A-Za-z]+)_\{?(\d{1,2})\}?")

_INTEGER = re.compile(r"[+-]?(?:[1-9]\d{0,2}(?:,\d{3})+|\d+)")
_DECIMAL = re.compile(r"[+-]?(?:[1-9]\d{0,2}(?:,\d{3})+|\d*)\.\d+")
_FRACTION = re.compile(r"([+-]?)(?:\\frac\{(\d+)\}\{(\d+)\}|(\d+)/(\d+))")
_MAX_NUMBER_CHARS = 200


def cost_reason(text: str) -> str | None:
    """Why `text` is too costly to hand to sympy, or None when it is fine."""
    if len(text) > MAX_INPUT_CHARS:
        return f"longer than {MAX_INPUT_CHARS} characters"
    if sum(text.count(c) for c in "{([") > MAX_BRACE_DEPTH and _brace_depth(text) > MAX_BRACE_DEPTH:
        return f"brackets nested deeper than {MAX_BRACE_DEPTH}"
    if len(_OPERATOR.findall(text)) > MAX_OPERATORS:
        return f"more than {MAX_OPERATORS} operators"
    if "^" in text or "**" in text:
        flat = _GROUPING.sub("", text.replace("**", "^"))
        for chain in _POWER_CHAIN.finditer(flat):
            if _power_digits(chain.group().split("^")) > MAX_DIGITS:
                return f"power {chain.group()[:40]} has more than {MAX_DIGITS} digits"
    if "!" in text:
        for match in _FACTORIAL.finditer(text):
            if len(match.group(1)) > 5 or int(match.group(1)) > MAX_FACTORIAL:
                return f"factorial of {match.group(1)[:20]} is too large"
    return None


def _brace_depth(text: str) -> int:
    """Deepest nesting of `{`, `(` and `[` in `text` (closers of any kind close)."""
    depth = deepest = 0
    for char in text:
        if char in "{([":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "})]":
            depth -= 1
    return deepest


def _power_digits(parts: list[str]) -> float:
    """Decimal digits (of the number or of its reciprocal) of the right-associative tower
    parts[0]^parts[1]^..., or inf. Signs are ignored: 10^{-10^{10}} is as costly."""
    exponent = abs(float(parts[-1])) if len(parts[-1]) < 300 else math.inf
    digits = 0.0
    for base_text in reversed(parts[:-1]):
        base = abs(float(base_text)) if len(base_text) < 300 else math.inf
        if base <= 1.0:
            return 1.0
        digits = exponent * math.log10(base)
        if digits > MAX_DIGITS:
            return math.inf
        exponent = 10.0**digits if digits < 300 else math.inf
    return digits


def _unwrap(text: str) -> str:
    """Strip whitespace, outer `$` delimiters and whole-string `\\boxed{}` wrappers."""
    for _ in range(4):
        text = text.strip()
        inner = text.strip("$")
        if len(inner) < len(text) and text.startswith("$") and text.endswith("$") and "$" not in inner:
            text = inner
            continue
        if text.startswith(("\\boxed", "\\fbox")) and text.endswith("}"):
            inner = last_boxed(text)
            # The whole string is one box iff the last box's content starts at the first brace.
            if inner is not None and len(text) - len(inner) - 1 == text.index("{") + 1:
                text = inner
                continue
        break
    return text.strip()


def canonical(text: str) -> str:
    """`text` without cosmetic differences: outer `$`/`\\boxed{}`, `\\left`/`\\right`,
    spacing commands, `\\dfrac`/`\\tfrac`, `^{\\circ}` braces, a final period, and
    whitespace except between two digits (`2 3`, `2  3` and `2\\,3` are not `23`)."""
    text = _SPACING.sub(" ", _unwrap(text))
    text = _FRAC_VARIANT.sub(r"\\frac", text).replace("^{\\circ}", "^\\circ")
    return _SPACE_NOT_BETWEEN_DIGITS.sub("", text).rstrip(".")


def base_number(text: str) -> tuple[str, int] | None:
    """(digits, base) of a number written with its base (`2516_8`, `204_{5}`), else None."""
    match = _BASE_NUMBER.fullmatch(canonical(text))
    return (match.group(1), int(match.group(2))) if match else None


def _value_in_base(digits: str, base: int) -> int | None:
    """Value of `digits` in `base`, or None if they are not a valid numeral there."""
    if not 2 <= base <= 36:
        return None
    try:
        return int(digits, base)
    except ValueError:
        return None


def plain_number(text: str) -> tuple[Fraction, int] | None:
    """(value, digits after the point) of a plain integer, decimal or integer fraction read after
    `canonical` (signs, leading zeros, thousands separators, `\\$`, `\\frac{a}{b}`, `a/b`), else
    None."""
    text = canonical(text).replace("{,}", ",").replace("\\$", "")
    if _SPACE_THOUSANDS.fullmatch(text):
        text = text.replace(" ", "")
    if not text or len(text) > _MAX_NUMBER_CHARS:
        return None
    if _INTEGER.fullmatch(text):
        return Fraction(int(text.replace(",", ""))), 0
    if _DECIMAL.fullmatch(text):
        return Fraction(text.replace(",", "")), len(text) - text.index(".") - 1
    match = _FRACTION.fullmatch(text)
    if match:
        sign, num, den = match.group(1), match.group(2) or match.group(4), match.group(3) or match.group(5)
        if int(den) == 0:
            return None
        value = Fraction(int(num), int(den))
        return (-value if sign == "-" else value), 0
    return None


def quick_verdict(pred: str, gold: str) -> bool | None:
    """A verdict needing no sympy, or None. False: a side empty or too costly. True: identical
    after `canonical`. Based numbers on both sides: equal values (False for decimal digits
    invalid in the base). Plain numbers: True if equal, False if they differ and neither is a
    decimal, or differ by more than any accepted rounding."""
    if cost_reason(pred) or cost_reason(gold):
        return False
    pred_core, gold_core = _unwrap(pred), _unwrap(gold)
    if not pred_core or not gold_core:
        return False
    if canonical(pred_core) == canonical(gold_core):
        return True
    pred_base, gold_base = base_number(pred_core), base_number(gold_core)
    if pred_base is not None and gold_base is not None:
        pred_numeral, gold_numeral = _value_in_base(*pred_base), _value_in_base(*gold_base)
        if pred_numeral is not None and gold_numeral is not None:
            return pred_numeral == gold_numeral
        # `2516_6` (no base-6 numeral) is wrong, and math-verify would drop its base;
        # `a_5` (a subscripted name) is left to math-verify.
        if pred_base[0].isdigit() or gold_base[0].isdigit():
            return False
    pred_num, gold_num = plain_number(pred_core), plain_number(gold_core)
    if pred_num is None or gold_num is None:
        return None
    (pred_value, pred_places), (gold_value, gold_places) = pred_num, gold_num
    if pred_value == gold_value:
        return True
    if not pred_places and not gold_places:
        return False
    # Decimals may be rounded: to 6 places (math-verify) or to the pred's places (ours).
    # Farther apart than either allows is a sure False.
    tolerance = max(Fraction(1, 10**6), Fraction(1, 10**pred_places) if pred_places else 0)
    return False if abs(pred_value - gold_value) > tolerance else None


def for_math_verify(text: str) -> str:
    """`text` prepared for `math_verify.parse`: passed as is when it has math delimiters (`$`,
    `\\(`, `\\[`, `\\boxed`); else `\\$` signs and space thousands separators removed and wrapped
    in `$...$`, since math-verify does not extract bare LaTeX."""
    if _MATH_DELIMITER.search(text):
        return text
    bare = text.strip().replace("\\$", "")
    if _SPACE_THOUSANDS.fullmatch(bare):
        bare = bare.replace(" ", "")
    return f"${bare}$"


def comma_decimal(text: str) -> str | None:
    """`1,22` read with a decimal comma (`1.22`), or None: only a comma followed by two or by
    four or more digits (`-2,1` is a list, `1,000` a thousands separator)."""
    match = _COMMA_DECIMAL.fullmatch(_unwrap(text))
    return f"{match.group(1)}.{match.group(2)}" if match else None


def decimal_literals(text: str) -> list[tuple[int, int]]:
    """(fractional digits, significant digits) of each decimal literal in `text`."""
    found = []
    for match in _DECIMAL_LITERAL.finditer(text):
        digits = match.group().replace(".", "").lstrip("0")
        found.append((len(match.group(1)), len(digits)))
    return found
