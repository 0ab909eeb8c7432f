"""Notebook 09's exercise (``labkit check row-parallel FILE``): Megatron's row-parallel linear and its ``g``.

A linear layer ``Y = X Wᵀ + b`` (W of shape (out, in)) split by its input features over ``t`` ranks: rank r
holds the columns ``W[:, r·k:(r+1)·k]`` (k = in/t) and the matching slice ``X_r`` of the input features, and
computes the partial product ``X_r W_rᵀ``. ``Y = Σ_r X_r W_rᵀ + b``: the operator ``g`` sums the partial
products (all-reduce in forward) and passes the gradient through unchanged in backward (every rank already
holds the whole ``dY``); the bias is added once, after the sum.

The learner writes ``row_parallel_linear(x_part, weight, bias, group)`` (with ``g`` as an autograd function).
The checker runs it on 2 gloo ranks beside the library's :class:`labkit.parallel.layers.RowParallelLinear`
on the same weights and compares the output and the gradients of the input slice, the weight and the bias; a
wrong answer is named by the slip that gives it (no all-reduce, the all-reduce in backward instead of forward,
the wrong columns of the weight, the bias added on every rank).
"""
from __future__ import annotations

from pathlib import Path

from labkit.exercises import load_function, report

STARTER = '''\
import torch
import torch.distributed as dist


class SumPartials(torch.autograd.Function):
    """Megatron's g: forward Y = sum over the ranks of X_r; backward dX_r = dY."""

    @staticmethod
    def forward(ctx, x, group):
        return x.clone()  # TODO: the sum of x over the ranks of group

    @staticmethod
    def backward(ctx, grad):
        return grad, None  # TODO: the gradient of x (and None for group)


def row_parallel_linear(x_part, weight, bias, group):
    """Y = X Wᵀ + b, whole on every rank, from this rank's slice of the input features.

    x_part: (N, in/t)  input features r*k to (r+1)*k of X (k = in/t, r this rank, t ranks in group)
    weight: (out, in)  the FULL weight, the same on every rank; use only this rank's part of it
    bias:   (out,)     the full bias
    """
    r, t = dist.get_rank(group), dist.get_world_size(group)
    k = weight.shape[1] // t
    w_part = weight[:, :k]  # TODO: this rank's part of the weight
    return SumPartials.apply(x_part @ w_part.t() + bias, group)  # TODO: is this where the bias belongs?
'''

N, IN, OUT, WORLD = 5, 8, 6, 2
TOL = 1e-5


def reference(x_part, weight, bias, group):
    """The solution: rank r's columns of the weight, the library's ``g`` (:func:`reduce_from_tp`), the bias once."""
    import torch.distributed as dist

    from labkit.parallel.mappings import reduce_from_tp

    r, t = dist.get_rank(group), dist.get_world_size(group)
    k = weight.shape[1] // t
    return reduce_from_tp(x_part @ weight[:, r * k:(r + 1) * k].t(), group) + bias


def _tensors():
    """X (N, in), W (out, in), b (out,) and the upstream gradient G = dL/dY (N, out): the same on every rank."""
    import torch

    g = torch.Generator().manual_seed(9)
    return (torch.randn(N, IN, generator=g), torch.randn(OUT, IN, generator=g), torch.randn(OUT, generator=g),
            torch.randn(N, OUT, generator=g))


def _library(group, rank: int) -> dict:
    """The library's RowParallelLinear on this rank: output and gradients with L = Σ Y ⊙ G."""
    import torch
    from torch import nn

    from labkit.parallel.layers import RowParallelLinear

    X, W, b, G = _tensors()
    full = nn.Linear(IN, OUT)
    with torch.no_grad():
        full.weight.copy_(W), full.bias.copy_(b)
    layer = RowParallelLinear(full, group)
    k = IN // WORLD
    x = X[:, rank * k:(rank + 1) * k].clone().requires_grad_()
    y = layer(x)
    (y * G).sum().backward()
    return {"y": y.detach(), "dx": x.grad, "dw": layer.weight.grad, "db": layer.bias.grad}


def _learner(fn, group, rank: int) -> dict:
    """``fn`` on this rank: its output and the gradients L = Σ Y ⊙ G gives the input slice, weight and bias."""
    import torch

    X, W, b, G = _tensors()
    k = IN // WORLD
    x = X[:, rank * k:(rank + 1) * k].clone().requires_grad_()
    weight, bias = W.clone().requires_grad_(), b.clone().requires_grad_()
    try:
        y = fn(x, weight, bias, group)
        if not isinstance(y, torch.Tensor) or tuple(y.shape) != (N, OUT):
            shape = tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__
            return {"error": f"returned {shape}, expected a tensor of shape ({N}, {OUT}): the whole Y on every rank"}
        if y.requires_grad:
            (y * G).sum().backward()
    except Exception as exc:  # the learner's code: its one line, not a traceback
        return {"error": f"raised {type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc) else ''}"}
    zero = torch.zeros
    return {"y": y.detach(), "dx": x.grad if x.grad is not None else zero(N, k),
            "dw": weight.grad if weight.grad is not None else zero(OUT, IN),
            "db": bias.grad if bias.grad is not None else zero(OUT)}


def _rank(env, path: str | None, names: list[str]) -> dict:
    import torch.distributed as dist

    group = dist.group.WORLD
    fns = {name: load_function(f"{path}:{name}", name) if path else reference for name in names}
    return {"library": _library(group, env.rank), **{name: _learner(fn, group, env.rank) for name, fn in fns.items()}}


def _close(a, b) -> bool:
    return (a - b).abs().max().item() < TOL


