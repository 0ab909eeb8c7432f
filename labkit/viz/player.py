"""An ipywidgets player for the all-reduce animations: play/pause, step slider, algorithm, world size.

    from labkit.viz.player import allreduce_player
    allreduce_player("ring", 4)             # in a notebook cell
    allreduce_player(trace=trace)           # replay a measured run (algorithm and ranks fixed by the trace)

The current step's caption (``"step 3 of 6: ..."``) is printed in the player's output area on every change.
"""
from __future__ import annotations

from labkit.collectives.execute import Trace
from labkit.collectives.registry import SCHEDULES, get_schedule
from labkit.errors import ConfigError
from labkit.viz.allreduce import AllReduceView


class AllReducePlayer:
    """The widgets and their wiring; ``.widget`` is what a notebook displays."""

    def __init__(self, algorithm: str = "ring", world_size: int = 4, trace: Trace | None = None,
                 max_world_size: int = 8, interval_ms: int = 1200):
        import ipywidgets as widgets

        if trace is not None:
            algorithm, world_size = trace.algorithm, trace.world_size
        if algorithm not in SCHEDULES:
            raise ConfigError(f"unknown algorithm {algorithm!r}; choose from {', '.join(SCHEDULES)}")
        if not 2 <= world_size <= max(max_world_size, world_size):
            raise ConfigError(f"world_size must be >= 2, got {world_size}")
        self.trace = trace
        self._views: dict[tuple[str, int], AllReduceView] = {}
        self.algorithm = widgets.Dropdown(options=list(SCHEDULES), value=algorithm, description="algorithm",
                                          disabled=trace is not None)
        self.ranks = widgets.IntSlider(value=world_size, min=2, max=max(max_world_size, world_size),
                                       description="ranks", disabled=trace is not None, continuous_update=False)
        self.step = widgets.IntSlider(value=0, min=0, max=1, description="step")
        self.play = widgets.Play(value=0, min=0, max=1, interval=interval_ms, description="play")
        widgets.jslink((self.play, "value"), (self.step, "value"))
        self.caption = widgets.Output()
        self.image = widgets.Image(format="png")
        self._reset()
        self.algorithm.observe(lambda _: self._reset(), names="value")
        self.ranks.observe(lambda _: self._reset(), names="value")
        self.step.observe(lambda _: self.render(), names="value")
        self.widget = widgets.VBox([widgets.HBox([self.algorithm, self.ranks]), widgets.HBox([self.play, self.step]),
                                    self.caption, self.image])

    def view(self) -> AllReduceView:
        """The view of the selected algorithm and world size (built once, then reused)."""
        key = (self.algorithm.value, self.ranks.value)
        if key not in self._views:
            self._views[key] = AllReduceView(get_schedule(*key), self.trace)
        return self._views[key]

    def _reset(self) -> None:
        last = self.view().num_frames - 1
        self.step.max = self.play.max = last
        if self.step.value > last:
            self.step.value = last  # observing the slider renders
        else:
            self.render()

    def render(self) -> str:
        """Draw the current step; returns (and prints in the player) its caption."""
        view = self.view()
        text = view.caption(self.step.value)
        self.image.value = view.png(self.step.value)
        self.caption.clear_output(wait=True)
        with self.caption:
            print(text)
        return text

    def _ipython_display_(self):
        from IPython.display import display

        display(self.widget)


def allreduce_player(algorithm: str = "ring", world_size: int = 4, trace: Trace | None = None,
                     max_world_size: int = 8, interval_ms: int = 1200) -> AllReducePlayer:
    """Build the player; the last expression of a cell shows it."""
    return AllReducePlayer(algorithm, world_size, trace, max_world_size, interval_ms)
