"""Is a figure readable? The defects a learner meets, found on the figure itself after layout.

    defects(fig)            # ["axes 'loss': x tick labels '128' and '256' overlap", ...]; [] when readable
    check(fig)              # raises FigureDefect naming the figure and each defect
    unlabelled(ax, "why")   # a deliberate exemption from the axis-label rule (a diagram, not a plot)
    legend_beside(ax)       # the legend of a plot of measured data, outside the axes: no data can land under it

What counts as a defect, each measured in display (pixel) coordinates:

- **tick labels overlap**: two drawn tick labels of one axis share more than a pixel (turned labels: their
  letters' strips, not their upright boxes);
- **legend over data**: the legend's box crosses a plotted line, bar, point or filled area of any axes under it
  (twins included; contour lines and colour meshes are the field under the data, not data); the message names
  a standard place inside the axes that crosses nothing, or, where none does, says to move the legend out of
  the axes (``bbox_to_anchor``) or make room with the axis limits;
- **axis without a label**: an axis that shows numeric tick labels has no label, neither its own, nor a shared
  sibling's, nor the figure's ``supxlabel``/``supylabel``; images (``imshow`` frames), colour bars, categorical
  axes (tick labels that are names: ``"rank 0"``, a layer, a plan) and axes marked :func:`unlabelled` are exempt;
- **fractional ticks on a count axis**: an axis labelled by ranks, devices, GPUs, workers, stages, nodes,
  processes or experts has a tick label that reads as a fraction (where the tick sits does not matter);
- **a float at full precision**: any text shows a number with six or more decimals (``1.5437500476837158``);
- **unreadable text**: text smaller than :data:`MIN_TEXT_PX` pixels at the resolution the figure is shown or
  saved at (10-point text at 50 dpi is 7 pixels).

Under the test run every notebook kernel loads this module as an IPython extension
(:func:`load_ipython_extension`): each figure open at the end of a cell is checked and then closed (what
Jupyter's inline backend does after showing it), and each figure is checked the first time it is saved
(animation frames, PNG frames), so a defect fails the notebook's cell with the figure and the defect named.
"""
from __future__ import annotations

import functools
import math
import re
import weakref

#: the smallest readable text height, in pixels at the figure's output resolution
MIN_TEXT_PX = 8.0
#: an axis label that names a count of ranks/devices: its ticks must be whole numbers
COUNT_AXIS = re.compile(r"^\s*(number of |# ?)?(ranks?|devices?|GPUs?|workers?|stages?|nodes?|processes|experts?)\b",
                        re.IGNORECASE)
#: a number written with six or more decimals: a float printed without a format
FULL_PRECISION = re.compile(r"\d\.\d{6,}")
#: the nine places a legend can take inside its axes: (name, horizontal, vertical) as 0 / 0.5 / 1 fractions
PLACES = (("upper right", 1, 1), ("upper left", 0, 1), ("lower left", 0, 0), ("lower right", 1, 0),
          ("center left", 0, 0.5), ("center right", 1, 0.5), ("lower center", 0.5, 0), ("upper center", 0.5, 1),
          ("center", 0.5, 0.5))

#: what an unlabelled artist is called in a message
KIND = {"Line2D": "a line", "Rectangle": "a bar", "PathCollection": "points", "LineCollection": "a line"}


class FigureDefect(AssertionError):
    """A figure a learner cannot read; the message names the figure and each defect."""


def unlabelled(ax, reason: str):
    """Exempt ``ax`` from the axis-label rule (a diagram whose ticks name things); returns ``ax``."""
    ax._labkit_unlabelled = reason
    return ax


def legend_beside(ax, **kwargs):
    """Draw ``ax``'s legend to the right of the axes, top-aligned. For plots of measured data (times, rates):
    where the points land changes from run to run, so no place inside the axes is free in every run, and
    ``loc="best"`` can only choose among places that all cross some run's data."""
    return ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, **kwargs)


def describe(fig) -> str:
    """A figure's name for a message: its suptitle, else its axes' titles, else its size."""
    sup = getattr(fig, "_suptitle", None)
    if sup is not None and sup.get_text():
        return repr(sup.get_text())
    titles = [ax.get_title() for ax in fig.axes if ax.get_title()]
    if titles:
        return " / ".join(repr(t) for t in titles[:3])
    w, h = fig.get_size_inches()
    return f"({w:g} x {h:g} in, {len(fig.axes)} axes, no title)"


def _name(ax) -> str:
    return f"axes {ax.get_title()!r}" if ax.get_title() else f"axes #{ax.figure.axes.index(ax) + 1}"


