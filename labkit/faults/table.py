"""The hang report: one row per rank (what it waits in, what it completed last, its Python line) and one line
naming the mismatch, e.g. ``rank 0 is in all_reduce #17 of shape (10,), rank 1 is in barrier #17``.

Works on the plain dicts the watchdog exchanges (JSON), so it needs no torch.
"""
from __future__ import annotations


def describe(op: dict | None, shape: bool = True) -> str:
    """``all_reduce #17 of shape (10,) float32``, ``send #3 to rank 1 of shape (1002,)``, ``no collective``; a
    bookkeeping collective of the kit's says so: ``all_reduce #9 of shape (2,) float64 (labkit's stop check)``."""
    if op is None:
        return "no collective"
    text = f"{op['op']} #{op['seq']}"
    if op.get("peer") is not None:
        text += f" {'to' if op['op'] == 'send' else 'from'} rank {op['peer']}"
    if shape and op.get("shape"):
        text += f" of shape {tuple(op['shape'])} {op.get('dtype', '')}".rstrip()
    if op.get("kit"):
        text += f" ({op['kit']})"
    return text


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def mismatch(reports: list[dict], world_size: int) -> str:
    """One sentence: which ranks wait in what, and why that cannot complete."""
    groups: dict[str, list[int]] = {}
    for r in sorted(reports, key=lambda r: r["rank"]):
        groups.setdefault(describe(r["current"]), []).append(r["rank"])
    missing = sorted(set(range(world_size)) - {r["rank"] for r in reports})
    parts = [f"{_ranks(ranks)} {'is' if len(ranks) == 1 else 'are'} in {what}" for what, ranks in groups.items()]
    if missing:
        parts.append(f"{_ranks(missing)} did not report (dead, or stuck outside Python)")
    text = ", ".join(parts)
    ops = {r["current"]["op"] for r in reports if r["current"]}
    if ops == {"send"} and len(reports) == world_size:
        text += ": every rank sends and none receives (a send waits for the matching recv)"
    elif missing:
        one = len(missing) == 1
        text += f": the others wait for {'it' if one else 'them'}; read {'its' if one else 'their'} own output"
    elif differs := argument_differs(reports):
        text += f": {differs}"
    elif len(groups) == 1:
        text += ": they agree; a rank outside this group, or a slow peer, holds them up"
    elif any(r["current"] is None for r in reports):
        text += ": a rank that is in no collective is busy elsewhere or took a branch the others did not"
    else:
        text += ": the ranks called different collectives (a rank-dependent branch, or uneven inputs)"
    return text


#: the arguments a collective's ranks must agree on, in the order a difference is named
ARGUMENTS = (("root", "root"), ("reduce_op", "reduce op"), ("dtype", "dtype"), ("shape", "shape"))


def argument_differs(reports: list[dict]) -> str:
    """``the same collective with a different root: rank 0 root 1, rank 1 root 0``, when every rank is in one
    collective (operation, number, group) but they pass it different arguments; "" otherwise."""
    current = [(r["rank"], r["current"]) for r in sorted(reports, key=lambda r: r["rank"])]
    if any(op is None for _, op in current) or len({(op["op"], op["seq"], op.get("group")) for _, op in current}) > 1:
        return ""
    for key, name in ARGUMENTS:
        values = [(rank, op.get(key)) for rank, op in current]
        if len({str(v) for _, v in values}) > 1:
            first, other = values[0], next(v for v in values if str(v[1]) != str(values[0][1]))
            show = (lambda v: str(tuple(v))) if key == "shape" else str
            return (f"the same collective with a different {name}: rank {first[0]} passes {name} {show(first[1])}, "
                    f"rank {other[0]} {name} {show(other[1])}")
    return ""


def hang_table(reports: list[dict], world_size: int, seconds: float) -> str:
    """The watchdog's report as printed."""
    rows = [("rank", "waiting in", "group", "last completed", "at (innermost first)")]
    for r in sorted(reports, key=lambda r: r["rank"]):
        current = r["current"] or {}
        done = ", ".join(describe(op, shape=False) for op in r["completed"][-2:]) or "-"
        rows.append((str(r["rank"]), describe(r["current"]), current.get("group") or "-", done, r["where"]))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row[:4], widths)) + "  " + row[4] for row in rows]
    return (f"labkit: hang: a rank waited over {seconds:g} s in one collective; where each rank is:\n"
            + "\n".join("  " + line.rstrip() for line in lines)
            + f"\nlabkit: mismatch: {mismatch(reports, world_size)}")
