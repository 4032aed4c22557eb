"""Parsing and printing of sizes (bytes) and counts (tokens, parameters).

Sizes follow the IEC/SI split exactly: ``GB`` is 10**9 bytes, ``GiB`` is 2**30 bytes.
Counts accept ``k``/``m``/``b`` suffixes as powers of 1000, except context lengths, where
``8k`` means 8192 (``parse_count(..., binary=True)``), as everyone writes them.
"""

from __future__ import annotations

import difflib
import math
import re
from fractions import Fraction

from memplan.errors import InputError

KiB, MiB, GiB, TiB = 2**10, 2**20, 2**30, 2**40

_SIZE_UNITS = {
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": KiB, "mib": MiB, "gib": GiB, "tib": TiB,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")
_COUNT_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kKmMbBtT]?)\s*$")
_DECIMAL_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}
_BINARY_SUFFIX = {"": 1, "k": 2**10, "m": 2**20}


def parse_size(text: str | int, what: str = "size") -> int:
    """Bytes from ``"512MiB"``, ``"4GiB"``, ``"24GB"``, ``"1.5 TB"`` or a plain integer."""
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(str(text))
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _SIZE_UNITS:
        raise InputError(
            f"{what}: {text!r} is not a size; use a number with a unit such as 512MiB, 4GiB or 24GB "
            "(GB = 10^9 bytes, GiB = 2^30 bytes)"
        )
    value = float(m.group(1)) * _SIZE_UNITS[unit]
    if value <= 0:
        raise InputError(f"{what}: {text!r} must be positive")
    return int(round(value))


def parse_count(text: str | int, what: str = "count", *, binary: bool = False, minimum: int = 1) -> int:
    """A positive integer from ``"8192"``, ``"8k"``, ``"1.5m"`` or ``"2b"``.

    With ``binary=True`` (context lengths), ``k`` is 1024 and ``m`` is 2**20; otherwise
    the suffixes are decimal (``10m`` tokens is 10,000,000).
    """
    if isinstance(text, int):
        value = text
    else:
        m = _COUNT_RE.match(str(text))
        suffixes = _BINARY_SUFFIX if binary else _DECIMAL_SUFFIX
        suffix = m.group(2).lower() if m else ""
        if not m or suffix not in suffixes:
            example = "8192 or 8k" if binary else "1000000, 1m or 2.5b"
            raise InputError(f"{what}: {text!r} is not a count; use an integer such as {example}")
        exact = Fraction(m.group(1)) * suffixes[suffix]  # exact: a float would echo 2**63 - 1 as 2**63
        if exact.denominator != 1:
            raise InputError(f"{what}: {text!r} is not a whole number")
        value = int(exact)
    if value < minimum:
        raise InputError(f"{what}: {text!r} must be at least {minimum}")
    return value


def parse_int(text: str | int, what: str, *, minimum: int = 1, maximum: int | None = None) -> int:
    """A whole number in [minimum, maximum] from an option (``--top 8``): the one rule of every integer
    option, so ``-1``, ``0`` (where 1 is the least), ``1.5`` and ``nan`` are each one InputError line naming
    the flag and the accepted range."""
    accepted = f"a whole number from {minimum:,}" + (f" to {maximum:,}" if maximum is not None else " up")
    if isinstance(text, bool):
        raise InputError(f"{what}: {text!r} is not a whole number; accepted: {accepted}")
    try:
        value = text if isinstance(text, int) else int(str(text).strip())
    except ValueError:
        raise InputError(f"{what}: {text!r} is not a whole number; accepted: {accepted}") from None
    if value < minimum or (maximum is not None and value > maximum):
        raise InputError(f"{what}: {text!r} is out of range; accepted: {accepted}")
    return value