def _drawn_tick_labels(axis):
    """The tick labels ``axis`` draws (in view, visible, with text), major and minor."""
    if not axis.get_visible():
        return []
    labels = []
    for tick in axis._update_ticks():
        for label in (tick.label1, tick.label2):
            if label.get_visible() and label.get_text().strip():
                labels.append((tick.get_loc(), label))
    return labels


def _overlap(a, b, slack: float = 1.0) -> bool:
    """Whether boxes ``a`` and ``b`` share more than ``slack`` pixels in both directions."""
    return (min(a.x1, b.x1) - max(a.x0, b.x0) > slack) and (min(a.y1, b.y1) - max(a.y0, b.y0) > slack)


def _collide(a, box_a, b, box_b, renderer) -> bool:
    """Whether tick labels ``a`` and ``b`` (Text, with their boxes) overlap. Labels turned by an angle other than a
    right angle are parallel strips, one line high: they collide where their centre lines are closer than that
    height and their lengths overlap (their upright boxes overlap long before the letters do)."""
    angle = math.radians(a.get_rotation())
    sin, cos = abs(math.sin(angle)), abs(math.cos(angle))
    if min(sin, cos) < 0.02 or a.get_rotation() != b.get_rotation():
        return _overlap(box_a, box_b)
    height = renderer.points_to_pixels(max(a.get_fontsize(), b.get_fontsize()))
    dx = box_b.x0 + box_b.width / 2 - box_a.x0 - box_a.width / 2
    dy = box_b.y0 + box_b.height / 2 - box_a.y0 - box_a.height / 2
    along = abs(dx * math.cos(angle) + dy * math.sin(angle))
    across = abs(-dx * math.sin(angle) + dy * math.cos(angle))
    length_a, length_b = ((box.width - height * sin) / cos for box in (box_a, box_b))
    return across < height - 1 and along < (length_a + length_b) / 2 - 1


def tick_collisions(ax, renderer, ticks=None) -> list[str]:
    """Pairs of drawn tick labels of one axis of ``ax`` that overlap (each label against its two next ones along
    the axis). ``ticks``: ``{axis: _drawn_tick_labels(axis)}`` where already found."""
    found = []
    for which, axis in (("x", ax.xaxis), ("y", ax.yaxis)):
        drawn = ticks[axis] if ticks else _drawn_tick_labels(axis)
        labels = [(label, label.get_window_extent(renderer)) for _, label in sorted(drawn, key=lambda t: t[0])]
        for i, (a, box_a) in enumerate(labels):
            hit = next((b for b, box_b in labels[i + 1:i + 3] if _collide(a, box_a, b, box_b, renderer)), None)
            if hit is not None:
                found.append(f"{_name(ax)}: {which} tick labels {a.get_text()!r} and {hit.get_text()!r} overlap")
    return found


def _crosses(artist, box, renderer) -> bool:
    """Whether the plotted ``artist`` (a line, bar, point set or filled area) has anything inside ``box``."""
    from matplotlib.collections import PathCollection, PolyCollection, QuadMesh
    from matplotlib.contour import ContourSet
    from matplotlib.lines import Line2D

    if not artist.get_visible():
        return False
    if isinstance(artist, Line2D):
        path = artist.get_transform().transform_path(artist.get_path())
        if artist.get_linestyle() in ("None", "none", "", " "):
            return any(box.contains(x, y) for x, y in path.vertices)
        return path.intersects_bbox(box, filled=False)
    if isinstance(artist, (QuadMesh, ContourSet)):
        return False  # a colour mesh or contour lines fill their axes, like an image: the field under the data
    if isinstance(artist, PathCollection) and len(artist.get_offsets()):
        points = artist.get_offset_transform().transform(artist.get_offsets())
        return any(box.contains(x, y) for x, y in points)
    if hasattr(artist, "get_paths"):  # fill_between, broken_barh, contour lines, error bars
        transform = artist.get_transform()
        filled = isinstance(artist, PolyCollection)
        return any(transform.transform_path(p).intersects_bbox(box, filled=filled) for p in artist.get_paths())
    extent = artist.get_window_extent(renderer)  # a bar or another patch
    return _overlap(extent, box, slack=0.0)


def _data_under(box, fig, renderer) -> list[str]:
    """What is plotted under ``box``, in every axes of ``fig`` (a twin's line too)."""
    from matplotlib.transforms import Bbox

    under = []
    for ax in fig.axes:
        inside = Bbox.intersection(box, ax.bbox)
        if inside is None or inside.width < 2 or inside.height < 2:
            continue
        inside = inside.padded(-1)
        owner = {id(part): container.get_label() for container in ax.containers for part in container}
        for artist in (*ax.lines, *ax.patches, *ax.collections):
            if _crosses(artist, inside, renderer):
                label = owner.get(id(artist)) or artist.get_label()
                under.append(label if label and not label.startswith("_") else KIND.get(type(artist).__name__,
                                                                                      "a filled area"))
    return under


