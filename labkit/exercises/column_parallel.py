"""``labkit check column-parallel FILE``: is your column-parallel forward right?

FILE defines ``column_parallel_forward(x, weight, bias)`` (start from ``--template``). It runs on each of
``p`` ranks: ``x`` (B, i) is the same everywhere, ``weight`` (o/p, i) and ``bias`` (o/p,) are this rank's
slice of the output features (rank r holds rows ``r·o/p .. (r+1)·o/p`` of W). It must return the whole
``Y = x W^T + b`` (B, o) on every rank. The checker runs it on gloo ranks and compares with ``F.linear``.

    labkit check column-parallel --template > my_column_parallel.py     # then fill it in
    labkit check column-parallel my_column_parallel.py
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from labkit.dist.testing import run_ranks
from labkit.errors import ConfigError
from labkit.exercises import import_file

TEMPLATE = '''\
import torch
import torch.distributed as dist
import torch.nn.functional as F


def column_parallel_forward(x, weight, bias):
    """x (B, i) on every rank; weight (o/p, i), bias (o/p,): this rank's output features.
    Return Y = x W^T + b, shape (B, o), on every rank."""
    y_local = ...  # (B, o/p): this rank's columns of Y
    # collect every rank's y_local (dist.all_gather) and put them side by side, rank order
    raise NotImplementedError("write the column-parallel forward")
'''

BATCH, IN_FEATURES, OUT_FEATURES = 4, 6, 12  # 12 divides over 2, 3, 4 ranks


def _problem(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(BATCH, IN_FEATURES, generator=g)
    weight = torch.randn(OUT_FEATURES, IN_FEATURES, generator=g)
    bias = torch.randn(OUT_FEATURES, generator=g)
    return x, weight, bias


def load_function(path: str | Path, name: str = "column_parallel_forward"):
    """Import ``name`` from the Python file ``path``."""
    module = import_file(path, "column_parallel_exercise")
    if not hasattr(module, name):
        raise ConfigError(f"{path} defines no function {name}(); name it so or pass --function NAME")
    return getattr(module, name)


def _rank(env, path: str, name: str) -> torch.Tensor:
    x, weight, bias = _problem()
    w_r = weight.chunk(env.world_size, 0)[env.rank].clone()
    b_r = bias.chunk(env.world_size, 0)[env.rank].clone()
    out = load_function(path, name)(x, w_r, b_r)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"column_parallel_forward returned {type(out).__name__}, expected a tensor")
    return out.detach()


def diagnose(out: torch.Tensor, world_size: int, atol: float = 1e-5) -> str | None:
    """``None`` if ``out`` is the dense ``F.linear`` result, else what looks wrong."""
    x, weight, bias = _problem()
    want = F.linear(x, weight, bias)  # (B, o)
    p, shard = world_size, OUT_FEATURES // world_size
    if out.shape == (BATCH, shard):
        return (f"returned shape {tuple(out.shape)}: only this rank's o/p columns; all-gather the "
                f"{p} slices and concatenate them along the feature dim (-1)")
    if out.shape == (BATCH * p, shard):
        return (f"returned shape {tuple(out.shape)}: the slices were stacked along the batch dim (0); "
                "concatenate along the feature dim (-1)")
    if out.shape != want.shape:
        return f"returned shape {tuple(out.shape)}, expected {tuple(want.shape)} = (B, o)"
    if torch.allclose(out, want, atol=atol):
        return None
    if torch.allclose(out, want - bias, atol=atol):
        return "the bias is missing: add this rank's bias slice to its columns before gathering"
    if torch.allclose(out, want - bias + bias.chunk(p)[0].repeat(p), atol=atol):
        return "every slice got rank 0's bias: each rank adds its own bias slice"
    blocks = want.chunk(p, -1)
    if all(any(torch.allclose(o, b, atol=atol) for b in blocks) for o in out.chunk(p, -1)):
        return "the right slices in the wrong order: rank r's slice goes to columns r·o/p .. (r+1)·o/p"
    return f"values differ from x W^T + b (max error {(out - want).abs().max().item():.3g})"


def check(path: str | Path, world_sizes: tuple[int, ...] = (2, 3), name: str = "column_parallel_forward",
          timeout: float = 90.0) -> list[str]:
    """Run the exercise on each world size; return the problems found (empty: correct)."""
    problems = []
    for p in world_sizes:
        try:
            outs = run_ranks(_rank, p, str(Path(path).resolve()), name, timeout=timeout)
        except TimeoutError:
            problems.append(f"{p} ranks: timed out; every rank must call the same collectives with "
                            "tensors of the same shape")
            continue
        except RuntimeError as exc:
            problems.append(f"{p} ranks: your function raised:\n{str(exc).splitlines()[-1]}")
            continue
        for rank, out in enumerate(outs):
            problem = diagnose(out, p)
            if problem:
                problems.append(f"{p} ranks, rank {rank}: {problem}")
                break
    return problems


def main(argv: list[str]) -> int:
    from labkit.cli import Parser
    from labkit.ranges import within

    parser = Parser(prog="labkit check column-parallel", description=__doc__)
    parser.add_argument("file", nargs="?", help="Python file defining column_parallel_forward(x, weight, bias)")
    parser.add_argument("--template", action="store_true", help="print a starting file and exit")
    parser.add_argument("--world-sizes", type=within("int", "[1, 64]"), nargs="+", default=[2, 3], metavar="P")
    parser.add_argument("--function", default="column_parallel_forward")
    args = parser.parse_args(argv)
    if args.template:
        print(TEMPLATE, end="")
        return 0
    if args.file is None or not Path(args.file).is_file():
        print(f"labkit check column-parallel: give the exercise file (got {args.file!r}); "
              "start one with --template")
        return 2
    load_function(args.file, args.function)  # a file that does not parse is one line here, before ranks start
    problems = check(args.file, tuple(args.world_sizes), args.function)
    for problem in problems:
        print(f"not yet: {problem}")
    if not problems:
        print(f"correct: column_parallel_forward equals F.linear on {', '.join(map(str, args.world_sizes))} ranks")
    return 0 if not problems else 1
