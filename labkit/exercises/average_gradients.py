"""Notebook 02's exercise (``labkit check average-gradients FILE``): what DDP does, in four lines.

``average_gradients(model)`` runs on every rank after ``backward()``: each rank's ``p.grad`` holds the
gradient of its own mini-batch, and afterwards every rank must hold the mean over all ranks (the gradient of
the global batch's loss). The checker runs it on 2 gloo ranks next to ``DistributedDataParallel`` and
compares the gradients; a wrong answer is named by the slip that gives it (the sum instead of the mean, a
division too many, a missing all-reduce).
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


def _distances(env, average) -> dict[str, object]:
    """On one rank: the largest distance of ``average``'s gradients from each answer a plausible slip gives."""
    import copy

    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 10))
    ddp = DistributedDataParallel(copy.deepcopy(model))
    generator = torch.Generator().manual_seed(1 + env.rank)  # each rank its own mini-batch
    x, y = torch.randn(16, 20, generator=generator), torch.randint(0, 10, (16,), generator=generator)
    nn.functional.cross_entropy(model(x), y).backward()
    local = [p.grad.clone() for p in model.parameters()]
    average(model)
    nn.functional.cross_entropy(ddp(x), y).backward()
    mean = [q.grad for q in ddp.module.parameters()]
    got = [p.grad for p in model.parameters()]
    n = env.world_size
    answers = {"mean": mean, "sum": [m * n for m in mean], "mean / N": [m / n for m in mean],
               "local": local, "local / N": [g / n for g in local]}
    out: dict[str, object] = {k: max((a - b).abs().max().item() for a, b in zip(got, want, strict=True))
                              for k, want in answers.items()}
    out["per parameter"] = [(a - b).abs().max().item() for a, b in zip(got, mean)]
    return out


def _rank(env, path: str | None, names: list[str]) -> list[dict[str, object]]:
    return [_distances(env, load_function(f"{path}:{name}", name) if path else reference) for name in names]


#: the slip each wrong answer points to (N is the world size)
DIAGNOSES = {
    "sum": "p.grad holds the SUM over the ranks, {n}× DDP's: divide by the world size after the all_reduce "
           "(p.grad /= world_size)",
    "mean / N": "p.grad is {n}× too small: it was divided by the world size twice (dist.all_reduce sums; divide "
                "once, after it)",
    "local": "p.grad is still this rank's own gradient: call dist.all_reduce(p.grad) on every parameter",
    "local / N": "p.grad is this rank's own gradient divided by the world size: the dist.all_reduce(p.grad) "
                 "that sums over the ranks is missing",
}


def diagnose(distances: list[dict], world_size: int, tol: float = 1e-6) -> list[str]:
    """``[]`` when every rank holds DDP's mean, else one line naming the slip (from :func:`_rank`'s distances)."""
    if all(d["mean"] < tol for d in distances):
        return []
    for key, text in DIAGNOSES.items():
        if all(d[key] < tol for d in distances):
            return [text.format(n=world_size)]
    worst = max(d["mean"] for d in distances)
    wrong = [i for i in range(len(distances[0]["per parameter"]))
             if any(d["per parameter"][i] >= tol for d in distances)]
    if len(wrong) < len(distances[0]["per parameter"]):
        return [f"parameter(s) {', '.join(map(str, wrong))} of model.parameters() (counted from 0) differ from DDP's "
                f"by up to {worst:.3g}, the others are right: average the gradient of every parameter"]
    return [f"the gradients differ from DDP's by up to {worst:.3g} on {world_size} ranks: every rank must hold "
            "the mean (the sum over ranks divided by the world size) in p.grad, for every parameter"]


def check_functions(path: str | Path | None, names: list[str], world_size: int = 2,
                    timeout: float = 120.0) -> dict[str, list[str]]:
    """Run each function ``names`` of the file ``path`` (the reference when None) on ``world_size`` ranks, in
    one start of the ranks; per name the problems found, [] when right."""
    from labkit.dist.testing import run_ranks

    try:
        ranks = run_ranks(_rank, world_size, str(Path(path).resolve()) if path else None, list(names),
                          timeout=timeout)
    except TimeoutError:
        return dict.fromkeys(names, [f"{world_size} ranks timed out: every rank must call dist.all_reduce on the "
                                     "same gradients, in the same order"])
    except RuntimeError as exc:
        return dict.fromkeys(names, [f"your function raised on a rank: {str(exc).strip().splitlines()[-1]}"])
    return {name: diagnose([rank[i] for rank in ranks], world_size) for i, name in enumerate(names)}


def check_file(path: str | Path | None, name: str = "average_gradients", world_size: int = 2,
               timeout: float = 120.0) -> list[str]:
    """Run ``name`` from the file ``path`` (the reference when None) on ``world_size`` ranks; [] when right."""
    return check_functions(path, [name], world_size, timeout)[name]


def main(argv: list[str]) -> int:

    from labkit.cli import Parser
    from labkit.ranges import within

    parser = Parser(prog="labkit check average-gradients", description=__doc__)
    parser.add_argument("file", help="FILE.py[:FUNCTION] defining average_gradients(model)")
    parser.add_argument("--ranks", type=within("int", "[2, 64]"), default=2,
                        help="world size, 2 or more: gradients meet between ranks (default 2)")
    args = parser.parse_args(argv)
    path, _, name = args.file.partition(":")
    load_function(args.file, "average_gradients")  # a missing file or function is a one-line error here
    problems = check_file(path, name or "average_gradients", args.ranks)
    print(report(problems, f"the same gradients as DistributedDataParallel on {args.ranks} ranks"))
    return 0 if not problems else 1
