"""Notebook 08's exercise (``labkit check advisor-cost FILE``): the pipeline bubble term of the cost model.

``bubble_seconds(stage_times, stage_messages, microbatches)`` is the idle time a fill-and-drain pipeline step
adds. Stage ``j`` needs ``stage_times[j]`` seconds per micro-batch plus ``stage_messages[j]`` seconds to send
its output forward and receive the gradient back. The slowest stage sets the pace ``τ = max_j (t_j + c_j)``;
the step takes ``(m + p − 1)·τ``, of which ``m·τ`` is work, so the bubble is ``(p − 1)·τ`` — the fraction
``(p − 1)/(m + p − 1)`` of the step. The checker compares with the advisor's own textbook count
(:func:`labkit.advisor.topology.pipeline_terms`; the advisor prices plans along the critical path, which equals
this count when the stages are equal).
"""
from __future__ import annotations

from typing import Callable

from labkit.exercises import command

STARTER = '''\
def bubble_seconds(stage_times, stage_messages, microbatches):
    """Idle seconds of one fill-and-drain pipeline step (p stages, m micro-batches)."""
    p = len(stage_times)
    tau = 0.0  # TODO: the pace of the pipeline: the slowest stage, its message included
    return tau  # TODO: how many tau-long slots are idle on each stage?
'''

CASES = [  # (stage times s, message s, micro-batches)
    ([0.010, 0.013], [0.002, 0.0], 4), ([0.020, 0.005, 0.007], [0.001, 0.001, 0.0], 8),
    ([0.004, 0.004, 0.004, 0.004], [0.0005] * 3 + [0.0], 1), ([0.030], [0.0], 6), ([0.001, 0.009], [0.003, 0.0], 2)]


def expected(stage_times, stage_messages, microbatches) -> float:
    from labkit.advisor.topology import pipeline_terms

    return pipeline_terms(list(stage_times), list(stage_messages), microbatches)["bubble"]


def check(bubble_seconds: Callable) -> list[str]:
    """Problems of the learner's ``bubble_seconds``; [] when it equals the cost model's bubble term."""
    for times, messages, m in CASES:
        want = expected(times, messages, m)
        try:
            got = float(bubble_seconds(list(times), list(messages), m))
        except Exception as exc:  # the learner's code: report, do not crash
            return [f"bubble_seconds raised {type(exc).__name__}: {exc}"]
        if abs(got - want) > 1e-12 + 1e-9 * want:
            return [_diagnose(got, want, times, messages, m)]
    return []


def _diagnose(got, want, times, messages, m) -> str:
    p = len(times)
    where = f"bubble_seconds({times}, {messages}, {m}) = {got:.6g}, expected {want:.6g}"
    tau = max(t + c for t, c in zip(times, messages))
    if abs(got - (p - 1) * max(times)) < 1e-12:
        return where + ": the pace includes each stage's messages: tau = max(t + c)"
    if abs(got - tau) < 1e-12 and p != 2:
        return where + ": each stage idles for p - 1 slots of tau while the pipeline fills and drains"
    if abs(got - (p - 1) / (m + p - 1)) < 1e-12:
        return where + ": that is the bubble fraction; return seconds: (p - 1) × tau"
    if abs(got - (p - 1) * sum(t + c for t, c in zip(times, messages)) / p) < 1e-12:
        return where + ": the slowest stage sets the pace, not the average: tau = max(t + c)"
    return where + ": the step is (m + p - 1) × tau and m × tau of it is work; the rest is the bubble"


def reference(stage_times, stage_messages, microbatches):
    """The solution, written from the formula."""
    tau = max(t + c for t, c in zip(stage_times, stage_messages))
    return (len(stage_times) - 1) * tau


def main(argv: list[str]) -> int:
    return command("advisor-cost", __doc__, "bubble_seconds", check,
                   "bubble_seconds equals the advisor's pipeline bubble term (p - 1) × max_j (t_j + c_j)", argv)
