"""Notebook 01b's exercise (``labkit check staleness FILE``): the staleness of each update, from a server log.

``staleness(events)`` reads what one parameter server saw, in order: ``("pull", w)`` when worker ``w`` got
the current parameters, ``("push", w)`` when the server applied ``w``'s gradient (one update, the version
goes up by 1). It returns, for every push in order, the *staleness* of that update: how many updates the
server applied between the worker's last pull and this push, i.e. ``version now − version pulled``.
Synchronous training gives all zeros within a round's first push; asynchronous training does not.

The checker replays random logs and compares with the definition the parameter-server strategy records
(``labkit.strategies.ps.server``: ``staleness = version − sent_version[worker]``).
"""
from __future__ import annotations

import random
from typing import Callable

from labkit.exercises import command

STARTER = '''\
def staleness(events):
    """events: [("pull", worker) or ("push", worker), ...] in the order the server saw them.
    Returns the staleness of every push, in order: updates applied since that worker's last pull."""
    version = 0          # updates applied so far
    pulled = {}          # worker -> version it last pulled
    out = []
    for kind, worker in events:
        pass  # TODO: remember the version on a pull; on a push, record the staleness and apply the update
    return out
'''


def reference(events):
    """The solution, written from the definition."""
    version, pulled, out = 0, {}, []
    for kind, worker in events:
        if kind == "pull":
            pulled[worker] = version
        else:
            out.append(version - pulled[worker])
            version += 1
    return out


def random_log(workers: int, pushes: int, seed: int) -> list[tuple[str, int]]:
    """An asynchronous server's log: every worker pulls, then pushes and pulls again in a random order."""
    rng = random.Random(seed)
    events = [("pull", w) for w in range(workers)]
    for _ in range(pushes):
        w = rng.randrange(workers)
        events += [("push", w), ("pull", w)]
    return events


CASES = [[("pull", 0), ("push", 0), ("pull", 0), ("push", 0)],                      # one worker: never stale
         [("pull", 0), ("pull", 1), ("push", 0), ("push", 1), ("pull", 0), ("pull", 1)],  # a sync round
         *(random_log(w, 12, seed) for seed, w in enumerate((2, 3, 4, 3)))]


def check(staleness: Callable) -> list[str]:
    """Problems of ``staleness`` on the cases; [] when it matches the definition everywhere."""
    for events in CASES:
        want = reference(events)
        try:
            got = list(staleness(list(events)))
        except Exception as exc:  # the learner's code: say what it raised, do not crash
            return [f"staleness raised {type(exc).__name__}: {exc}"]
        if len(got) != len(want):
            return [f"for {events[:6]}... expected one value per push ({len(want)}), got {len(got)}"]
        if got != want:
            i = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
            hint = ("count the updates applied since the worker's last pull, not since its last push"
                    if any(g > w for g, w in zip(got, want)) else
                    "each push is one update: the version rises after every push, not every round")
            return [f"push #{i} of {events}: staleness {got[i]}, expected {want[i]} ({hint})"]
    return []


def main(argv: list[str]) -> int:
    return command("staleness", __doc__, "staleness", check,
                   "staleness(events) equals the parameter server's record: version now − version pulled", argv)
