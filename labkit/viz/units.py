"""Axes in units people read: bytes as B/KiB/MiB/GiB, plain tick labels (``64``, not ``2⁶`` or ``6×10¹``).

    size_axis(ax, "x", "vector")      # log axis of byte counts, labelled "vector size" with 1 KiB, 1 MiB ticks
    plain_log_ticks(ax, "x", [1, 2, 4, 8])
"""
from __future__ import annotations

from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

#: markers that tell curves apart where their lines overlap
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">")


def format_bytes(n: float) -> str:
    """``1536 -> "1.5 KiB"``; powers of 1024, at most one decimal."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if float(n).is_integer() else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def size_axis(ax, which: str = "x", what: str = "message") -> None:
    """Make ``which`` a log axis of byte counts, ticks at powers of two written in units, spaced so that the
    labels do not run into each other: at most one per 0.7 inch of the axis ("256 B" and "1 KiB" stay apart)."""
    axis = ax.xaxis if which == "x" else ax.yaxis
    (ax.set_xscale if which == "x" else ax.set_yscale)("log", base=2)
    lo, hi = (ax.get_xlim() if which == "x" else ax.get_ylim())
    box = ax.get_window_extent().transformed(ax.figure.dpi_scale_trans.inverted())
    room = max(2, int((box.width if which == "x" else box.height * 2.5) / 0.7))  # y labels sit one per line
    powers = [k for k in range(0, 45) if lo <= 2 ** k <= hi]
    step = next((s for s in (1, 2, 4, 5, 10) if len([k for k in powers if k % s == 0]) <= room), 10)
    ticks = [2 ** k for k in powers if k % step == 0]
    axis.set_major_locator(FixedLocator(ticks))
    axis.set_major_formatter(FuncFormatter(lambda v, _: format_bytes(v)))
    axis.set_minor_locator(NullLocator())
    (ax.set_xlabel if which == "x" else ax.set_ylabel)(f"{what} size")


def plain_log_ticks(ax, which: str, values) -> None:
    """Ticks exactly at ``values`` on a log axis, written as plain numbers."""
    axis = ax.xaxis if which == "x" else ax.yaxis
    axis.set_major_locator(FixedLocator(list(values)))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_locator(NullLocator())
