"""The bars a benchmark sets itself, judged in one place: each printed as met or MISSED and by how much,
then one verdict line; the exit status is 1 when any bar is missed, 0 when all are met.

    from bars import Bar, judge            # a script in benchmarks/ (its directory is on sys.path)
    sys.exit(judge([Bar("calibrated step time: worst |error|", 0.423, 0.35)]))

prints

    calibrated step time: worst |error| 42.3% (bar ≤ 35.0%): MISSED by 7.3 points
    FAIL: 1 of 1 bars missed (calibrated step time: worst |error|)

A run that judges nothing (a subset of a benchmark's configs, whose bars are for the whole set) says so
with ``not_judged`` instead of passing in silence.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Bar:
    what: str  # what is measured, e.g. "calibrated step time: worst |error|"
    value: float
    limit: float
    at_most: bool = True  # met when value ≤ limit; False: met when value ≥ limit
    unit: str = "%"  # "%": fractions shown in percent (a miss in points); "s", "ms", "x": as they are

    @property
    def met(self) -> bool:
        return self.value <= self.limit if self.at_most else self.value >= self.limit

    def _fmt(self, x: float) -> str:
        if self.unit == "%":
            return f"{x:.1%}"
        if self.unit == "ms":
            return f"{x * 1e3:.1f} ms"
        if self.unit == "s":
            return f"{x:.3f} s"
        return f"{x:.2f}{self.unit}"

    def line(self) -> str:
        sign = "≤" if self.at_most else "≥"
        head = f"{self.what} {self._fmt(self.value)} (bar {sign} {self._fmt(self.limit)})"
        if self.met:
            return f"{head}: met"
        miss = abs(self.value - self.limit)
        by = f"{miss * 100:.1f} points" if self.unit == "%" else self._fmt(miss)
        return f"{head}: MISSED by {by}"


def judge(bars: list[Bar], out=None) -> int:
    """Print every bar and the verdict; 1 when any bar is missed, else 0."""
    out = out or sys.stdout
    for bar in bars:
        print(bar.line(), file=out)
    missed = [b for b in bars if not b.met]
    if missed:
        print(f"FAIL: {len(missed)} of {len(bars)} bars missed ({'; '.join(b.what for b in missed)})", file=out)
        return 1
    print(f"PASS: all {len(bars)} bars met", file=out)
    return 0


def not_judged(why: str, out=None) -> int:
    """A run whose bars do not apply: say so (never a silent pass) and return 0."""
    print(f"bars not judged: {why}", file=out or sys.stdout)
    return 0
