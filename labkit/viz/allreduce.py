"""Animate an all-reduce schedule: ranks as boxes, chunks coloured by whose data they hold, one arrow per message.

    view = AllReduceView(get_schedule("ring", 4))
    view.draw(3)                                   # the state after step 3, its messages as arrows
    save_animation(get_schedule("ring", 5), "ring.html")     # or .gif; to_html(...) for a notebook
    AllReduceView(schedule, trace=trace).animation()           # replay a measured run on its time axis

Everything drawn comes from the schedule (via :func:`labkit.collectives.coverage`) or from a recorded
:class:`labkit.collectives.Trace`; nothing here knows how any algorithm works.
"""
from __future__ import annotations

import math
import re
import textwrap
from pathlib import Path

from matplotlib.animation import FuncAnimation, PillowWriter
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, Rectangle

from labkit.collectives.execute import Trace
from labkit.collectives.schedule import Op, Schedule
from labkit.collectives.simulate import coverage
from labkit.errors import ConfigError

RANK_COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
               "#bcbd22", "#17becf"]
OP_COLORS = {Op.REDUCE: "#c0392b", Op.COPY: "#2471a3"}
BOX_W, BOX_H = 1.6, 0.5
CAPTION_CHARS = 90  # characters of the 9-point caption per line: what fits beside the narrowest (square) drawing
#: the frames' resolution: the 7-point chunk labels stay 10 pixels high (at 50 dpi they were 5, unreadable)
FRAME_DPI = 100


class FrameCanvas(FigureCanvasAgg):
    """An Agg canvas that draws only when a frame is saved: after every frame FuncAnimation asks for a
    ``draw_idle``, which Agg does at once, and the writer then draws the same frame again to save it."""

    def draw_idle(self, *args, **kwargs) -> None:
        pass


def rank_color(rank: int) -> str:
    return RANK_COLORS[rank % len(RANK_COLORS)]


def layout(schedule: Schedule) -> dict[int, tuple[float, float]]:
    """Centre of every rank's box: a tree for tree, a hub for master-worker and parameter server, else a
    circle (for the butterflies the power-of-two core, each extra rank just outside the rank it folds into)."""
    p, name = schedule.world_size, schedule.algorithm
    if name == "tree":
        return {r: (2.0 * r, -2.2 * bin(r).count("1")) for r in range(p)}  # depth = number of 1 bits
    if name in ("master-worker", "parameter-server"):
        hubs = schedule.servers or (0,)
        others = [r for r in range(p) if r not in hubs]
        width = 2.0 * (len(others) - 1)
        pos = {h: (width / 2 + 2.0 * (i - (len(hubs) - 1) / 2), 0.0) for i, h in enumerate(hubs)}
        pos.update({r: (2.0 * i, -2.4) for i, r in enumerate(others)})
        return pos
    # A circle; for the butterflies only the power-of-two core, each extra rank just outside its partner.
    core = 1 << (p.bit_length() - 1) if name in ("butterfly", "rabenseifner") else p
    radius = max(1.6, 0.62 * core)
    pos = {}
    for r in range(p):
        angle, dist = 2 * math.pi * (r % core) / core, radius + (1.9 if r >= core else 0.0)
        pos[r] = (dist * math.sin(angle), dist * math.cos(angle))
    return pos


def _edge(centre: tuple[float, float], toward: tuple[float, float], pad: float = 0.12) -> tuple[float, float]:
    # Where the line from a box centre toward another point leaves the box (plus a gap for the label).
    (x, y), (tx, ty) = centre, toward
    dx, dy = tx - x, ty - y
    scale = min((BOX_W / 2 + pad) / abs(dx) if dx else math.inf, (BOX_H / 2 + 0.2 + pad) / abs(dy) if dy else math.inf)
    return x + dx * scale, y + dy * scale


