"""Device busy/idle timelines: one row per stage, one bar per micro-batch and phase, from a measured run.

    mp = ModelParallel(model, ["cuda:0", "cuda:1"], split_size=16, record=True)
    loss_fn(mp(x), y).backward()
    plot_timeline(mp.timeline())          # white space = a device waiting

Intervals are :class:`labkit.strategies.model_parallel.BusyInterval` objects or their dicts (as written to
``metrics.jsonl`` records of kind ``"trace"``).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, is_dataclass

Interval = Mapping | object


def _rows(intervals: Iterable[Interval]) -> list[dict]:
    return [asdict(iv) if is_dataclass(iv) else dict(iv) for iv in intervals]


def busy_fraction(intervals: Iterable[Interval]) -> dict[int, float]:
    """Per stage: busy time / the whole step (first start to last end over all stages)."""
    rows = _rows(intervals)
    if not rows:
        return {}
    span = max(r["end"] for r in rows) - min(r["start"] for r in rows)
    busy: dict[int, float] = {}
    for r in rows:
        busy[r["stage"]] = busy.get(r["stage"], 0.0) + r["end"] - r["start"]
    return {stage: t / span if span > 0 else 0.0 for stage, t in sorted(busy.items())}


def plot_timeline(intervals: Iterable[Interval], ax=None, title: str | None = None, unit: str = "ms"):
    """Gantt chart of the intervals: forward bars solid, backward hatched, one colour per micro-batch.

    Returns the matplotlib axis. Each row is labelled with its stage, device and busy fraction.
    """
    import matplotlib.pyplot as plt

    rows = _rows(intervals)
    if not rows:
        raise ValueError("no intervals to draw: record a step first (ModelParallel(..., record=True))")
    scale = {"s": 1.0, "ms": 1e3, "us": 1e6}[unit]
    origin = min(r["start"] for r in rows)
    stages = sorted({r["stage"] for r in rows})
    devices = {r["stage"]: r["device"] for r in rows}
    fraction = busy_fraction(rows)
    micro = max(r["micro_batch"] for r in rows) + 1
    colours = plt.get_cmap("tab10" if micro <= 10 else "viridis")
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.7 + 0.6 * len(stages)))
    for r in rows:
        y = stages.index(r["stage"])
        colour = colours(r["micro_batch"] % 10 if micro <= 10 else r["micro_batch"] / max(micro - 1, 1))
        start, width = (r["start"] - origin) * scale, (r["end"] - r["start"]) * scale
        ax.broken_barh([(start, width)], (y - 0.38, 0.76), facecolors=colour, edgecolor="black", linewidth=0.4,
                       hatch={"backward": "//", "weight": ".."}.get(r["phase"]), alpha=0.9)
        if micro <= 16:
            ax.text(start + width / 2, y, str(r["micro_batch"]), ha="center", va="center", fontsize=7, clip_on=True)
    ax.set_yticks(range(len(stages)))
    ax.set_yticklabels([f"stage {s} ({devices[s]})\nbusy {fraction[s]:.0%}" for s in stages], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(f"time since the step began ({unit}); number = micro-batch, hatched = backward")
    ax.grid(axis="x", alpha=0.3)
    if title:
        ax.set_title(title, fontsize=10)
    return ax


def plot_timelines(panels: Mapping[str, Iterable[Interval]], unit: str = "ms"):
    """Several timelines stacked, one per title (e.g. naive split vs pipelined micro-batches)."""
    import matplotlib.pyplot as plt

    panels = {k: _rows(v) for k, v in panels.items()}
    heights = [1 + len({r["stage"] for r in rows}) for rows in panels.values()]
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 0.7 * sum(heights)), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    for ax, (title, rows) in zip(axes[:, 0], panels.items()):
        plot_timeline(rows, ax=ax, title=title, unit=unit)
    fig.tight_layout()
    return fig
