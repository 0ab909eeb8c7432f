"""Notebooks driven like a learner does: JupyterLab in headless Chromium, Run All, then play.

The all-reduce player (notebook 01) must render, follow its step slider and animate; a training
notebook must draw its plot. Screenshots of the elements land in ``test-artifacts/``.

Contract with the player (``labkit.viz.player``; any widget layout that keeps it will do): one
output holds an ipywidgets ``Play`` in a row with the ``IntSlider`` of the step, a drawing (img,
canvas or svg), and a caption as text reading ``step N of M: ...`` for the step drawn.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from .jupyter_browser import JupyterLab, assert_all_ran, open_notebook, run_all
from .provision import REPO, unavailable, wait_for

pytestmark = pytest.mark.system

PLAYER_NOTEBOOK = "01_allreduce.ipynb"
TRAINING_NOTEBOOK = "00_single_device.ipynb"
CAPTION = re.compile(r"step (\d+) of (\d+)")
RUN_ALL_TIMEOUT_S = 300  # quick mode promises < 3 min per notebook on 2 cores


def _open_and_run(page, server: JupyterLab, name: str) -> None:
    if not (REPO / "notebooks" / name).exists():
        unavailable(f"notebooks/{name} does not exist (yet)")
    open_notebook(page, server, f"notebooks/{name}")
    assert_all_ran(page, run_all(page, timeout_s=RUN_ALL_TIMEOUT_S), name)


def test_allreduce_player_renders_steps_and_plays(jupyter_server: JupyterLab, page,
                                                  artifacts: Path) -> None:
    _open_and_run(page, jupyter_server, PLAYER_NOTEBOOK)
    try:
        outputs = page.locator(".jp-OutputArea-output")
        player = outputs.filter(has=page.locator(".widget-play")).filter(
            has=page.locator(".widget-slider")).first
        player.wait_for(state="visible", timeout=10_000)
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
    finally:
        jupyter_server.shutdown_kernels()


def test_training_notebook_draws_its_plot(jupyter_server: JupyterLab, page,
                                          artifacts: Path) -> None:
    _open_and_run(page, jupyter_server, TRAINING_NOTEBOOK)
    try:
        plots = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-OutputArea-output img")
        assert plots.count() >= 1, "no plot (img) in any output of the training notebook"
        plot = plots.last  # the results plot comes after the training run
        plot.scroll_into_view_if_needed()
        width = plot.evaluate("img => img.complete ? img.naturalWidth : 0")
        assert width > 100, f"the plot image did not decode (naturalWidth {width})"
        plot.screenshot(path=str(artifacts / "00_single_device-plot.png"))
    finally:
        jupyter_server.shutdown_kernels()