class AllReduceView:
    """A figure showing one schedule, redrawn for any step.

    Args:
        schedule: what to show.
        trace: optional measured run of this schedule; adds a timeline panel (real seconds on the x axis)
            and the measured time to each caption.
    """

    def __init__(self, schedule: Schedule, trace: Trace | None = None):
        if trace is not None and (trace.algorithm, trace.world_size) != (schedule.algorithm, schedule.world_size):
            raise ConfigError(f"the trace is of {trace.algorithm} on {trace.world_size} ranks, not of "
                              f"{schedule.algorithm} on {schedule.world_size}; replay it with its own schedule")
        self.schedule, self.trace = schedule, trace
        self.frames = coverage(schedule)
        self.positions = layout(schedule)
        # Fixed axes positions: automatic layout engines cost more than drawing the frame itself.
        self.fig = Figure(figsize=(8.5, 7.0 if trace is not None else 5.6))
        FrameCanvas(self.fig)
        if trace is None:
            self.ax, self.time_ax = self.fig.add_axes((0.02, 0.06, 0.96, 0.84)), None
        else:
            self.ax = self.fig.add_axes((0.02, 0.33, 0.96, 0.59))
            self.time_ax = self.fig.add_axes((0.08, 0.07, 0.89, 0.19))

    @property
    def num_frames(self) -> int:
        """Frame 0 is the start, frame ``s`` the state after step ``s``."""
        return self.schedule.num_steps + 1

    def step_end(self, index: int) -> float:
        """Measured seconds at which step ``index`` ended on the slowest rank (0 for the start)."""
        ends = [r.end for r in self.trace.records if r.step <= index] if self.trace else []
        return max(ends, default=0.0)

    def caption(self, index: int) -> str:
        """``"step 3 of 6: share-reduce, rank 2 sends chunk 0 to rank 3"`` (+ measured time with a trace)."""
        text = self.schedule.describe_step(index)
        if index == self.schedule.num_steps:
            text += f" -- done: every {'worker' if self.schedule.servers else 'rank'} holds the sum"
        if self.trace is not None:
            text += f"  [t = {self.step_end(index) * 1e3:.2f} ms]"
        return text

    def _box(self, rank: int, index: int) -> None:
        # add_artist, not add_patch: draw() sets the limits itself, and widening them patch by patch took a
        # third of a frame's time
        x, y = self.positions[rank]
        held_by_chunk = self.frames[index][rank]
        k = self.schedule.num_chunks
        want = frozenset(self.schedule.contributors)
        cell = BOX_W / k
        left = x - BOX_W / 2
        for c, held in enumerate(held_by_chunk):
            parts = sorted(held) or [None]
            for j, owner in enumerate(parts):
                self.ax.add_artist(Rectangle((left + c * cell + j * cell / len(parts), y - BOX_H / 2),
                                            cell / len(parts), BOX_H, linewidth=0,
                                            facecolor="white" if owner is None else rank_color(owner)))
            done = held == want
            self.ax.add_artist(Rectangle((left + c * cell, y - BOX_H / 2), cell, BOX_H, fill=False,
                                        linewidth=2.6 if done else 0.8, edgecolor="black"))
            if k > 1:
                self.ax.text(left + (c + 0.5) * cell, y - BOX_H / 2 - 0.12, str(c), ha="center", va="top",
                             fontsize=7, color="#555555")
        role = "server " if rank in self.schedule.servers else "rank "
        self.ax.text(x, y + BOX_H / 2 + 0.08, f"{role}{rank}", ha="center", va="bottom", fontsize=10,
                     fontweight="bold", color=rank_color(rank))
        self.ax.add_artist(Rectangle((x - BOX_W / 2, y - BOX_H / 2), BOX_W, BOX_H, fill=False, linewidth=1.4))

    def draw(self, index: int) -> None:
        """Draw the state after step ``index`` (0 = start) and that step's messages."""
        if not 0 <= index < self.num_frames:
            raise ConfigError(f"step {index} is outside 0..{self.schedule.num_steps} for {self.schedule.algorithm}")
        ax = self.ax
        ax.clear()
        ax.set_axis_off()
        if self.schedule.algorithm == "tree":  # the tree itself, so every rank shows where it hangs
            for a, b in sorted({tuple(sorted((t.src, t.dst))) for step in self.schedule.steps for t in step.transfers}):
                (x0, y0), (x1, y1) = self.positions[a], self.positions[b]
                ax.plot([x0, x1], [y0, y1], color="#bbbbbb", linewidth=1.2, zorder=0)
        for r in range(self.schedule.world_size):
            self._box(r, index)
        transfers = self.schedule.steps[index - 1].transfers if index else ()
        for t in transfers:
            a, b = self.positions[t.src], self.positions[t.dst]
            arrow = FancyArrowPatch(_edge(a, b), _edge(b, a), arrowstyle="-|>", mutation_scale=14, linewidth=1.6,
                                    connectionstyle="arc3,rad=0.18", color=OP_COLORS[t.op], alpha=0.85)
            ax.add_artist(arrow)
            if len(transfers) <= 2 * self.schedule.world_size and self.schedule.num_chunks > 1:
                (x0, y0), (x1, y1) = self.positions[t.src], self.positions[t.dst]
                # Label on the side the arc bends to, so the two directions of a pair do not overlap.
                mx, my = (x0 + x1) / 2 + 0.12 * (y1 - y0), (y0 + y1) / 2 - 0.12 * (x1 - x0)
                ax.text(mx, my, t.chunk_label().replace("chunks ", "c").replace("chunk ", "c"), fontsize=8,
                        ha="center", va="center", color=OP_COLORS[t.op],
                        bbox=dict(boxstyle="round,pad=0.15", facecolor="white", edgecolor="none", alpha=0.8))
        xs, ys = zip(*self.positions.values())
        ax.set_xlim(min(xs) - 1.4, max(xs) + 1.4)
        ax.set_ylim(min(ys) - 1.0, max(ys) + 1.0)
        ax.set_aspect("equal")
        # Wrapped by characters (about what fits across the figure at this size): matplotlib's wrap=True measures
        # the line word by word, a quarter of a frame's time. y given: no (hidden) axis to lay out to place it.
        ax.set_title(textwrap.fill(self.caption(index), CAPTION_CHARS), fontsize=9, loc="left", y=1.0)
        ax.text(0.0, -0.02, "chunk colours: ranks whose data it holds; thick border: the full sum; "
                "arrows: red = add (reduce), blue = store (copy)", transform=ax.transAxes, fontsize=7.5,
                color="#444444", va="top")
        if self.time_ax is not None:
            self._draw_timeline(index)

    def _draw_timeline(self, index: int) -> None:
        ax = self.time_ax
        ax.clear()
        for rec in self.trace.records:
            ops = {t.op for t in self.schedule.steps[rec.step - 1].transfers}
            color = OP_COLORS[Op.REDUCE] if Op.REDUCE in ops else OP_COLORS[Op.COPY]
            ax.barh(rec.rank, (rec.end - rec.start) * 1e3, left=rec.start * 1e3, height=0.6, color=color,
                    alpha=1.0 if rec.step == index else 0.35, edgecolor="black", linewidth=0.4)
        ax.axvline(self.step_end(index) * 1e3, color="black", linestyle="--", linewidth=1)
        ax.set_yticks(range(self.schedule.world_size))
        ax.set_ylabel("rank")
        ax.invert_yaxis()
        ax.set_xlabel(f"measured time (ms): {self.trace.n} x {self.trace.dtype}, "
                      f"total {self.trace.duration() * 1e3:.2f} ms")
        ax.set_xlim(0, max(self.trace.duration(), 1e-9) * 1e3 * 1.02)

    def png(self, index: int, dpi: int = FRAME_DPI) -> bytes:
        """Frame ``index`` as PNG bytes (for widgets)."""
        import io

        self.draw(index)
        buf = io.BytesIO()
        self.fig.savefig(buf, format="png", dpi=dpi)
        return buf.getvalue()

    def animation(self, interval_ms: int = 1200) -> FuncAnimation:
        """A matplotlib animation with one frame per step (``.to_jshtml()`` gives an HTML player)."""
        return FuncAnimation(self.fig, self.draw, frames=range(self.num_frames), interval=interval_ms,
                             blit=False, repeat=False)


