"""Axes in units people read."""
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from labkit.viz.units import format_bytes, plain_log_ticks, size_axis  # noqa: E402


def test_byte_ticks_are_written_in_units():
    assert [format_bytes(n) for n in (64, 1536, 1 << 20, 3 << 30)] == ["64 B", "1.5 KiB", "1 MiB", "3 GiB"]
    fig, ax = plt.subplots()
    ax.loglog([1024, 1 << 20], [1, 2])
    size_axis(ax, "x", "vector")
    plain_log_ticks(ax, "y", [1, 2])
    fig.canvas.draw()
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1 KiB", "4 KiB", "16 KiB", "64 KiB", "256 KiB", "1 MiB"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["1", "2"] and ax.get_xlabel() == "vector size"
    plt.close(fig)


def test_byte_ticks_never_overlap_on_a_narrow_panel():
    """Notebook 01's three panels side by side, 4 B to 4 MiB: no tick label runs into the next ("256 B1 KiB")."""
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax in axes:
        ax.loglog([4, 4 << 20], [1, 2])
        size_axis(ax, "x", "message")
    fig.tight_layout()
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    boxes = [t.get_window_extent(renderer) for t in axes[0].get_xticklabels() if t.get_text()]
    assert len(boxes) >= 3
    assert all(a.x1 < b.x0 for a, b in zip(boxes, boxes[1:])), [t.get_text() for t in axes[0].get_xticklabels()]
    plt.close(fig)
