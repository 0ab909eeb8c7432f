"""The animation draws what the schedule (or a recorded trace) says, exports to HTML/GIF, and the player
shows the current step's caption."""
import pytest
from matplotlib.colors import to_hex
from matplotlib.patches import FancyArrowPatch, Rectangle
from PIL import Image

from labkit.collectives import StepRecord, Trace, from_steps, get_schedule
from labkit.errors import ConfigError
from labkit.viz.allreduce import OP_COLORS, AllReduceView, rank_color, save_animation
from labkit.viz.player import AllReducePlayer


def arrows(view):
    return [p for p in view.ax.patches if isinstance(p, FancyArrowPatch)]


def fill_colors(view):
    return {to_hex(p.get_facecolor()) for p in view.ax.patches if isinstance(p, Rectangle) and p.get_fill()}


def test_one_arrow_per_transfer_coloured_by_op():
    schedule = get_schedule("ring", 4)
    view = AllReduceView(schedule)
    for index in range(view.num_frames):
        view.draw(index)
        want = schedule.steps[index - 1].transfers if index else ()
        assert len(arrows(view)) == len(want)
        assert {to_hex(a.get_edgecolor()) for a in arrows(view)} == {OP_COLORS[t.op] for t in want}


def test_the_view_follows_any_schedule_it_is_given():
    # An odd hand-made schedule: rank 2 sends everything to rank 0 and back. The picture must follow it.
    odd = from_steps("custom", 3, 2, [[(2, 0, 0, 2, "reduce"), (1, 0, 0, 2, "reduce")], [(0, 1, 0, 2, "copy"),
                                                                                       (0, 2, 0, 2, "copy")]],
                     phases=["gather", "spread"])
    view = AllReduceView(odd)
    view.draw(1)
    assert len(arrows(view)) == 2
    assert view.caption(1) == ("step 1 of 2: gather, rank 2 sends chunks 0-1 to rank 0, "
                               "rank 1 sends chunks 0-1 to rank 0")
    assert view.ax.get_title(loc="left") == view.caption(1)


def test_chunk_colours_are_the_ranks_whose_data_they_hold():
    view = AllReduceView(get_schedule("ring", 3))
    view.draw(0)
    assert fill_colors(view) == {rank_color(r) for r in range(3)}
    # after step 1 rank 1's chunk 0 holds ranks 0 and 1: drawn as two stripes of those colours
    view.draw(1)
    cells = [p for p in view.ax.patches if isinstance(p, Rectangle) and p.get_fill()]
    assert len(cells) == 3 * 3 + 3        # 9 chunks, three of them split into 2 stripes
    # at the end every chunk holds everyone: every chunk has one stripe per rank, with a thick border
    view.draw(4)
    thick = [p for p in view.ax.patches if isinstance(p, Rectangle) and not p.get_fill() and p.get_linewidth() > 2]
    assert len(thick) == 9


def test_caption_matches_the_issue_example():
    view = AllReduceView(get_schedule("ring", 4))
    assert view.caption(3).startswith("step 3 of 6: share-reduce, ")
    assert "rank 2 sends chunk 0 to rank 3" in view.caption(3)
    assert view.caption(6).endswith("done: every rank holds the sum")


def _trace():
    records = [StepRecord(rank, step, "phase", 0.010 * (step - 1) + 0.001 * rank, 0.010 * step, 64, 64)
               for step in (1, 2) for rank in (0, 1)]
    return Trace("ring", 2, 32, "float32", records)


def test_trace_replay_puts_measured_time_on_the_axis():
    view = AllReduceView(get_schedule("ring", 2), trace=_trace())
    view.draw(1)
    assert view.caption(1).endswith("[t = 10.00 ms]")
    assert view.time_ax.get_xlim()[1] == pytest.approx(20.0 * 1.02)
    assert len(view.time_ax.patches) == 4       # one bar per (rank, step) record
    assert "measured time (ms)" in view.time_ax.get_xlabel()


def test_trace_of_another_schedule_is_rejected():
    with pytest.raises(ConfigError, match=r"the trace is of ring on 2 ranks, not of tree on 2"):
        AllReduceView(get_schedule("tree", 2), trace=_trace())


def test_bad_step_and_format_are_rejected(tmp_path):
    with pytest.raises(ConfigError, match=r"step 9 is outside 0..6 for ring"):
        AllReduceView(get_schedule("ring", 4)).draw(9)
    with pytest.raises(ConfigError, match=r"cannot write an animation to 'a.mp4'; use a .html or .gif"):
        save_animation(get_schedule("ring", 4), tmp_path / "a.mp4")


def test_gif_replays_a_trace(tmp_path):
    path = save_animation(get_schedule("ring", 2), tmp_path / "trace.gif", trace=_trace())
    with Image.open(path) as im:
        assert im.n_frames == 3


def test_player_widgets_drive_the_picture(capsys):
    player = AllReducePlayer("ring", 4)
    assert (player.step.max, player.play.max) == (6, 6)
    player.step.value = 3
    assert "step 3 of 6: share-reduce" in capsys.readouterr().out     # printed in the player's output area
    assert player.image.value[:8] == b"\x89PNG\r\n\x1a\n"
    player.algorithm.value = "tree"                                   # 4 ranks: 2 reduce + 2 broadcast steps
    assert player.step.max == 4
    player.ranks.value = 5
    assert player.step.max == 6 and player.render().startswith(f"step {player.step.value} of 6")
    player.algorithm.value = "all-to-all"                             # 1 step: the slider is clamped
    assert player.step.max == 1 and player.step.value == 1


def test_player_replays_a_trace_with_fixed_algorithm():
    player = AllReducePlayer(trace=_trace())
    assert player.algorithm.value == "ring" and player.ranks.value == 2 and player.algorithm.disabled
    player.step.value = 2
    assert player.render().endswith("[t = 20.00 ms]")


@pytest.mark.parametrize("p", [4, 5, 7])
def test_tree_edges_are_drawn_for_every_rank(p):
    schedule = get_schedule("tree", p)
    view = AllReduceView(schedule)
    view.draw(0)  # the start: no message yet, but every rank hangs in the tree
    edges = {tuple(sorted((t.src, t.dst))) for step in schedule.steps for t in step.transfers}
    drawn = set()
    for line in view.ax.get_lines():
        ends = list(zip(line.get_xdata(), line.get_ydata()))
        drawn.add(tuple(sorted(r for r, pos in view.positions.items() if pos in ends)))
    assert drawn == edges and len(edges) == p - 1  # a tree: p - 1 edges reaching every rank
    assert set().union(*edges) == set(range(p))


def test_html_animation_needs_no_network(tmp_path):
    from labkit.viz.allreduce import BUTTON_GLYPHS

    html = save_animation(get_schedule("ring", 3), tmp_path / "ring.html").read_text()
    assert "http://" not in html and "https://" not in html and "fa fa-" not in html
    assert all(glyph in html for glyph in BUTTON_GLYPHS.values())
