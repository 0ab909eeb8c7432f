"""Notebook 02's exercise (``labkit check average-gradients FILE``): what DDP does, in four lines.

``average_gradients(model)`` runs on every rank after ``backward()``: each rank's ``p.grad`` holds the
gradient of its own mini-batch, and afterwards every rank must hold the mean over all ranks (the gradient of
the global batch's loss). The checker runs it on 2 gloo ranks next to ``DistributedDataParallel`` and
compares the gradients (:func:`labkit.strategies.ddp.check_against_ddp`).
"""
from __future__ import annotations

from pathlib import Path

from labkit.exercises import load_function, report

STARTER = '''\
import torch.distributed as dist


def average_gradients(model):
    """After backward(): replace every p.grad by its mean over all ranks."""
    world_size = dist.get_world_size()
    for p in model.parameters():
        pass  # TODO: sum p.grad over all ranks in place (dist.all_reduce), then make it the mean
'''


def reference(model) -> None:
    """The solution: all-reduce (sum) each gradient in place, divide by the world size."""
    import torch.distributed as dist

    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()


def _rank(env, path: str | None, name: str) -> float:
    from labkit.strategies.ddp import check_against_ddp

    return check_against_ddp(env, load_function(f"{path}:{name}", name) if path else reference)


def check_file(path: str | Path | None, name: str = "average_gradients", world_size: int = 2,
               timeout: float = 120.0) -> list[str]:
    """Run ``name`` from the file ``path`` (the reference when None) on ``world_size`` ranks; [] when right."""
    from labkit.testing import run_ranks

    try:
        diffs = run_ranks(_rank, world_size, str(Path(path).resolve()) if path else None, name, timeout=timeout)
    except TimeoutError:
        return [f"{world_size} ranks timed out: every rank must call dist.all_reduce on the same gradients, "
                "in the same order"]
    except RuntimeError as exc:
        return [f"your function raised on a rank: {str(exc).strip().splitlines()[-1]}"]
    worst = max(diffs)
    if worst < 1e-6:
        return []
    return [f"the gradients differ from DDP's by up to {worst:.3g} on {world_size} ranks: every rank must hold "
            "the mean (the sum over ranks divided by the world size) in p.grad"]


def main(argv: list[str]) -> int:
    import argparse

    from labkit.cli import Parser
    from labkit.ranges import within

    parser = Parser(prog="labkit check average-gradients", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file", help="FILE.py[:FUNCTION] defining average_gradients(model)")
    parser.add_argument("--ranks", type=within("int", "[2, 64]"), default=2,
                        help="world size, 2 or more: gradients meet between ranks (default 2)")
    args = parser.parse_args(argv)
    path, _, name = args.file.partition(":")
    load_function(args.file, "average_gradients")  # a missing file or function is a one-line error here
    problems = check_file(path, name or "average_gradients", args.ranks)
    print(report(problems, f"the same gradients as DistributedDataParallel on {args.ranks} ranks"))
    return 0 if not problems else 1
