"""Each tensor-parallel building block is defined once in ``labkit/``: one ``ColumnParallelLinear``, one
``RowParallelLinear``, one copy-to-parallel operator ``f`` and one reduce-from-parallel operator ``g``, and every
autograd Function of tensor parallelism in ``parallel/mappings.py``.

The operators are found by what they do, not by name: ``f`` is an autograd Function whose forward returns its
input and whose backward reduces; ``g`` one whose forward reduces and whose backward returns the gradient.
"""
from __future__ import annotations

import ast
import functools
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "labkit"
MAPPINGS = "parallel/mappings.py"
#: the modules of tensor parallelism (paths under labkit/)
TP_PREFIXES = ("parallel/tp", "parallel/megatron", "parallel/layers", "parallel/mappings",
               "exercises/column_parallel", "exercises/row_parallel")
#: autograd Functions of those modules that are no region boundary: the loss over the vocabulary shards
NOT_OPERATORS = {("parallel/megatron.py", "_VocabParallelCE")}


@functools.cache
def classes(root: Path = PACKAGE) -> list[tuple[str, ast.ClassDef]]:
    """(path under ``root``, class) for every class defined in a module of ``root``, at any depth (parsed once)."""
    return [(path.relative_to(root).as_posix(), node)
            for path in sorted(root.rglob("*.py"))
            for node in ast.walk(ast.parse(path.read_text(), str(path))) if isinstance(node, ast.ClassDef)]


def is_autograd_function(cls: ast.ClassDef) -> bool:
    return any(ast.unparse(b) in ("torch.autograd.Function", "autograd.Function", "Function") for b in cls.bases)


def _method(cls: ast.ClassDef, name: str) -> ast.FunctionDef | None:
    return next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name), None)


def _returns_input(fn: ast.FunctionDef) -> bool:
    """Every return hands back the first tensor argument unchanged: ``x``, ``x.view_as(x)``, ``(x, None, ...)``."""
    arg = fn.args.args[1].arg  # after ctx
    returns = [n.value for n in ast.walk(fn) if isinstance(n, ast.Return) and n.value is not None]

    def same(v: ast.expr) -> bool:
        if isinstance(v, ast.Tuple):
            return bool(v.elts) and same(v.elts[0])
        if isinstance(v, ast.Call) and isinstance(v.func, ast.Attribute) and v.func.attr == "view_as":
            return ast.unparse(v.func.value) == arg
        return isinstance(v, ast.Name) and v.id == arg
    return bool(returns) and all(same(v) for v in returns)


def _reduces(fn: ast.FunctionDef) -> bool:
    """It calls a function whose name says it reduces over ranks (all_reduce, all_reduce_copy, ...)."""
    return any(isinstance(n, ast.Call) and "reduce" in ast.unparse(n.func).rsplit(".", 1)[-1]
               for n in ast.walk(fn))


def operators(root: Path = PACKAGE) -> dict[str, list[str]]:
    """``"f"`` and ``"g"``: ``path:Class`` of each autograd Function that is that operator."""
    found: dict[str, list[str]] = {"f": [], "g": []}
    for path, cls in classes(root):
        forward, backward = _method(cls, "forward"), _method(cls, "backward")
        if not is_autograd_function(cls) or forward is None or backward is None:
            continue
        if _returns_input(forward) and _reduces(backward):
            found["f"].append(f"{path}:{cls.name}")
        if _reduces(forward) and _returns_input(backward):
            found["g"].append(f"{path}:{cls.name}")
    return found


def definitions(name: str, root: Path = PACKAGE) -> list[str]:
    return [f"{path}:{cls.lineno}" for path, cls in classes(root) if cls.name == name]


def tp_functions_outside_mappings(root: Path = PACKAGE) -> list[str]:
    return [f"{path}:{cls.name}" for path, cls in classes(root)
            if path.startswith(TP_PREFIXES) and is_autograd_function(cls) and path != MAPPINGS
            and (path, cls.name) not in NOT_OPERATORS]


def test_one_column_and_one_row_parallel_linear():
    assert len(definitions("ColumnParallelLinear")) == 1, definitions("ColumnParallelLinear")
    assert len(definitions("RowParallelLinear")) == 1, definitions("RowParallelLinear")


def test_one_copy_to_parallel_and_one_reduce_from_parallel_operator_in_mappings():
    ops = operators()
    assert len(ops["f"]) == 1 and ops["f"][0].startswith(MAPPINGS + ":"), ops["f"]
    assert len(ops["g"]) == 1 and ops["g"][0].startswith(MAPPINGS + ":"), ops["g"]


def test_every_tensor_parallel_autograd_function_is_in_mappings():
    assert tp_functions_outside_mappings() == []
    defined = [cls.name for path, cls in classes() if path == MAPPINGS and is_autograd_function(cls)]
    # f, g, the last-dimension gather / scatter, the sequence's pair, and expert parallelism's all-to-all
    assert len(defined) >= 7 and "AllToAll" in defined, defined
    assert definitions("AllToAll") == [f"{MAPPINGS}:{n.lineno}" for p, n in classes() if p == MAPPINGS
                                       and n.name == "AllToAll"]


def test_the_scan_finds_a_second_definition(tmp_path):
    """The checks fail on a tree with a second layer or operator (the shape of the tree before they were merged)."""
    (tmp_path / "parallel").mkdir()
    (tmp_path / "parallel" / "mappings.py").write_text(
        "import torch\n"
        "class CopyToTensorParallel(torch.autograd.Function):\n"
        "    @staticmethod\n    def forward(ctx, x, group):\n        return x.view_as(x)\n"
        "    @staticmethod\n    def backward(ctx, grad):\n        return all_reduce_copy(grad, ctx.group), None\n")
    (tmp_path / "parallel" / "tp_regions.py").write_text(
        "import torch\nfrom torch import nn\n"
        "class ColumnParallelLinear(nn.Module):\n    pass\n"
        "class _CopyToParallel(torch.autograd.Function):\n"
        "    @staticmethod\n    def forward(ctx, x, group):\n        return x.view_as(x)\n"
        "    @staticmethod\n    def backward(ctx, grad):\n"
        "        return all_reduce(grad, 'backward', ctx.group), None\n"
        "class _ReduceFromParallel(torch.autograd.Function):\n"
        "    @staticmethod\n    def forward(ctx, x, group):\n        return all_reduce(x, 'forward', group)\n"
        "    @staticmethod\n    def backward(ctx, grad):\n        return grad, None\n")
    assert operators(tmp_path) == {
        "f": ["parallel/mappings.py:CopyToTensorParallel", "parallel/tp_regions.py:_CopyToParallel"],
        "g": ["parallel/tp_regions.py:_ReduceFromParallel"]}
    assert definitions("ColumnParallelLinear", tmp_path) == ["parallel/tp_regions.py:3"]
    assert tp_functions_outside_mappings(tmp_path) == ["parallel/tp_regions.py:_CopyToParallel",
                                                       "parallel/tp_regions.py:_ReduceFromParallel"]
