"""Pipeline schedules as they ran: Gantt charts of measured timelines, measured vs theoretical bubbles,
peak activation memory per stage, and the GPipe micro-batch sweep.

    trace = load_trace("runs/pipe-gpipe/timeline.json")   # written by --strategy pipeline --pipeline-trace
    plot_schedule(trace)                                   # ranks × time, F/B boxes labelled by micro-batch
    compare_schedules({"GPipe": load_trace(a), "1F1B": load_trace(b)})

The bubble of one step is measured as ``1 - busy_r / span`` per rank, where ``busy_r`` is the time rank
``r`` spent in forward/backward compute (F, B, W, BW) and ``span`` runs from the first compute start to the last
compute end over all ranks; communication waits count as idle. It is printed next to the bubble of the same
schedule simulated from its action lists (:mod:`labkit.parallel.pp_simulate`: equal stage times, free
communication; GPipe's and 1F1B's ``(p - 1) / (m + p - 1)``), never instead of it. :func:`ideal_trace` draws that
simulation, for the concept figures and beside a measured run, and is labelled as such.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

from labkit.viz.figcheck import legend_beside
from labkit.viz.timeline import plot_timeline
from labkit.viz.units import plain_log_ticks

TRACE_SCHEMA = "labkit.pipeline-trace/1"
COMPUTE = ("F", "B", "W", "BW")
PHASE = {"F": "forward", "B": "backward", "BW": "backward", "W": "weight"}


def load_trace(path: str | Path) -> dict:
    """Read a timeline written by ``labkit train --strategy pipeline --pipeline-trace FILE`` (or ``--mesh ...pp=N``)."""
    trace = json.loads(Path(path).read_text())
    if trace.get("schema") != TRACE_SCHEMA:
        raise ValueError(f"{path} is not a pipeline timeline (schema {trace.get('schema')!r}, "
                         f"expected {TRACE_SCHEMA!r})")
    return trace


def theoretical_bubble(stages: int, microbatches: int, schedule: str = "gpipe", virtual: int = 1,
                       costs: tuple = (1, 1, 1)) -> float:
    """Idle fraction of ``schedule`` simulated from its action lists (equal stages, free communication, per-stage
    costs ``(t_F, t_B, t_W)``): GPipe's and 1F1B's ``(p - 1) / (m + p - 1)``."""
    return float(_simulated(schedule, stages, microbatches, virtual, costs).bubble)


def _simulated(schedule: str, stages: int, microbatches: int, virtual: int = 1, costs: tuple = (1, 1, 1)):
    from labkit.parallel.pp_schedule import pipe_schedule
    from labkit.parallel.pp_simulate import simulate

    return simulate(pipe_schedule(schedule, stages, microbatches, virtual), *costs)


def step_events(trace: Mapping, step: int | None = None) -> list[dict]:
    """Events of one recorded step (default: the last one), times shifted so the first compute starts at 0."""
    steps = sorted({e["step"] for e in trace["events"]})
    if not steps:
        raise ValueError("the trace holds no recorded step; train for more steps than --trace-steps skips")
    step = steps[-1] if step is None else step
    if step not in steps:
        raise ValueError(f"step {step} was not recorded; recorded steps: {steps}")
    events = [e for e in trace["events"] if e["step"] == step]
    origin = min(e["start"] for e in events if e["kind"] in COMPUTE)
    return [{**e, "start": e["start"] - origin, "end": e["end"] - origin} for e in events]


def bubble_fraction(trace: Mapping, step: int | None = None) -> dict:
    """Measured idle fraction per rank and on average for one step, with the theoretical value beside it.

    Returns:
        ``{"per_rank": {rank: fraction}, "measured": mean over ranks, "theoretical": (p-1)/(m+p-1),
        "span_s": span of the step, "wait_s": {rank: seconds blocked on communication}}``.
    """
    events = step_events(trace, step)
    compute = [e for e in events if e["kind"] in COMPUTE]
    span = max(e["end"] for e in compute) - min(e["start"] for e in compute)
    ranks = sorted({e["rank"] for e in events})
    busy = {r: sum(e["end"] - e["start"] for e in compute if e["rank"] == r) for r in ranks}
    per_rank = {r: 1 - busy[r] / span for r in ranks}
    waits = {r: sum(e["end"] - e["start"] for e in events if e["rank"] == r and e["kind"] == "wait") for r in ranks}
    micro = max(e["mb"] for e in compute) + 1
    theory = theoretical_bubble(len(ranks), micro, trace.get("schedule", "gpipe"), trace.get("virtual", 1))
    return {"per_rank": per_rank, "measured": sum(per_rank.values()) / len(ranks),
            "theoretical": theory, "span_s": span, "wait_s": waits}


def plot_schedule(trace: Mapping, step: int | None = None, ax=None, title: str | None = None, unit: str = "ms"):
    """Gantt chart of one measured step: a row per rank, forward boxes solid, backward hatched, each labelled
    with its micro-batch; grey bars underneath are waits on communication. The title gives the measured
    bubble next to the theoretical one. An idealised trace (:func:`ideal_trace`) is drawn in its own units (one
    stage's forward = 1), whatever ``unit`` says."""
    import matplotlib.pyplot as plt

    events = step_events(trace, step)
    if trace.get("idealised"):
        unit = "s"  # no seconds: the simulated clock counts forward passes, drawn as they are
    scale = {"s": 1.0, "ms": 1e3, "us": 1e6}[unit]
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.7 + 0.6 * trace["num_stages"]))
    intervals = [{"stage": e["rank"], "device": f"rank {e['rank']}", "micro_batch": e["mb"],
                  "phase": PHASE[e["kind"]], "start": e["start"], "end": e["end"]}
                 for e in events if e["kind"] in COMPUTE]
    plot_timeline(intervals, ax=ax, unit=unit)
    ranks = sorted({e["stage"] for e in intervals})
    for e in events:
        if e["kind"] == "wait" and e["end"] > e["start"]:
            y = ranks.index(e["rank"]) if e["rank"] in ranks else e["rank"]
            ax.broken_barh([(e["start"] * scale, (e["end"] - e["start"]) * scale)], (y + 0.38, 0.12),
                           facecolors="0.55", linewidth=0)
    bubble = bubble_fraction(trace, step)
    name = title or f"{trace['schedule']}: {trace['num_stages']} stages, {trace['num_microbatches']} micro-batches"
    if trace.get("idealised"):
        summary = f"IDEALISED (not measured): simulated bubble {bubble['theoretical']:.0%}"
    else:
        summary = f"bubble measured {bubble['measured']:.0%}, simulated {bubble['theoretical']:.0%}"
    ax.set_title(f"{name}\n{summary}", fontsize=10)
    clock = ("time in the step (idealised units: one stage's forward of one micro-batch = 1)"
             if trace.get("idealised") else f"time in the step ({unit})")
    ax.set_xlabel(f"{clock}\nnumber = micro-batch, hatched = backward (dotted: W), grey = comm wait", fontsize=8)
    return ax