#: matplotlib's player draws its buttons with Font Awesome icons fetched from a CDN; these characters need
#: no network (cluster nodes and workshop rooms are often offline)
BUTTON_GLYPHS = {"fa fa-minus": "\u2212", "fa fa-fast-backward": "\u23ee", "fa fa-step-backward": "\u23ea",
                 "fa fa-play fa-flip-horizontal": "\u25c0", "fa fa-pause": "\u23f8", "fa fa-play": "\u25b6",
                 "fa fa-step-forward": "\u23e9", "fa fa-fast-forward": "\u23ed", "fa fa-plus": "+"}


def offline(html: str) -> str:
    """``html`` from ``to_jshtml`` with no external resource: the icon stylesheet link removed, each icon
    replaced by a character."""
    html = re.sub(r'<link rel="stylesheet"\s+href="https?://[^"]*font-awesome[^"]*">\s*', "", html)
    for css, glyph in BUTTON_GLYPHS.items():
        html = html.replace(f'<i class="{css}"></i>', glyph)
    return html


def to_html(schedule: Schedule, trace: Trace | None = None, interval_ms: int = 1200, dpi: int | None = None) -> str:
    """The animation as a stand-alone HTML/JavaScript player that works offline (matplotlib's ``to_jshtml``);
    in a notebook show it with ``IPython.display.HTML(to_html(schedule))``.

    ``dpi``: the frames' resolution (:data:`FRAME_DPI` by default)."""
    view = AllReduceView(schedule, trace)
    view.fig.set_dpi(dpi or FRAME_DPI)
    return offline(view.animation(interval_ms).to_jshtml(fps=1000 / interval_ms, default_mode="once"))


def save_animation(schedule: Schedule, path: str | Path, trace: Trace | None = None, interval_ms: int = 1200,
                   dpi: int = FRAME_DPI) -> Path:
    """Write the animation of ``schedule`` to ``path``: ``.html`` (stand-alone player) or ``.gif``."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in (".html", ".gif"):
        raise ConfigError(f"cannot write an animation to {path.name!r}; use a .html or .gif file name")
    path.parent.mkdir(parents=True, exist_ok=True)
    if suffix == ".html":
        html = to_html(schedule, trace, interval_ms)
        path.write_text(f"<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>{schedule.algorithm} "
                        f"all-reduce, {schedule.world_size} ranks</title></head><body>\n{html}\n</body></html>\n")
    else:
        anim = AllReduceView(schedule, trace).animation(interval_ms)
        anim.save(path, writer=PillowWriter(fps=1000 / interval_ms), dpi=dpi)
    return path