def _outside(dw, columns: slice) -> float:
    """The largest gradient of the weight outside this rank's ``columns`` (0 when only its part was used)."""
    rest = dw.clone()
    rest[:, columns] = 0
    return rest.abs().max().item()


def diagnose(ranks: list[dict], lib: list[dict]) -> list[str]:
    """``[]`` when every rank matches the library's layer, else the slip, named (``ranks``: per rank the learner's
    output and gradients; ``lib``: the library's)."""
    if any("error" in r for r in ranks):
        return [f"on rank {i}, row_parallel_linear {r['error']}" for i, r in enumerate(ranks) if "error" in r][:1]
    X, W, b, G = _tensors()
    t, k = len(ranks), IN // len(ranks)
    cols = [slice(r * k, (r + 1) * k) for r in range(t)]
    partial = [X[:, c] @ W[:, c].t() for c in cols]                  # X_r W_rᵀ, rank r's own partial product
    full = sum(partial) + b
    dx_twice = all(_close(r["dx"], t * m["dx"]) for r, m in zip(ranks, lib))
    if not all(_close(r["y"], m["y"]) for r, m in zip(ranks, lib)):
        if all(_close(r["y"], p + b) for r, p in zip(ranks, partial)):
            if dx_twice:
                return [f"the all-reduce is in g's backward instead of its forward (that is f, the column-parallel "
                        f"layer's operator): Y is still this rank's partial product and dX is {t}x too large; g sums "
                        "the partial products in forward and passes dY through unchanged in backward"]
            return ["Y is this rank's partial product X_r W_rᵀ + b on each rank: you forgot the all-reduce; g's "
                    "forward must sum the partial products over the ranks (dist.all_reduce) before the bias"]
        if any(not _close(r["y"], ranks[0]["y"]) for r in ranks):
            return ["Y differs between the ranks: every rank must end with the whole Y = Σ_r X_r W_rᵀ + b; sum the "
                    "partial products over the ranks in g's forward (dist.all_reduce), and use this rank's columns "
                    "of the weight"]
        if _close(ranks[0]["y"], full + (t - 1) * b):
            return [f"Y holds the bias {t} times: the bias was added on every rank before the sum; add it once, "
                    "after g"]
        for name, parts in (("rank 0's columns on every rank", [cols[0]] * t),
                            ("the other rank's columns", cols[::-1]),
                            ("every t-th column", [slice(r, IN, t) for r in range(t)])):
            if _close(ranks[0]["y"], sum(X[:, c] @ W[:, p].t() for c, p in zip(cols, parts)) + b):
                return [f"the wrong shard of the weight ({name}): rank r's input holds features r*k to (r+1)*k, so "
                        "it multiplies the weight's COLUMNS weight[:, r*k:(r+1)*k] (k = in/t)"]
        worst = max((r["y"] - m["y"]).abs().max().item() for r, m in zip(ranks, lib))
        return [f"Y differs from the full layer's X Wᵀ + b by up to {worst:.3g}"]
    problems = []
    if dx_twice:
        problems.append(f"the input's gradient is {t}x too large: g's backward all-reduces, but every rank already "
                        "holds the whole dY; g's backward is the identity (return grad, None)")
    elif not all(_close(r["dx"], m["dx"]) for r, m in zip(ranks, lib)):
        problems.append("the gradient of x_part differs from the library's: g's backward must return dY unchanged "
                        "(and the computation must stay differentiable: no .detach() or torch.no_grad())")
    if not all(_close(r["dw"][:, c], m["dw"]) and _outside(r["dw"], c) < TOL
               for r, m, c in zip(ranks, lib, cols)) and not problems:
        problems.append("the weight's gradient differs from the library's (it should reach only this rank's "
                        "columns, as dYᵀ X_r)")
    if not all(_close(r["db"], m["db"]) for r, m in zip(ranks, lib)) and not problems:
        problems.append("the bias's gradient differs from the library's (dL/db = Σ over rows of dY, on every rank)")
    return problems


def check_functions(path: str | Path | None, names: list[str], timeout: float = 120.0) -> dict[str, list[str]]:
    """Judge each function ``names`` of the file ``path`` (the reference when None) on 2 ranks, in one start of
    the ranks; per name the problems found, [] when right."""
    from labkit.dist.testing import run_ranks

    try:
        ranks = run_ranks(_rank, WORLD, str(Path(path).resolve()) if path else None, list(names), timeout=timeout)
    except TimeoutError:
        return dict.fromkeys(names, [f"{WORLD} ranks timed out: every rank must call the same collectives in the "
                                     "same order (an all-reduce on one rank waits for the other forever)"])
    except RuntimeError as exc:
        return dict.fromkeys(names, [f"your code raised on a rank: {str(exc).strip().splitlines()[-1]}"])
    lib = [r["library"] for r in ranks]
    return {name: diagnose([r[name] for r in ranks], lib) for name in names}


def check_file(path: str | Path | None, name: str = "row_parallel_linear", timeout: float = 120.0) -> list[str]:
    """Judge ``name`` from the file ``path`` (the reference when None) on 2 ranks; [] when right."""
    return check_functions(path, [name], timeout)[name]


SUCCESS = f"the same output and gradients as labkit's RowParallelLinear on {WORLD} ranks"


def main(argv: list[str]) -> int:

    from labkit.cli import Parser

    parser = Parser(prog="labkit check row-parallel", description=__doc__)
    parser.add_argument("file", help="FILE.py[:FUNCTION] defining row_parallel_linear(x_part, weight, bias, group)")
    args = parser.parse_args(argv)
    path, _, name = args.file.partition(":")
    load_function(args.file, "row_parallel_linear")  # a missing file or function is a one-line error here
    problems = check_file(path, name or "row_parallel_linear")
    print(report(problems, SUCCESS))
    return 0 if not problems else 1