def legend_over_data(fig, renderer) -> list[str]:
    """Legends that cover plotted data, each with a place that would not."""
    from matplotlib.transforms import Bbox

    found = []
    legends = [(ax, ax.get_legend()) for ax in fig.axes if ax.get_legend() is not None]
    legends += [(None, legend) for legend in fig.legends]
    for ax, legend in legends:
        if not legend.get_visible():
            continue
        box = legend.get_window_extent(renderer)
        under = _data_under(box, fig, renderer)
        if not under:
            continue
        parent = ax.bbox if ax is not None else fig.bbox
        if Bbox.intersection(box, parent) is None:
            continue  # placed outside its axes (bbox_to_anchor): nothing of its own axes is under it
        pad = renderer.points_to_pixels(legend.borderaxespad * legend.prop.get_size_in_points())
        room = parent.padded(-pad)
        free = "move it out of the axes (bbox_to_anchor) or make room (axis limits)"
        for place, fx, fy in PLACES:
            x0 = room.x0 + fx * (room.width - box.width)
            y0 = room.y0 + fy * (room.height - box.height)
            if not _data_under(Bbox.from_bounds(x0, y0, box.width, box.height), fig, renderer):
                free = f"loc={place!r} would cover nothing"
                break
        where = _name(ax) if ax is not None else "the figure"
        found.append(f"{where}: the legend covers {', '.join(sorted(set(under))[:3])}; {free}")
    return found


def _label_of(ax, which: str) -> str:
    """The label an axis is read by: its own, a shared sibling's, or the figure's sup-label."""
    own = ax.get_xlabel() if which == "x" else ax.get_ylabel()
    if own.strip():
        return own
    group = ax.get_shared_x_axes() if which == "x" else ax.get_shared_y_axes()
    for sibling in group.get_siblings(ax):
        text = sibling.get_xlabel() if which == "x" else sibling.get_ylabel()
        if text.strip():
            return text
    sup = getattr(ax.figure, "_supxlabel" if which == "x" else "_supylabel", None)
    return sup.get_text() if sup is not None else ""


def _names_things(axis, labels) -> bool:
    """Whether ``axis`` is categorical: its ticks are names (``"rank 0"``, ``"conv1"``, a plan) given as strings,
    not numbers; such tick labels say what the axis holds."""
    from matplotlib.category import StrCategoryFormatter
    from matplotlib.ticker import FixedFormatter, FuncFormatter

    def number(text: str) -> bool:
        return re.fullmatch(r"[−+-]?[\d.,]+(e[−+-]?\d+)?%?", text.strip()) is not None

    formatter = axis.get_major_formatter()
    given = isinstance(formatter, (StrCategoryFormatter, FixedFormatter)) or (  # set_ticks(locs, labels)
        isinstance(formatter, FuncFormatter) and isinstance(formatter.func, functools.partial)
        and getattr(formatter.func.func, "__name__", "") == "_format_with_dict")
    return given and not any(number(label.get_text()) for _, label in labels)


def missing_labels(ax, ticks=None) -> list[str]:
    """Axes of ``ax`` that show numeric tick labels but have no label (images, colour bars, categorical axes, whose
    tick labels are names, and exemptions aside)."""
    has_data = ax.lines or ax.patches or ax.collections or ax.containers
    if (not ax.axison or ax.images or not has_data or hasattr(ax, "_colorbar")
            or getattr(ax, "_labkit_unlabelled", None)):
        return []
    found = []
    for which, axis in (("x", ax.xaxis), ("y", ax.yaxis)):
        labels = ticks[axis] if ticks else _drawn_tick_labels(axis)
        if labels and not _names_things(axis, labels) and not _label_of(ax, which).strip():
            found.append(f"{_name(ax)}: the {which} axis has no label")
    return found


def _whole(text: str) -> bool:
    """Whether a tick label reads as a whole number, or is not a number at all (``"rank 0"``)."""
    try:
        value = float(text.replace("−", "-").replace(",", ""))
    except ValueError:
        return True
    return value == round(value)