def parse_float(text: str | float, what: str, *, low: float | None = None, high: float | None = None,
                low_open: bool = False, high_open: bool = False, example: str = "") -> float:
    """A finite number in the interval from ``low`` to ``high`` (each end open or closed) from an option:
    ``nan``, ``inf`` and values outside are one InputError line naming the flag and the interval."""
    interval = ("(" if low_open else "[") + ("-inf" if low is None else f"{low:g}") + ", " \
        + ("inf" if high is None else f"{high:g}") + (")" if high_open or high is None else "]")
    accepted = f"a finite number in {interval}" + (f", such as {example}" if example else "")
    try:
        value = float(text) if not isinstance(text, bool) else math.nan
    except (TypeError, ValueError):
        raise InputError(f"{what}: {text!r} is not a number; accepted: {accepted}") from None
    if (not math.isfinite(value) or (low is not None and (value <= low if low_open else value < low))
            or (high is not None and (value >= high if high_open else value > high))):
        raise InputError(f"{what}: {text!r} is out of range; accepted: {accepted}")
    return value


def at_least(minimum: int, maximum: int | None = None):
    """A typer callback for an integer option: ``parse_int``'s range check (``--top -1`` refused)."""
    def check(ctx, param, value):
        if value is None:
            return value
        return parse_int(value, param.opts[0] if param is not None and param.opts else "value",
                         minimum=minimum, maximum=maximum)
    return check


UNIT_RULE = "k, m, b are powers of 1000 in a count; only a context length's k is 1024, as in --ctx 1k = 1024"


def resolved(given: list[tuple[str, str | None, int | None]]) -> str:
    """``--global-batch-tokens 256k = 256,000 (the rule)`` for each (flag, text, value) whose text
    used a suffix (what it resolved to is then worth saying); "" when every number was written out."""
    said = [f"{flag} {str(text).strip()} = {value:,}" for flag, text, value in given
            if text is not None and value is not None and re.search(r"[a-zA-Z]\s*$", str(text))]
    return f"{'; '.join(said)} ({UNIT_RULE})" if said else ""


def format_bytes(n: float) -> str:
    """``1.50 GiB``: binary units, named as such (never "MB" for 2**20)."""
    n = float(n)
    for unit, scale in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def format_count(n: float) -> str:
    """``1.10B``, ``124.4M``, ``22.9M``, ``512K``: short parameter and token counts."""
    n = float(n)
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.{2 if unit in 'TB' else 1}f}{unit}"
    return f"{int(n)}"


def format_flop(n: float) -> str:
    """``56.14 TFLOP``, ``144.96 GFLOP``: a count of floating-point operations with its SI prefix (G, not the
    ``B`` that ``format_count`` gives a billion parameters) and a space before the unit."""
    n = float(n)
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}FLOP"
    return f"{n:.0f} FLOP"


NOT_MEASURED = "not measured"


def measured(value, spec: str = "") -> str:
    """``value`` formatted by ``spec`` (``format(value, spec)``), or "not measured" where a figure is missing:
    None, NaN or infinite (a held-out loss that overflowed its perplexity, a step that measured no rate).
    Every summary, report and log line formats its figures through this, so none crashes on a missing one."""
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return NOT_MEASURED
    return format(value, spec)


def format_seconds(s: float | None) -> str:
    """``850 ms``, ``12.3 s``, ``4.2 min``, ``3.1 h``, ``12.5 days``."""
    if s is None:
        return "-"
    if s < 1:
        return f"{s * 1000:.0f} ms"
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    if s < 3 * 86400:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.1f} days"


def plural(n: int, word: str) -> str:
    """``1 document``, ``2 documents``, ``1,024 documents``."""
    return f"{n:,} {word}" + ("" if n == 1 else "s")


def possessive(name: str) -> str:
    """``memplan's``, ``transformers'`` (a name ending in s takes the apostrophe alone)."""
    return f"{name}'" if name.endswith("s") else f"{name}'s"


def closest(name: str, choices: list[str], n: int = 3) -> list[str]:
    """The closest names to a misspelt one, best first (for "did you mean" hints)."""
    return difflib.get_close_matches(name.lower(), choices, n=n, cutoff=0.4)


def choice_error(what: str, value: str, choices: list[str]) -> InputError:
    """An InputError for an unknown choice, suggesting the closest accepted values."""
    near = closest(value, choices)
    hint = f"; did you mean {', '.join(near)}?" if near else ""
    return InputError(f"{what}: unknown {value!r}{hint} (accepted: {', '.join(choices)})")
