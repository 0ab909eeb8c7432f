"""How replica groups agree, step by step, through the job's store: who is in the quorum of the next step, whether
this step is committed, and the state a joining replica copies from a live peer.

A replica is one process, or a mesh of W processes (``--mesh``: its ranks, "coordinates" ``c = 0 .. W-1``, each
holding the same part of the model as coordinate ``c`` of every other replica). One step ``k`` of ``--strategy ft``
(:mod:`labkit.strategies.ft`), on every coordinate of every member of its quorum:

1. all-reduce the gradients over the quorum's own gloo group of coordinate ``c`` (:meth:`Quorum.all_reduce`; one
   group per coordinate, formed once per membership under the store prefix ``labkit/ft/pg/<id>/<c>``, with the
   ``--ft-timeout-s`` timeout);
2. vote: ``labkit/ft/vote/<k>/<replica>/<c>`` = 1 when the all-reduce completed, 0 when it failed
   (:meth:`Quorum.vote`);
3. the first voter to see all ``Q × W`` votes, or the deadline, writes the decision with ``compare_set`` (first
   writer wins, so every coordinate of every member reads the same one): the step is **committed** only if every
   coordinate of every member voted 1, else it is **discarded** (not applied, anywhere); the next quorum is the
   members all of whose coordinates voted (a replica with a dead process misses a vote) plus the replicas that
   asked to join since the last decision.

A joining replica (:meth:`Quorum.join`) asks once, from coordinate 0, with ``labkit/ft/want/<n>``, and each of its
coordinates waits for ``labkit/ft/heal/<replica>/<incarnation>/<c>``: the weights, optimizer and schedule that
coordinate ``c`` of the lowest surviving member publishes at the start of the step the joiner enters
(:meth:`Quorum.publish`). Every wait has a deadline and ends in one :class:`FaultToleranceError` line, never a hang.

Store round trips per committed step of a quorum of Q replicas of W coordinates: one ``set`` and one ``add`` per
vote, the last voter's ``compare_set``, one ``get`` of the decision per voter (plus a ``wait`` for the others), and
the ``joins`` counter read by the decider: about ``4QW + 2``. No torch collective besides the gradients'
all-reduce.
"""
from __future__ import annotations

import datetime
import io
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from labkit.errors import LabkitError

PREFIX = "labkit/ft/"
#: seconds the first quorum waits for every replica to start (importing torch on a busy machine is slow)
FIRST_GROUP_S = 120.0


class FaultToleranceError(LabkitError):
    """A wait of the replica protocol passed its deadline, or this replica fell out of the quorum."""

    exit_code = 3  # the supervisor restarts a replica that ends this way


@dataclass(frozen=True)
class Decision:
    """What the quorum decided at the end of ``step``: committed or discarded, the members of the next step, how many
    join requests have been served in all, and the (replica, incarnation) pairs admitted by this decision."""

    step: int
    committed: bool
    members: tuple[int, ...]
    joins: int
    joiners: tuple[tuple[int, int], ...] = ()

    def text(self) -> str:
        joiners = ",".join(f"{r}:{i}" for r, i in self.joiners)
        return f"{int(self.committed)};{','.join(map(str, self.members))};{self.joins};{joiners}"

    @classmethod
    def parse(cls, step: int, text: str) -> Decision:
        committed, members, joins, joiners = text.split(";")
        pairs = tuple(tuple(map(int, p.split(":"))) for p in joiners.split(",") if p)
        return cls(step, committed == "1", tuple(int(m) for m in members.split(",") if m), int(joins), pairs)


def connect(address: str, timeout_s: float) -> dist.TCPStore:
    """A client of the job's store at ``host:port`` (the supervisor hosts it)."""
    host, _, port = address.rpartition(":")
    # (host, port, world_size, is_master, timeout, wait_for_workers): positional, as the binding has no signature
    return dist.TCPStore(host, int(port), None, False, datetime.timedelta(seconds=timeout_s), False)


