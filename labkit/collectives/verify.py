"""Check every algorithm against ``dist.all_reduce`` inside a process group (``labkit allreduce verify``).

    rows = run_ranks(verify_rank, 4, ["ring", "tree"])[0]
    print(format_verify(rows))
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from labkit.collectives.execute import all_reduce

#: (rtol, atol) per dtype: sums in another order differ by rounding only.
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.float64: (1e-12, 1e-12)}


def default_lengths(world_size: int) -> list[int]:
    """Vector lengths to try: one element (empty chunks), divisible by p, not divisible, and a large one."""
    return sorted({1, world_size + 1, 8 * world_size, 8 * world_size + 3, 1000})


@dataclass
class VerifyRow:
    """One algorithm on one (length, dtype): largest deviation from ``dist.all_reduce`` and agreement."""

    algorithm: str
    n: int
    dtype: str
    max_error: float
    ok: bool
    identical_on_ranks: bool


def verify_rank(env, algorithms: list[str], lengths: list[int] | None = None,
                dtypes: tuple[str, ...] = ("float32", "float64")) -> list[VerifyRow]:
    """Run each algorithm on each length and dtype and compare with ``dist.all_reduce`` (call on every rank).

    Inputs differ per rank (seeded by rank). Returns the same rows on every rank.
    """
    lengths = lengths or default_lengths(env.world_size)
    rows = []
    for algorithm in algorithms:
        for n in lengths:
            for name in dtypes:
                dtype = getattr(torch, name)
                gen = torch.Generator().manual_seed(1000 * env.rank + n)
                x = torch.randn(n, generator=gen, dtype=dtype).to(env.device)
                want = x.clone()
                dist.all_reduce(want)
                got = all_reduce(x.clone(), algorithm)
                rtol, atol = TOLERANCE[dtype]
                close = torch.tensor(float(torch.allclose(got, want, rtol=rtol, atol=atol)), device=env.device)
                error = (got - want).abs().max().to(torch.float64)
                # Every rank must hold the very same bits, or data-parallel replicas drift apart.
                first = got.clone()
                dist.broadcast(first, 0)
                same = torch.tensor(float(torch.equal(first, got)), device=env.device)
                for value, op in ((close, dist.ReduceOp.MIN), (same, dist.ReduceOp.MIN), (error, dist.ReduceOp.MAX)):
                    dist.all_reduce(value, op=op)
                rows.append(VerifyRow(algorithm, n, name, error.item(), bool(close.item()), bool(same.item())))
    return rows


def summarize(rows: list[VerifyRow]) -> dict[str, tuple[bool, str]]:
    """Per algorithm: (all cases match, one line saying so)."""
    out = {}
    for algorithm in dict.fromkeys(r.algorithm for r in rows):
        mine = [r for r in rows if r.algorithm == algorithm]
        ok = all(r.ok and r.identical_on_ranks for r in mine)
        bad = [f"n={r.n} {r.dtype}" + ("" if r.ok else f" err {r.max_error:.2e}")
               + ("" if r.identical_on_ranks else " ranks differ") for r in mine if not (r.ok and r.identical_on_ranks)]
        lengths = sorted({r.n for r in mine})
        detail = (f"{len(mine)} cases (n in {lengths}, {'/'.join(dict.fromkeys(r.dtype for r in mine))}), "
                  f"max |error| {max(r.max_error for r in mine):.1e}, identical on all ranks")
        out[algorithm] = (ok, detail if ok else "MISMATCH: " + "; ".join(bad))
    return out


def format_verify(rows: list[VerifyRow], world_size: int) -> str:
    """One line per algorithm: ``ring           ok    24 cases ...``."""
    return "\n".join(f"{name:<14} {'ok' if ok else 'FAIL':<5} p={world_size}: {line}"
                     for name, (ok, line) in summarize(rows).items())