def peak_memory(trace: Mapping) -> dict[int, float]:
    """Per rank: the largest bytes of saved activations over the recorded steps, in MB."""
    peaks: dict[int, float] = {}
    for m in trace["memory"]:
        peaks[m["rank"]] = max(peaks.get(m["rank"], 0.0), m["saved_peak_bytes"] / 2**20)
    return dict(sorted(peaks.items()))


def compare_schedules(traces: Mapping[str, Mapping], step: int | None = None, unit: str = "ms"):
    """Measured Gantt charts side by side on one time axis, plus peak activation memory per stage."""
    import matplotlib.pyplot as plt

    stages = max(t["num_stages"] for t in traces.values())
    fig, axes = plt.subplots(1, len(traces) + 1, figsize=(5.5 * len(traces) + 3.5, 1.2 + 0.7 * stages),
                             gridspec_kw={"width_ratios": [3] * len(traces) + [1.4]})
    for ax, (name, trace) in zip(axes, traces.items()):
        plot_schedule(trace, step, ax=ax, title=name, unit=unit)
    right = max(ax.get_xlim()[1] for ax in axes[:-1])
    for ax in axes[:-1]:
        ax.set_xlim(0, right)
    if not any(t["memory"] for t in traces.values()):
        axes[-1].set_axis_off()
        fig.tight_layout()
        return fig
    width = 0.8 / len(traces)
    for i, (name, trace) in enumerate(traces.items()):
        peaks = peak_memory(trace)
        axes[-1].bar([r + i * width for r in peaks], list(peaks.values()), width, label=name)
    axes[-1].set_xticks([r + width * (len(traces) - 1) / 2 for r in range(stages)])
    axes[-1].set_xticklabels([f"rank {r}" for r in range(stages)])
    axes[-1].set_ylabel("peak saved activations (MB)")
    axes[-1].set_title("memory per stage (measured)", fontsize=10)
    axes[-1].legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_sweep(records: Sequence[Mapping]):
    """The GPipe micro-batch sweep (``labkit bench gpipe sweep`` records): throughput and peak memory against
    the number of micro-batches, one line per checkpoint mode."""
    import matplotlib.pyplot as plt

    fig, (speed, memory) = plt.subplots(1, 2, figsize=(10, 3.5))
    for mode in dict.fromkeys(r["checkpoint"] for r in records):
        rows = sorted((r for r in records if r["checkpoint"] == mode), key=lambda r: r["chunks"])
        chunks = [r["chunks"] for r in rows]
        speed.plot(chunks, [r["samples_per_sec"] for r in rows], marker="o", label=f"checkpoint {mode}")
        memory.plot(chunks, [r["peak_memory_gb"] * 1024 for r in rows], marker="o", label=f"checkpoint {mode}")
    kind = records[0].get("memory_kind", "peak memory")
    counts = sorted({r["chunks"] for r in records})
    for ax, label in ((speed, "samples/sec"), (memory, f"peak memory (MB)\n{kind}")):
        ax.set_xscale("log", base=2)
        plain_log_ticks(ax, "x", counts)
        ax.yaxis.get_major_formatter().set_useOffset(False)
        ax.set_xlabel("micro-batches per batch")
        ax.set_ylabel(label, fontsize=8)
        ax.grid(alpha=0.3)
    legend_beside(memory, fontsize=8)  # one legend for both (measured: no place inside is free in every run)
    fig.suptitle(f"GPipe micro-batch sweep, batch {records[0]['batch_size']}, balance {records[0]['balance']} "
                 "(measured)", fontsize=10)
    fig.tight_layout()
    return fig