class Quorum:
    """This replica's view of the protocol: the members of the current step and their gloo group."""

    def __init__(self, store: dist.Store, replica: int, replicas: int, timeout_s: float, coordinate: int = 0,
                 width: int = 1):
        self.store, self.replica, self.timeout_s = store, replica, timeout_s
        self.coordinate, self.width = coordinate, width  # this process's rank in its replica, the replica's ranks
        self.members: tuple[int, ...] = tuple(range(replicas))
        self.group_id = 0  # the step the current membership began at: the group's store prefix
        self.joins = 0  # join requests served so far (from the last decision)
        self._group: dist.ProcessGroup | None = None
        self._group_of = -1
        # 1: first start; more: a restart (a replica's coordinates restart together, so they count alike)
        self.incarnation = int(store.add(self._key("incarnation", replica, coordinate), 1))

    def _key(self, *parts) -> str:
        return PREFIX + "/".join(map(str, parts))

    def _wait(self, key: str, seconds: float, what: str) -> bytes:
        try:
            self.store.wait([key], datetime.timedelta(seconds=seconds))
        except (dist.DistError, RuntimeError):
            raise FaultToleranceError(f"replica {self.replica} waited {seconds:g} s for {what}; "
                                      "raise --ft-timeout-s on a slow machine") from None
        return self.store.get(key)

    # ----- one step -----------------------------------------------------------------------------------------

    def all_reduce(self, flat: torch.Tensor) -> bool:
        """Sum ``flat`` (CPU) over the members; False when a member is gone (the caller votes to discard)."""
        if len(self.members) == 1:
            return True
        try:
            if self._group_of != self.group_id:
                timeout = FIRST_GROUP_S if self.group_id == 0 else self.timeout_s
                prefixed = dist.PrefixStore(self._key("pg", self.group_id, self.coordinate), self.store)
                self._group = dist.ProcessGroupGloo(prefixed, self.members.index(self.replica), len(self.members),
                                                    datetime.timedelta(seconds=timeout))
                self._group_of = self.group_id
            self._group.allreduce([flat]).wait()
            return True
        except (dist.DistError, RuntimeError):
            self._group, self._group_of = None, -1  # a failed group is not used again
            return False

    def vote(self, step: int, ok: bool) -> Decision:
        """Post this member's vote on ``step`` and return the decision every member reads alike."""
        self.store.set(self._key("vote", step, self.replica, self.coordinate), "1" if ok else "0")
        arrived = int(self.store.add(self._key("votes", step), 1))
        key = self._key("decision", step)
        if arrived < len(self.members) * self.width:
            try:
                self.store.wait([key], datetime.timedelta(seconds=self.timeout_s))
            except (dist.DistError, RuntimeError):
                pass  # a member never voted: decide with the votes there are
        if not self.store.check([key]):
            self.store.compare_set(key, "", self._decide(step).text())
        decision = Decision.parse(step, self.store.get(key).decode())
        if self.replica not in decision.members:
            raise FaultToleranceError(f"replica {self.replica} fell out of the quorum at step {step} (a vote of its "
                                      "came after the deadline, or one of its processes is gone); it restarts and "
                                      "heals from a peer")
        if decision.members != self.members or not decision.committed:
            self.group_id = step + 1  # a new membership, or a group that failed: a fresh group next step
        self.members, self.joins = decision.members, decision.joins
        return decision

    def _decide(self, step: int) -> Decision:
        votes = {}  # member -> all its coordinates voted 1; only members all of whose coordinates voted
        for m in self.members:
            keys = [self._key("vote", step, m, c) for c in range(self.width)]
            if all(self.store.check([key]) for key in keys):
                votes[m] = all(self.store.get(key) == b"1" for key in keys)
        committed = len(votes) == len(self.members) and all(votes.values())
        joins = int(self.store.add(self._key("joins"), 0))
        latest: dict[int, int] = {}
        for n in range(self.joins + 1, joins + 1):
            replica, incarnation = map(int, self.store.get(self._key("want", n)).decode().split(":"))
            latest[replica] = max(incarnation, latest.get(replica, 0))
        members = tuple(sorted(set(votes) | set(latest)))
        return Decision(step, committed, members, joins, tuple(sorted(latest.items())))

    # ----- healing ------------------------------------------------------------------------------------------

    def source(self, decision: Decision) -> int | None:
        """The member that publishes the state for ``decision``'s joiners: the lowest that voted (not a joiner)."""
        joining = {r for r, _ in decision.joiners}
        voters = [m for m in decision.members if m not in joining]
        return min(voters) if voters else None

    def publish(self, decision: Decision, state: dict) -> None:
        """Write ``state`` (this coordinate's, taken before the step after ``decision.step``) for the same coordinate
        of each of ``decision``'s joiners."""
        buffer = io.BytesIO()
        torch.save({**state, "members": decision.members, "group_id": self.group_id, "joins": decision.joins},
                   buffer)
        for replica, incarnation in decision.joiners:
            self.store.set(self._key("heal", replica, incarnation, self.coordinate), buffer.getvalue())

    def join(self) -> dict:
        """Ask to join the live run (coordinate 0 asks for the whole replica) and return the state the same coordinate
        of a peer published for this one (its ``members``, ``group_id``, ``joins`` are taken over here)."""
        if self.coordinate == 0:
            n = int(self.store.add(self._key("joins"), 1))
            self.store.set(self._key("want", n), f"{self.replica}:{self.incarnation}")
        started = time.monotonic()
        blob = self._wait(self._key("heal", self.replica, self.incarnation, self.coordinate),
                          max(self.timeout_s * 4, 30.0),
                          "a peer's state to heal from")
        state = torch.load(io.BytesIO(blob), weights_only=True)
        self.members, self.group_id, self.joins = tuple(state["members"]), state["group_id"], state["joins"]
        state["heal_s"] = time.monotonic() - started
        return state

    def live(self) -> bool:
        """Has the run committed a step already (so a replica starting now must join, not start fresh)?"""
        return self.incarnation > 1 or self.store.check([self._key("decision", 0)])
