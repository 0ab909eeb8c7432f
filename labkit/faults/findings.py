"""The checks a careful engineer makes when nothing hangs but something is wrong, on what each rank recorded
(:mod:`labkit.faults.recorder`) and returned: replicas equal after a step, a new sample order every epoch, the
rank where a non-finite value first entered a collective, one GPU per rank."""
from __future__ import annotations

import torch


def replicas(ranks: list[dict]) -> list[str]:
    """The weights after the first step, and at the end, must be the same on every rank."""
    out = []
    base = ranks[0]
    for when, get in (("after step 1", lambda r: r["record"]["first_step"]),
                      ("at the end", lambda r: torch.cat([v.flatten().float() for v in r["state"].values()]))):
        for r in ranks[1:]:
            a, b = get(base), get(r)
            if a is None or b is None:
                continue
            both = torch.isfinite(a) & torch.isfinite(b)
            diff = (a[both] - b[both]).abs().max().item() if both.any() else 0.0
            if diff > 1e-5:
                out.append(f"replicas differ {when}: rank {r['rank']}'s weights differ from rank {base['rank']}'s "
                           f"by up to {diff:.3g}; every rank must start from the same weights (broadcast rank 0's "
                           "after building the model, or seed every rank alike before building it)")
                return out
    return out


def orders(ranks: list[dict]) -> list[str]:
    """Each epoch of a shuffling sampler must visit the samples in a new order."""
    for r in ranks:
        seen = r["record"]["orders"]
        if len(seen) >= 2 and all(o == seen[0] for o in seen[1:]):
            return [f"rank {r['rank']} saw its {len(seen[0])} samples in the same order in all {len(seen)} epochs: "
                    "DistributedSampler shuffles by (seed, epoch); call sampler.set_epoch(epoch) before each epoch"]
    return []


def nonfinite(ranks: list[dict]) -> list[str]:
    """Which rank put a NaN or infinity into a collective first, and how far it spread."""
    first = [(r["record"]["nonfinite"]["step"], r["record"]["nonfinite"]["call"], r["rank"], r["record"]["nonfinite"])
             for r in ranks if r["record"]["nonfinite"]]
    spoiled = [r["rank"] for r in ranks if not all(torch.isfinite(v).all() for v in r["state"].values()
                                                   if v.is_floating_point())]
    if not first and not spoiled:
        return []
    if not first:
        return [f"non-finite weights on {_ranks(spoiled)}, although no all_reduce received one"]
    step, call, rank, info = min(first)
    return [f"rank {rank} was first to put a non-finite value into a collective: all_reduce call {call} (shape "
            f"{tuple(info['shape'])}) in step {step}; the all-reduce spread it, and now {_ranks(spoiled)} "
            f"{'holds' if len(spoiled) == 1 else 'hold'} non-finite weights. Look at rank {rank}'s data and loss "
            "in that step"] if spoiled else [f"rank {rank} put a non-finite value into all_reduce call {call} "
                                             f"in step {step}"]


def devices(ranks: list[dict]) -> list[str]:
    """Two ranks on one node must not share a GPU."""
    owner: dict[tuple, int] = {}
    for r in ranks:
        if r["gpu"] is None:
            continue
        key = (r["host"], r["gpu"])
        if key in owner:
            where = f" on {r['host']}" if r["host"] else ""
            return [f"ranks {owner[key]} and {r['rank']} both use GPU {r['gpu']}{where}: "
                    "choose the GPU from the rank on this node (LOCAL_RANK under torchrun, SLURM_LOCALID under srun)"]
        owner[key] = r["rank"]
    return []


def silent(ranks: list[dict]) -> list[str]:
    """Every check; [] when the run looks right."""
    if not ranks:
        return []
    return nonfinite(ranks) + replicas(ranks) + orders(ranks) + devices(ranks)


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
