"""Notebooks driven like a learner does: JupyterLab in headless Chromium, Run All, then play.

The all-reduce player (notebook 01) must render, follow its step slider and animate; the training
notebook (00) must draw its plot. Screenshots of the elements land in ``test-artifacts/``.

The browser runs one notebook prepared from the real ones' cells: each notebook up to the cell a
test looks at (the player; the training plot), so one kernel and one page load serve both tests and
no cell runs that no check needs. nbval executes every notebook in full elsewhere.

Contract with the player (``labkit.viz.player``; any widget layout that keeps it will do): one
output holds an ipywidgets ``Play`` in a row with the ``IntSlider`` of the step, a drawing (img,
canvas or svg), and a caption as text reading ``step N of M: ...`` for the step drawn.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from .jupyter_browser import JupyterLab, assert_all_ran, open_notebook, prepare_notebook, run_all
from .provision import REPO, unavailable, wait_for

pytestmark = pytest.mark.system

PLAYER_NOTEBOOK = "01_allreduce.ipynb"
TRAINING_NOTEBOOK = "00_single_device.ipynb"
PLAYER_CELL = "allreduce_player("  # a marker in the source of the cell each test looks at
PLOT_CELL = "results.plot_metric("
CAPTION = re.compile(r"step (\d+) of (\d+)")
RUN_ALL_TIMEOUT_S = 300  # quick mode promises < 3 min per notebook on 2 cores


@pytest.fixture(scope="module")
def ran(jupyter_server: JupyterLab, module_tab) -> Iterator[object]:
    """The tab after Run All of notebook 01 up to its player and notebook 00 up to its plot, every cell run."""
    for name in (PLAYER_NOTEBOOK, TRAINING_NOTEBOOK):
        if not (REPO / "notebooks" / name).exists():
            unavailable(f"notebooks/{name} does not exist (yet)")
    path = prepare_notebook(jupyter_server, "browser_check.ipynb",
                            [(PLAYER_NOTEBOOK, PLAYER_CELL), (TRAINING_NOTEBOOK, PLOT_CELL)])
    try:
        open_notebook(module_tab, jupyter_server, path)
        assert_all_ran(module_tab, run_all(module_tab, timeout_s=RUN_ALL_TIMEOUT_S), path)
        yield module_tab
    finally:
        jupyter_server.shutdown_kernels()


def test_allreduce_player_renders_steps_and_plays(ran, page, artifacts: Path) -> None:
    outputs = page.locator(".jp-OutputArea-output")
    player = outputs.filter(has=page.locator(".widget-play")).filter(
        has=page.locator(".widget-slider")).first
    player.wait_for(state="visible", timeout=30_000)
    player.scroll_into_view_if_needed()
    drawing = player.locator("img, canvas, svg").first
    box = drawing.bounding_box()
    assert box and box["width"] > 100 and box["height"] > 100, f"player draws nothing: {box}"

    caption = player.get_by_text(CAPTION).first
    # The step slider is the one beside the Play widget (the player may have other sliders).
    handle = player.locator(".widget-hbox", has=page.locator(".widget-play")).locator(
        ".widget-slider .noUi-handle").first
    shown: list[str] = []

    def step() -> tuple[int, int]:
        text = caption.inner_text()
        shown.append(text)
        match = CAPTION.search(text)
        assert match, f"caption lost its 'step N of M' text: {text!r}"
        return int(match[1]), int(match[2])

    def settle() -> tuple[int, int]:
        """The caption for the slider's final value (interact redraws intermediate ones)."""
        last: list[tuple[int, int]] = []

        def same_twice() -> tuple[int, int] | None:
            last.append(step())
            return last[-1] if len(last) > 1 and last[-1] == last[-2] else None
        return wait_for(same_twice, 30, "the player's caption to settle", interval=0.5)

    handle.focus()
    page.keyboard.press("Home")
    first, total = settle()
    assert first < total, f"player at its first step shows {shown[-1]!r}"
    before = player.screenshot(path=str(artifacts / "01_allreduce-player-first-step.png"))

    handle.focus()
    page.keyboard.press("End")
    wait_for(lambda: step() == (total, total), 30,
             f"caption 'step {total} of {total}' after moving the slider to its end "
             f"(saw {shown[-3:]})", interval=0.5)
    after = player.screenshot(path=str(artifacts / "01_allreduce-player-last-step.png"))
    assert after != before, "moving the step slider did not change what the player draws"

    handle.focus()
    page.keyboard.press("Home")
    # wait for the first step itself: on a busy machine the redraw can lag behind two equal captions
    wait_for(lambda: step() == (first, total), 30,
             f"caption 'step {first} of {total}' after moving the slider back (saw {shown[-3:]})", interval=0.5)
    start = first
    player.locator(".widget-play button").first.click()  # the play button

    def past(n: int):
        def check() -> int | None:
            k = step()[0]
            return k if k > n else None
        return check
    advanced = wait_for(past(start), 30, f"Play to advance past step {start} (saw {shown[-3:]})",
                        interval=0.2)
    wait_for(past(advanced), 30, f"Play to keep advancing past step {advanced}", interval=0.2)
    player.screenshot(path=str(artifacts / "01_allreduce-player-playing.png"))


def test_training_notebook_draws_its_plot(ran, page, artifacts: Path) -> None:
    cell = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell", has_text=PLOT_CELL).last
    plots = cell.locator(".jp-OutputArea-output img")
    assert plots.count() >= 1, f"no plot (img) in the output of the training notebook's cell with {PLOT_CELL!r}"
    plot = plots.last
    plot.scroll_into_view_if_needed()
    width = plot.evaluate("img => img.complete ? img.naturalWidth : 0")
    assert width > 100, f"the plot image did not decode (naturalWidth {width})"
    plot.screenshot(path=str(artifacts / "00_single_device-plot.png"))
