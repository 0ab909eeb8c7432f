"""Every number a command takes is finite and in its range, checked as the flag is read.

Each int or float flag of every command names its range in interval notation, in its ``FLAGS`` literal
(``"range": "[1, inf)"``, see :mod:`labkit.flags`) or as its argparse type::

    parser.add_argument("--timeout-s", type=within("float", "(0, 1e7]"), default=1800.0)

A value outside the range, ``nan``, ``inf`` or not a number at all becomes argparse's error for that flag:
one ``labkit: error: argument --timeout-s: must be > 0 and <= 1e+07, got 0`` line and exit code 2, before
anything starts. ``inf`` is only allowed where the interval closes on it (``"[1, inf]"``). No torch here.
"""
from __future__ import annotations

import argparse
import math
import re

from labkit.errors import ConfigError

_INTERVAL = re.compile(r"^\s*([\[(])\s*([^,\s]+)\s*,\s*([^,\s]+)\s*([\])])\s*$")
_KINDS = {"int": int, "float": float}


class Range:
    """A closed or open interval of numbers, parsed from ``"[lo, hi)"``-style text (``inf`` and ``-inf`` allowed)."""

    def __init__(self, text: str):
        match = _INTERVAL.match(text)
        if match is None:
            raise ValueError(f"not an interval: {text!r} (write it like '[1, inf)' or '(0, 1]')")
        left, low, high, right = match.groups()
        self.text, self.low, self.high = text, float(low), float(high)
        self.low_closed, self.high_closed = left == "[", right == "]"
        if not self.low <= self.high:
            raise ValueError(f"empty interval: {text!r}")

    def __contains__(self, value: float) -> bool:
        if math.isnan(value):
            return False
        above = value >= self.low if self.low_closed else value > self.low
        below = value <= self.high if self.high_closed else value < self.high
        return above and below

    def describe(self) -> str:
        """``"> 0"``, ``">= 1 and <= 255"``: the range in words for an error message."""
        parts = []
        if self.low != -math.inf:
            parts.append(f"{'>=' if self.low_closed else '>'} {_number(self.low)}")
        if self.high != math.inf:
            parts.append(f"{'<=' if self.high_closed else '<'} {_number(self.high)}")
        return " and ".join(parts) or "a number"


def _number(value: float) -> str:
    return str(int(value)) if value.is_integer() and abs(value) < 1e16 else f"{value:g}"


def within(kind: str, interval: str):
    """An argparse ``type`` that reads an ``"int"`` or ``"float"`` and refuses what is outside ``interval``.

    Raises:
        ValueError: ``kind`` or ``interval`` is malformed (a mistake in the code, found when the parser is built).
    """
    if kind not in _KINDS:
        raise ValueError(f"kind must be one of {sorted(_KINDS)}, got {kind!r}")
    allowed = Range(interval)

    def convert(text: str):
        try:
            value = _KINDS[kind](text)
        except ValueError:
            what = "a whole number" if kind == "int" else "a number"
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
        if kind == "float" and not math.isfinite(value) and value not in allowed:
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
        if value not in allowed:
            raise argparse.ArgumentTypeError(f"must be {allowed.describe()}, got {text}")
        return value

    convert.__name__ = kind  # argparse names the type in some messages
    convert.kind, convert.range = kind, allowed
    return convert


def check(flag: str, value, kind: str, interval: str) -> None:
    """Raise :class:`ConfigError` unless ``value`` (a number, None, or a list of numbers) is of ``kind`` and in
    ``interval``: the check of :func:`within` for values given from Python instead of the command line."""
    allowed = Range(interval)
    for v in value if isinstance(value, (list, tuple)) else [value]:
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind == "int" and not isinstance(v, int)):
            raise ConfigError(f"{flag} must be {'a whole number' if kind == 'int' else 'a number'}, got {v!r}")
        if v not in allowed:
            raise ConfigError(f"{flag} must be {allowed.describe()}, got {v}")
