"""The figure check every notebook figure passes, on deliberately bad figures and their repaired twins."""
import pytest
from matplotlib.figure import Figure

from labkit.viz.figcheck import FigureDefect, check, defects, unlabelled


def plot(figsize=(4, 3), dpi=100):
    fig = Figure(figsize=figsize, dpi=dpi)
    return fig, fig.add_subplot()


def test_a_labelled_readable_figure_passes():
    fig, ax = plot()
    ax.plot([1, 2, 3], [3, 2, 1], label="falling")
    ax.legend(loc="upper right")
    ax.set(xlabel="step", ylabel="loss")
    assert defects(fig) == []


def test_a_legend_over_a_line_is_found_and_a_free_place_named():
    fig, ax = plot()
    ax.plot([0, 1], [1, 1], label="flat at the top")  # runs along the top edge, through an upper legend
    ax.plot([0, 1], [0, 0.6], label="rising")
    ax.set(xlabel="x", ylabel="y", ylim=(-0.05, 1.05))
    ax.legend(loc="upper left")
    assert defects(fig) == ["axes #1: the legend covers flat at the top; loc='lower right' would cover nothing"]
    ax.legend(loc="lower right")
    assert defects(fig) == []


def test_a_legend_over_a_bar_and_a_twin_line_is_found():
    """Notebook 00's utilisation panel: the legend sat on the tallest bar and on the twin axes' step line."""
    fig, ax = plot()
    ax.bar(["8", "32", "128", "512"], [90, 95, 98, 102], label="CPU %")
    ax.set(xlabel="batch size", ylabel="CPU %")
    twin = ax.twinx()
    twin.plot(["8", "32", "128", "512"], [500, 125, 31, 7], "ko-", label="steps")
    twin.set(yscale="log", ylabel="steps per epoch")
    ax.legend(loc="lower right")
    assert defects(fig) == ["axes #1: the legend covers CPU %, steps; move it out of the axes (bbox_to_anchor) or "
                            "make room (axis limits)"]
    ax.legend(loc="upper left", bbox_to_anchor=(1.15, 1))
    assert defects(fig) == []


def test_colliding_tick_labels_are_found():
    fig, ax = plot(figsize=(2, 2))
    ax.plot(range(10), range(10))
    ax.set_xticks(range(10), [f"label {i}" for i in range(10)])
    ax.set(xlabel="x", ylabel="y")
    found = defects(fig)
    assert found and found[0] == "axes #1: x tick labels 'label 0' and 'label 1' overlap", found
    ax.set_xticks([0, 9], ["label 0", "label 9"])
    assert defects(fig) == []
    fig, ax = plot(figsize=(6, 3))  # turned labels: apart when their strips are, though their upright boxes overlap
    ax.bar([f"a long plan name {i}" for i in range(6)], range(6))
    ax.set(ylabel="ms per step")
    ax.tick_params(axis="x", rotation=30)
    assert defects(fig) == []
    ax.tick_params(axis="x", labelsize=30)
    assert defects(fig)[0] == "axes #1: x tick labels 'a long plan name 0' and 'a long plan name 1' overlap"


def test_missing_labels_are_found_and_images_and_exemptions_pass():
    fig, ax = plot()
    ax.contour([[0, 1], [1, 2]])
    ax.set_title("curvature")
    assert defects(fig) == ["axes 'curvature': the x axis has no label", "axes 'curvature': the y axis has no label"]
    ax.set_xlabel("w1")
    assert defects(fig) == ["axes 'curvature': the y axis has no label"]
    unlabelled(ax, "a diagram")
    assert defects(fig) == []
    fig, ax = plot()
    ax.imshow([[0, 1], [1, 0]])
    assert defects(fig) == []
    fig, ax = plot()  # tick labels that are names say what the axis holds; numbers as strings do not
    ax.barh(["rank 0", "rank 1"], [3, 4])
    ax.set_xlabel("ms")
    assert defects(fig) == []
    ax.set_yticks([0, 1], ["8", "32"])
    assert defects(fig) == ["axes #1: the y axis has no label"]
    ax.set_yticks([0, 1], ["stage 0", "stage 1"])
    assert defects(fig) == []


def test_shared_axes_take_their_siblings_label():
    fig = Figure(figsize=(6, 3))
    left, right = fig.subplots(1, 2, sharey=True)
    for ax in (left, right):
        ax.plot([1, 2], [1, 2])
        ax.set_xlabel("step")
    left.set_ylabel("loss")
    assert defects(fig) == []


def test_fractional_rank_ticks_are_found():
    fig, ax = plot()
    ax.plot([0, 1], [0, 1])
    ax.set(xlabel="time (ms)", ylabel="rank")
    assert defects(fig) == ["axes #1: the y axis counts rank but shows ticks ['0.2', '0.4', '0.6', '0.8']"]
    ax.set_yticks([0, 1])
    assert defects(fig) == []
    ax.set_yticks([0.2, 0.8], ["0", "1"])  # what a tick says counts, not where it sits (between a rank's bars)
    assert defects(fig) == []


def test_full_precision_and_small_text_are_found():
    fig, ax = plot()
    ax.bar(["a"], [1.5437500476837158])
    ax.set(xlabel="contender", ylabel="time (ms)")
    ax.text(0, 1.6, f"{1.5437500476837158}")
    ax.set_ylim(0, 2)
    assert defects(fig) == ["the text '1.5437500476837158' prints a float at full precision"]
    ax.texts[0].set_text("1.54")
    found = defects(fig, dpi=50)
    assert len(found) == 1 and found[0].endswith("pixels high at 50 dpi (readable from 8: raise the dpi or the "
                                                 "font size)"), found
    assert defects(fig, dpi=80) == []


def test_check_names_the_figure():
    fig, ax = plot()
    ax.plot([0, 1], [0, 1])
    fig.suptitle("throughput")
    with pytest.raises(FigureDefect, match=r"figure 'throughput' is hard to read:\n  - axes #1: the x axis"):
        check(fig)
