"""Animate the key/value ring of context parallelism, drawn as the all-reduce ring is (:mod:`labkit.viz.allreduce`).

    view = KVRingView(kv_ring(4, causal=True, layout="zigzag"))
    view.draw(2)                          # compute step 2: who holds whose K/V, the messages that brought them
    save_animation(kv_ring(4), "kv_ring.html")          # or .gif; to_html(...) for a notebook

Left: the ranks on a ring; each box shows the query chunks the rank keeps (its own colour) and the K/V it holds
at this step (the owner's colour); arrows are the step's messages. Right: the attention matrix of one sequence
cut into chunks (queries down, keys across); a cell is coloured by the rank that computes that block, bright at
the step it is computed, pale afterwards; grey cells are in the future of their queries and never computed.
With the contiguous layout the last rank's colour fills most of the triangle; with zig-zag every rank gets the
same share. Everything drawn comes from the :class:`~labkit.collectives.kv_ring.KVRing`.
"""
from __future__ import annotations

import math
from pathlib import Path

from matplotlib.animation import FuncAnimation, PillowWriter
from matplotlib.colors import to_rgba
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, Rectangle

from labkit.collectives.kv_ring import KVRing
from labkit.errors import ConfigError
from labkit.viz.allreduce import BOX_H, BOX_W, FRAME_DPI, FrameCanvas, _edge, offline, rank_color