def ideal_trace(stages: int, microbatches: int, schedule: str = "gpipe", forward: float = 1.0,
                backward: float = 2.0, virtual: int | None = None, weight: float | None = None) -> dict:
    """The schedule simulated from its action lists (:mod:`labkit.parallel.pp_simulate`) with equal stage times and
    free communication, in the trace format: ``forward`` per stage, ``backward`` the whole backward (``weight`` of
    it the W part: half by default), ``virtual`` chunks per rank (None: the schedule's own).

    For concept figures and beside a measured run: it is marked ``"idealised": True`` and :func:`plot_schedule`
    says so. ``schedule``: any of :data:`labkit.parallel.pp_schedule.SCHEDULE_NAMES`.
    """
    from labkit.parallel.pp_schedule import CHUNKS, SCHEDULE_NAMES

    if schedule not in SCHEDULE_NAMES:
        raise ValueError(f"schedule {schedule!r}: choose one of {', '.join(SCHEDULE_NAMES)}")
    v = virtual or CHUNKS[schedule] or 2
    w = backward / 2 if weight is None else weight
    result = _simulated(schedule, stages, microbatches, v, (forward, backward - w, w))
    events = [{"rank": r, "step": 0, "kind": a.kind, "mb": a.mb, "stage": a.stage, "start": float(t0),
               "end": float(t1)} for r, spans in enumerate(result.spans) for a, t0, t1 in spans]
    return {"schema": TRACE_SCHEMA, "schedule": schedule, "num_stages": stages, "num_microbatches": microbatches,
            "virtual": v, "idealised": True, "events": events, "memory": [], "peak_in_flight": result.peak}


def animate_schedule(schedule: str, stages: int, microbatches: int, virtual: int | None = None,
                     interval_ms: int = 300):
    """The simulated schedule (:func:`ideal_trace`) drawn one time unit at a time: frame ``k`` shows every action
    that started before ``t = k``, so the bubble is the white space the frames leave behind. A
    ``matplotlib.animation.FuncAnimation`` (``.to_jshtml()`` in a notebook); its frames are the time units."""
    import math

    import matplotlib.pyplot as plt
    from matplotlib.animation import FuncAnimation

    trace = ideal_trace(stages, microbatches, schedule, virtual=virtual)
    end = max(e["end"] for e in trace["events"])
    fig, ax = plt.subplots(figsize=(9, 0.7 + 0.6 * stages))

    def draw(frame: int):
        ax.clear()
        shown = [e for e in trace["events"] if e["start"] < frame] or trace["events"][:1]
        plot_schedule({**trace, "events": shown}, ax=ax, unit="s",
                      title=f"{schedule}: {stages} ranks, {microbatches} micro-batches, t = {min(frame, end):g}")
        ax.set_xlim(0, end)
        return []
    return FuncAnimation(fig, draw, frames=range(1, math.ceil(end) + 1), interval=interval_ms, blit=False)