def fractional_counts(ax, ticks=None) -> list[str]:
    """Count axes (ranks, devices, ...) whose tick labels show a number between two whole ones (what a tick says,
    not where it sits: a rank's tick may sit between its bars)."""
    found = []
    for which, axis in (("x", ax.xaxis), ("y", ax.yaxis)):
        label = _label_of(ax, which)
        if not COUNT_AXIS.search(label):
            continue
        drawn = ticks[axis] if ticks else _drawn_tick_labels(axis)
        bad = [text.get_text() for _, text in drawn if not _whole(text.get_text())]
        if bad:
            found.append(f"{_name(ax)}: the {which} axis counts {label.split()[0]} but shows ticks {bad[:4]}")
    return found


def _texts(fig, ticks):
    """The texts ``fig`` draws: titles, axis labels, drawn tick labels, annotations, legends, figure texts."""
    texts = [*fig.texts, *(getattr(fig, f"_sup{k}", None) for k in ("title", "xlabel", "ylabel"))]
    for ax in fig.axes:
        texts += [ax.title, ax._left_title, ax._right_title, ax.xaxis.label, ax.yaxis.label, *ax.texts]
        texts += [label for axis in (ax.xaxis, ax.yaxis) for _, label in ticks.get(axis, [])]
    for legend in [*fig.legends, *(ax.get_legend() for ax in fig.axes)]:
        if legend is not None:
            texts += [legend.get_title(), *legend.get_texts()]
    return [t for t in texts if t is not None and t.get_visible() and t.get_text().strip()]


def text_defects(fig, dpi: float, ticks=None) -> list[str]:
    """Texts too small to read at ``dpi``, and numbers written at full precision."""
    ticks = ticks or {axis: _drawn_tick_labels(axis) for ax in fig.axes for axis in (ax.xaxis, ax.yaxis)}
    found, smallest = [], None
    for text in _texts(fig, ticks):
        content = text.get_text()
        px = text.get_fontsize() * dpi / 72
        if px < MIN_TEXT_PX and (smallest is None or px < smallest[0]):
            smallest = (px, content)
        if FULL_PRECISION.search(content):
            found.append(f"the text {content!r} prints a float at full precision")
    if smallest is not None:
        found.append(f"text {smallest[1][:30]!r} is {smallest[0]:.1f} pixels high at {dpi:g} dpi "
                     f"(readable from {MIN_TEXT_PX:g}: raise the dpi or the font size)")
    return found


def defects(fig, dpi: float | None = None) -> list[str]:
    """Every defect of ``fig`` as it is shown (at ``fig.dpi``) or saved at ``dpi``; [] when it is readable."""
    # What a draw would settle first (the layout engine, fixed aspects), then only the ticks and legends are laid out:
    # drawing every text of a Gantt chart to measure none of them took most of the time
    if fig.get_layout_engine() is not None:
        fig.get_layout_engine().execute(fig)
    renderer = fig._get_renderer()
    axes = [ax for ax in fig.axes if ax.get_visible()]
    for ax in axes:
        ax.apply_aspect()
    ticks = {axis: _drawn_tick_labels(axis) if ax.axison else [] for ax in axes for axis in (ax.xaxis, ax.yaxis)}
    found = []
    for ax in axes:
        found += tick_collisions(ax, renderer, ticks) + missing_labels(ax, ticks) + fractional_counts(ax, ticks)
    found += legend_over_data(fig, renderer)
    found += text_defects(fig, dpi or fig.dpi, ticks)
    return found


def check(fig, dpi: float | None = None) -> None:
    """Raise :class:`FigureDefect` naming ``fig`` and its defects, if it has any."""
    found = defects(fig, dpi)
    if found:
        raise FigureDefect(f"figure {describe(fig)} is hard to read:\n  - " + "\n  - ".join(found))


_checked: weakref.WeakSet = weakref.WeakSet()


def check_open_figures() -> None:
    """Check the figures pyplot holds, then close them (Jupyter's inline backend closes each once shown)."""
    import sys

    if "matplotlib.pyplot" not in sys.modules:
        return
    import matplotlib.pyplot as plt

    figures = [plt.figure(n) for n in plt.get_fignums()]
    plt.close("all")
    for fig in figures:
        if fig not in _checked:
            _checked.add(fig)
            check(fig)


def load_ipython_extension(ipython) -> None:
    """In a kernel: check every figure at the end of the cell that draws it, and the first time one is saved."""
    from matplotlib.figure import Figure

    if not getattr(Figure.savefig, "_labkit_checked", False):
        save = Figure.savefig

        def savefig(self, *args, **kwargs):
            if self not in _checked:
                _checked.add(self)
                dpi = kwargs.get("dpi")
                check(self, dpi if isinstance(dpi, (int, float)) else None)
            return save(self, *args, **kwargs)

        savefig._labkit_checked = True
        Figure.savefig = savefig
    ipython.events.register("post_execute", check_open_figures)