class KVRingView:
    """A figure showing one :class:`KVRing`, redrawn for any compute step (0 .. p-1)."""

    def __init__(self, ring: KVRing):
        self.ring = ring
        p = ring.world_size
        radius = max(1.6, 0.62 * p)
        self.positions = {r: (radius * math.sin(2 * math.pi * r / p), radius * math.cos(2 * math.pi * r / p))
                          for r in range(p)}
        self.fig = Figure(figsize=(11.0, 5.4))
        FrameCanvas(self.fig)
        self.ax = self.fig.add_axes((0.01, 0.06, 0.55, 0.84))
        self.grid_ax = self.fig.add_axes((0.60, 0.10, 0.37, 0.76))

    @property
    def num_frames(self) -> int:
        """One frame per compute step: 0 (own K/V) to p - 1."""
        return self.ring.world_size

    def computed_by(self) -> dict[tuple[int, int], tuple[int, int]]:
        """``(query chunk, key chunk) -> (rank, step)`` for every block the ring computes."""
        cells = {}
        for r in range(self.ring.world_size):
            for s in range(self.ring.world_size):
                for block in self.ring.blocks(r, s):
                    cells.update({(qc, kc): (r, s) for qc in block.q for kc in block.kv
                                  if not (self.ring.causal and kc > qc)})  # computed, then masked: not drawn
        return cells

    def caption(self, index: int) -> str:
        return self.ring.describe_step(index)

    def _box(self, rank: int, index: int) -> None:
        x, y = self.positions[rank]
        owner = self.ring.owner_at(rank, index)
        half = BOX_W / 2
        self.ax.add_patch(Rectangle((x - half, y - BOX_H / 2), half, BOX_H, facecolor=rank_color(rank), linewidth=0))
        self.ax.add_patch(Rectangle((x, y - BOX_H / 2), half, BOX_H, facecolor=rank_color(owner), linewidth=0,
                                    hatch="//", edgecolor="white"))
        self.ax.add_patch(Rectangle((x - half, y - BOX_H / 2), BOX_W, BOX_H, fill=False, linewidth=1.4))
        chunks = ",".join(map(str, self.ring.chunks_of(rank)))
        held = ",".join(map(str, self.ring.chunks_of(owner)))
        self.ax.text(x - half / 2, y, f"Q {chunks}", ha="center", va="center", fontsize=7, color="white")
        self.ax.text(x + half / 2, y, f"KV {held}", ha="center", va="center", fontsize=7, color="black",
                     bbox=dict(boxstyle="round,pad=0.1", facecolor="white", edgecolor="none", alpha=0.7))
        self.ax.text(x, y + BOX_H / 2 + 0.08, f"rank {rank}", ha="center", va="bottom", fontsize=10,
                     fontweight="bold", color=rank_color(rank))

    def draw(self, index: int) -> None:
        """Draw compute step ``index`` and the messages that brought its K/V."""
        if not 0 <= index < self.num_frames:
            raise ConfigError(f"step {index} is outside 0..{self.num_frames - 1} for a ring of "
                              f"{self.ring.world_size} ranks")
        ax = self.ax
        ax.clear()
        ax.set_axis_off()
        for r in range(self.ring.world_size):
            self._box(r, index)
        for t in self.ring.forward_steps[index - 1] if index else ():
            a, b = self.positions[t.src], self.positions[t.dst]
            ax.add_patch(FancyArrowPatch(_edge(a, b), _edge(b, a), arrowstyle="-|>", mutation_scale=14,
                                         linewidth=1.6, connectionstyle="arc3,rad=0.18", color=rank_color(t.owner)))
        xs, ys = zip(*self.positions.values())
        ax.set_xlim(min(xs) - 1.4, max(xs) + 1.4)
        ax.set_ylim(min(ys) - 1.0, max(ys) + 1.0)
        ax.set_aspect("equal")
        ax.set_title(self.caption(index), fontsize=9, wrap=True, loc="left")
        ax.text(0.0, -0.02, "left half: the rank's own queries; hatched: the K/V it holds now (owner's colour); "
                "arrows: K/V passed on", transform=ax.transAxes, fontsize=7.5, color="#444444", va="top")
        self._draw_grid(index)

    def _draw_grid(self, index: int) -> None:
        ax, n = self.grid_ax, self.ring.num_chunks
        ax.clear()
        cells = self.computed_by()
        for qc in range(n):
            for kc in range(n):
                who = cells.get((qc, kc))
                if who is None:
                    color = "#dddddd" if kc > qc and self.ring.causal else "white"
                else:
                    rank, step = who
                    alpha = 1.0 if step == index else 0.3 if step < index else 0.0
                    color = to_rgba(rank_color(rank), alpha)
                ax.add_patch(Rectangle((kc, qc), 1, 1, facecolor=color, edgecolor="#888888", linewidth=0.5))
        ax.set_xlim(0, n)
        ax.set_ylim(n, 0)
        ax.set_aspect("equal")
        ax.set_xticks([c + 0.5 for c in range(n)], [str(c) for c in range(n)], fontsize=7)
        ax.set_yticks([c + 0.5 for c in range(n)], [str(c) for c in range(n)], fontsize=7)
        ax.set_xlabel("key chunk")
        ax.set_ylabel("query chunk")
        p = self.ring.world_size
        chunk = 2 * p // n  # one layout's work in the other's units: a sequence of 2p tokens
        done = [sum(b.score_entries(chunk) for s in range(index + 1) for b in self.ring.blocks(r, s)) for r in range(p)]
        ax.set_title(f"{self.ring.layout}: scores computed per rank so far, T = {2 * p}: {done}", fontsize=9)

    def png(self, index: int, dpi: int = FRAME_DPI) -> bytes:
        """Frame ``index`` as PNG bytes (for widgets)."""
        import io

        self.draw(index)
        buf = io.BytesIO()
        self.fig.savefig(buf, format="png", dpi=dpi)
        return buf.getvalue()

    def animation(self, interval_ms: int = 1500) -> FuncAnimation:
        """A matplotlib animation with one frame per compute step (``.to_jshtml()`` gives an HTML player)."""
        return FuncAnimation(self.fig, self.draw, frames=range(self.num_frames), interval=interval_ms,
                             blit=False, repeat=False)


def to_html(ring: KVRing, interval_ms: int = 1500, dpi: int | None = None) -> str:
    """The animation as a stand-alone offline HTML/JavaScript player (show with ``IPython.display.HTML``).

    ``dpi``: the frames' resolution (:data:`labkit.viz.allreduce.FRAME_DPI` by default)."""
    view = KVRingView(ring)
    view.fig.set_dpi(dpi or FRAME_DPI)
    return offline(view.animation(interval_ms).to_jshtml(fps=1000 / interval_ms, default_mode="once"))


def save_animation(ring: KVRing, path: str | Path, interval_ms: int = 1500, dpi: int = FRAME_DPI) -> Path:
    """Write the animation of ``ring`` to ``path``: ``.html`` (stand-alone player) or ``.gif``."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in (".html", ".gif"):
        raise ConfigError(f"cannot write an animation to {path.name!r}; use a .html or .gif file name")
    path.parent.mkdir(parents=True, exist_ok=True)
    if suffix == ".html":
        path.write_text(f"<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>KV ring, {ring.world_size} "
                        f"ranks ({ring.layout})</title></head><body>\n{to_html(ring, interval_ms)}\n</body></html>\n")
    else:
        KVRingView(ring).animation(interval_ms).save(path, writer=PillowWriter(fps=1000 / interval_ms), dpi=dpi)
    return path
