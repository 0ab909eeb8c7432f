"""Notebook 04b's exercise (``labkit check pp-schedule FILE``): write ZB-H1's action lists.

``zb_h1_actions(p, m)`` returns, for each of ``p`` ranks (one stage each, stage ``r`` on rank ``r``), the list of its
actions in order, each a tuple ``(kind, stage, micro-batch)``: ``"F"`` forward, ``"B"`` the input gradient only,
``"W"`` the weight gradients. The checker runs the lists in the simulator (:mod:`labkit.parallel.pp_simulate`),
names the first action that breaks a rule (a W before its B, an action on another rank's stage, a receive whose
send never comes: the deadlock), and reports the bubble. Right means ZB-H1's: every rank idles
``(p − 1)(t_F + t_B − t_W)``, never more than ``p`` micro-batches' activations in flight (1F1B's peak), for several
``p``, ``m`` and costs.
"""
from __future__ import annotations

from fractions import Fraction
from typing import Callable

from labkit.exercises import command

STARTER = '''\
def zb_h1_actions(p, m):
    """ZB-H1's actions for p ranks (stage r on rank r) and m >= p micro-batches:
    actions[r] = [(kind, stage, micro_batch), ...] with kind "F", "B" (input gradient) or "W" (weight gradients)."""
    actions = []
    for r in range(p):
        warm = min(p - r, m)                      # forwards before the first backward, as in 1F1B
        acts = [("F", r, j) for j in range(warm)]
        for j in range(m):
            acts.append(("B", r, j))
            acts.append(("W", r, j))              # TODO: hold this W back so that it fills a wait for a gradient
            if warm + j < m:
                acts.append(("F", r, warm + j))
        # TODO: the W held back run at the end
        actions.append(acts)
    return actions
'''

CASES = [(2, 4, (1, 1, 1)), (4, 8, (1, 1, 1)), (3, 5, (2, 2, 1)), (4, 6, (3, 2, 1))]


def _schedule(lists, p: int, m: int):
    from labkit.parallel.pp_schedule import Action, PipeSchedule
    from labkit.parallel.pp_simulate import PipelineScheduleError

    try:
        actions = tuple(tuple(Action(str(k), int(s), int(j)) for k, s, j in acts) for acts in lists)
    except (TypeError, ValueError) as exc:
        raise PipelineScheduleError(f"each action is a tuple (kind, stage, micro_batch): {exc}") from None
    return PipeSchedule("yours", p, m, 1, "loop", actions)


def check(zb_h1_actions: Callable) -> list[str]:
    """Problems of the learner's lists; [] when each case is ZB-H1: valid, its bubble, its memory."""
    from labkit.parallel.pp_simulate import PipelineScheduleError, simulate

    for p, m, (t_f, t_b, t_w) in CASES:
        where = f"zb_h1_actions({p}, {m})"
        try:
            lists = zb_h1_actions(p, m)
        except Exception as exc:  # the learner's code: report, do not crash
            return [f"{where} raised {type(exc).__name__}: {exc}"]
        try:
            result = simulate(_schedule(lists, p, m), t_f, t_b, t_w)
        except PipelineScheduleError as exc:
            return [f"{where}: {exc}"]
        want = (p - 1) * (t_f + t_b - t_w)
        costs = f"t_F, t_B, t_W = {t_f}, {t_b}, {t_w}"
        worst = max(result.idle)
        if worst > want:
            rank = result.idle.index(worst)
            if worst == (p - 1) * (t_f + t_b):
                hint = ("each W runs right after its B, where nobody waits for it; hold it back: rank r runs the W "
                        "of micro-batch j − r after the B of micro-batch j, the rest at the end")
            elif worst == (p - 1) * (t_f + t_b + t_w):
                hint = "that is 1F1B's bubble: split each backward into B, sent at once, and a W run later"
            else:
                hint = "some W is not yet where its rank waits for a gradient"
            return [f"{where} ({costs}): rank {rank} idles {_num(worst)}; ZB-H1 idles (p − 1)(t_F + t_B − t_W) = "
                    f"{_num(want)}: {hint}"]
        if max(result.peak) > p:
            rank = result.peak.index(max(result.peak))
            return [f"{where}: rank {rank} holds {max(result.peak)} micro-batches' activations at once (an "
                    f"activation lives from its F to its W); ZB-H1 holds at most p = {p}, 1F1B's peak: run each W "
                    "sooner"]
    return []


def _num(x) -> str:
    return str(x) if not isinstance(x, Fraction) or x.denominator > 1 else str(x.numerator)


def report_bubble(zb_h1_actions: Callable, p: int = 4, m: int = 8) -> str:
    """The bubble of the learner's lists at unit costs, for the notebook's message."""
    from labkit.parallel.pp_simulate import simulate

    result = simulate(_schedule(zb_h1_actions(p, m), p, m))
    return f"p={p}, m={m}: bubble {float(result.bubble):.1%}, idle per rank {[_num(x) for x in result.idle]}"


def main(argv: list[str]) -> int:
    return command("pp-schedule", __doc__, "zb_h1_actions", check,
                   "valid, and every rank idles ZB-H1's (p − 1)(t_F + t_B − t_W) with at most p micro-batches in "
                   "flight", argv)
