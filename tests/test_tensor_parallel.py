"""Tensor parallelism: column/row-parallel layers == the dense layers (forward and every gradient), on 2 and 4
gloo ranks; bytes counted == the formulas; the strategy trains like one process; the exercise checker."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from labkit.dist.testing import run_ranks
from labkit.errors import ConfigError
from labkit.exercises import column_parallel as check
from labkit.parallel import tp_linear as tp
from labkit.parallel.layers import ColumnParallelLinear, RowParallelLinear
from labkit.parallel.mappings import count_bytes
from labkit.parallel.tp import linear_pairs, parallelize_linears

ATOL = 1e-5  # float32 sums in a different order


def _dense_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    # pairs (8->12, 12->16) and (16->8, 8->4); the 4->3 head has no partner and stays whole
    return nn.Sequential(nn.Flatten(), nn.Linear(8, 12), nn.ReLU(), nn.Linear(12, 16), nn.Tanh(),
                         nn.Linear(16, 8), nn.GELU(), nn.Linear(8, 4), nn.Tanh(), nn.Linear(4, 3))


def _pairs(dense: nn.Sequential, sliced: nn.Sequential, rank: int, world: int, grad: bool = True):
    """(this rank's tensor, the matching slice of the dense one) for every parameter (or its gradient)."""
    get = (lambda p: p.grad) if grad else (lambda p: p.detach())
    for d, s in zip(dense, sliced):
        if isinstance(s, ColumnParallelLinear):
            yield get(s.weight), get(d.weight).chunk(world, 0)[rank]
            yield get(s.bias), get(d.bias).chunk(world, 0)[rank]
        elif isinstance(s, RowParallelLinear):
            yield get(s.weight), get(d.weight).chunk(world, 1)[rank]
            yield get(s.bias), get(d.bias)
        elif isinstance(s, nn.Linear):
            yield get(s.weight), get(d.weight)
            yield get(s.bias), get(d.bias)


def _max_diff(pairs) -> float:
    return max((a - b).abs().max().item() for a, b in pairs)


def _tp_rank(env, solution: str | None = None) -> dict:
    rank, world = env.rank, env.world_size
    dense = _dense_mlp()
    sliced = parallelize_linears(copy.deepcopy(dense))
    kinds = [type(m).__name__ for m in sliced if not isinstance(m, (nn.Flatten, nn.ReLU, nn.Tanh, nn.GELU))]
    x = torch.randn(6, 2, 4, generator=torch.Generator().manual_seed(1))  # same batch on every rank
    x_dense, x_tp = x.clone().requires_grad_(), x.clone().requires_grad_()
    target = torch.randn(6, 3, generator=torch.Generator().manual_seed(2))
    out_dense, out_tp = dense(x_dense), sliced(x_tp)
    (out_dense - target).pow(2).sum().backward()
    with count_bytes() as log:
        (out_tp - target).pow(2).sum().backward()
    errors = {"out": (out_tp - out_dense).abs().max().item(), "x.grad": (x_tp.grad - x_dense.grad).abs().max().item(),
              "params": _max_diff(_pairs(dense, sliced, rank, world)),
              "backward all-reduces": len(log.entries)}

    # a column layer that gathers, then a row layer that slices its (full) input itself
    torch.manual_seed(3)
    d1, d2 = nn.Linear(5, 8), nn.Linear(8, 4)
    c1 = ColumnParallelLinear(d1, enter=True, gather_output=True)
    r2 = RowParallelLinear(d2, input_is_parallel=False)
    h = torch.randn(7, 5, generator=torch.Generator().manual_seed(4))
    h_dense, h_tp = h.clone().requires_grad_(), h.clone().requires_grad_()
    d2(torch.relu(d1(h_dense))).sum().backward()
    with count_bytes() as fc_log:
        y = c1(h_tp)  # (7, 8) whole on every rank
        r2(torch.relu(y)).sum().backward()
    errors["gather/scatter x.grad"] = (h_tp.grad - h_dense.grad).abs().max().item()
    errors["gather/scatter params"] = max(
        (c1.weight.grad - d1.weight.grad.chunk(world, 0)[rank]).abs().max().item(),
        (c1.bias.grad - d1.bias.grad.chunk(world, 0)[rank]).abs().max().item(),
        (r2.weight.grad - d2.weight.grad.chunk(world, 1)[rank]).abs().max().item(),
        (r2.bias.grad - d2.bias.grad).abs().max().item())
    result = {"errors": errors, "kinds": kinds, "fc_entries": fc_log.entries,
              "fc_bytes": tp.measure_fc_bytes(env, batch=8, in_features=12, out_features=20)}
    if solution is not None:  # the exercise checker's rank function, and the strategy in the training loop
        result["exercise"] = check._rank(env, solution, "column_parallel_forward")
        result["fit"] = _fit_against_single(env)
    return result


def _fit_against_single(env) -> dict:
    """Train mlp 4 steps with the tensor-parallel strategy and in one plain process; compare."""
    from labkit.data.loader import make_loader
    from labkit.models.cnn import get_model
    from labkit.parallel.tp_linear import TensorParallelStrategy
    from labkit.strategies.base import Strategy
    from labkit.train.loop import fit

    g = torch.Generator().manual_seed(5)
    data = torch.utils.data.TensorDataset(torch.randn(40, 1, 4, 4, generator=g), torch.randint(0, 5, (40,), generator=g))
    runs = {}
    for name in ("single", "tensor-parallel"):
        torch.manual_seed(0)
        model = get_model("mlp", num_classes=5, in_channels=1, image_size=4, sequential=True)
        strategy = TensorParallelStrategy(env) if name != "single" else Strategy(env)
        reference = copy.deepcopy(model)
        model = strategy.prepare(model)
        optimizer = torch.optim.SGD(strategy.unwrap(model).parameters(), lr=0.1, momentum=0.9)
        history = fit(model, make_loader(data, 8, shuffle=True), make_loader(data, 16, shuffle=False), optimizer,
                      epochs=1, strategy=strategy, max_steps=4, printer=lambda line: None)
        runs[name] = (reference, model, history[-1])
    dense, sliced = runs["single"][1], runs["tensor-parallel"][1]
    return {"weights": _max_diff(_pairs(dense, sliced, env.rank, env.world_size, grad=False)),
            "kinds": [type(m).__name__ for m in sliced],
            "metrics": {k: (runs["single"][2][k], runs["tensor-parallel"][2][k])
                        for k in ("train_loss", "train_acc", "test_loss", "test_acc")}}


SOLUTION = """\
import torch, torch.distributed as dist
import torch.nn.functional as F

def column_parallel_forward(x, weight, bias):
    y_local = F.linear(x, weight, bias)
    parts = [torch.empty_like(y_local) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, y_local)
    return torch.cat(parts, dim=-1)
"""


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_mlp_equals_dense(world, tmp_path):
    solution = None
    if world == 2:  # one spawn also runs the exercise checker's ranks and the strategy through fit()
        solution = tmp_path / "solution.py"
        solution.write_text(SOLUTION)
        solution = str(solution)
    results = run_ranks(_tp_rank, world, solution, timeout=120)
    for rank, result in enumerate(results):
        e = result["errors"]
        assert result["kinds"] == ["ColumnParallelLinear", "RowParallelLinear", "ColumnParallelLinear",
                                   "RowParallelLinear", "Linear"]
        for key in ("out", "x.grad", "params", "gather/scatter x.grad", "gather/scatter params"):
            assert e[key] < ATOL, (world, rank, key, e[key])
        # backward: one all-reduce of dX per column layer (2 pairs), nothing else
        assert e["backward all-reduces"] == 2
        # column forward all-gathers its shard of Y (7, 8/p); row forward all-reduces (7, 4); backward:
        # row slices dY without talking, its scatter all-gathers dX (7, 8/p), the column all-reduces dX (7, 5)
        assert result["fc_entries"] == [("all_gather", "forward", 7 * 8 // world * 4), ("all_reduce", "forward", 7 * 4 * 4),
                                        ("all_gather", "backward", 7 * 8 // world * 4),
                                        ("all_reduce", "backward", 7 * 5 * 4)]
        # the counted bytes of a real step of one FC layer == seed 000's formulas
        assert result["fc_bytes"] == pytest.approx(tp.fc_layer_bytes(8, 12, 20, world))
        if solution is not None:
            assert check.diagnose(result["exercise"], world) is None
            fit_result = result["fit"]
            assert fit_result["kinds"] == ["Flatten", "ColumnParallelLinear", "ReLU", "RowParallelLinear", "ReLU",
                                           "Linear"]
            assert fit_result["weights"] < ATOL, fit_result  # 4 SGD steps: the same weights as one process
            for key, (single, parallel) in fit_result["metrics"].items():
                # only rank 0 counts (metric_owner), the loop sums over ranks: the single-process numbers
                assert parallel == pytest.approx(single, abs=1e-5), key


def test_fc_layer_bytes_formulas():
    b = tp.fc_layer_bytes(batch=32, in_features=9216, out_features=4096, world_size=2)
    assert b["data_parallel_payload"] == (4096 * 9216 + 4096) * 4
    assert b["data_parallel_wire"] == pytest.approx(b["data_parallel_payload"])  # 2(p-1)/p = 1 for p = 2
    assert b["model_parallel_payload"] == 32 * 4096 // 2 * 4 + 32 * 9216 * 4
    # AlexNet's big FC layer: slicing features moves ~140x fewer bytes than all-reducing its gradient
    assert b["data_parallel_wire"] / b["model_parallel_wire"] > 100


def test_features_not_divisible_by_world_size():
    with pytest.raises(ConfigError, match="10 features, not divisible by world size 4"):
        ColumnParallelLinear(nn.Linear(16, 10), gather_output=True, rank=0, world_size=4)
    with pytest.raises(ConfigError, match="6 features, not divisible by world size 4"):
        RowParallelLinear(nn.Linear(6, 3), input_is_parallel=False, rank=0, world_size=4)
    with pytest.raises(ConfigError, match=r"layer 1 .*not divisible by world size 3"):
        parallelize_linears(nn.Sequential(nn.Flatten(), nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)),
                               rank=0, world_size=3)
    with pytest.raises(ConfigError, match="no Linear → activation → Linear pair"):
        parallelize_linears(nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(8, 2)))


def test_column_parallel_checker_diagnoses():
    x, weight, bias = check._problem()
    want = F.linear(x, weight, bias)
    assert check.diagnose(want, 2) is None
    assert "only this rank's o/p columns" in check.diagnose(want[:, :6], 2)
    assert "batch dim" in check.diagnose(torch.cat(want.chunk(2, -1), 0), 2)
    assert "bias is missing" in check.diagnose(want - bias, 2)
    assert "wrong order" in check.diagnose(torch.cat(want.chunk(3, -1)[::-1], -1), 3)


def test_column_parallel_checker_cli(tmp_path, capsys):
    """The checker's command line (the ranks it runs are exercised in the 2-rank test above)."""
    assert check.main([str(tmp_path / "missing.py")]) == 2
    assert "start one with --template" in capsys.readouterr().out
    assert check.main(["--template"]) == 0
    template = tmp_path / "template.py"
    template.write_text(capsys.readouterr().out)
    assert "def column_parallel_forward(x, weight, bias)" in template.read_text()
    assert callable(check.load_function(template))


def test_linear_pairs_are_what_parallelize_linears_slices_and_the_advisor_prices():
    """Linear → elementwise… → Linear pairs, none sharing a layer; a Dropout ends the elementwise run."""
    layers = [nn.Linear(2, 4), nn.ReLU(), nn.Linear(4, 2), nn.Linear(2, 4), nn.GELU(), nn.Identity(), nn.Linear(4, 2),
              nn.Linear(2, 4), nn.Dropout(), nn.Linear(4, 2)]
    assert linear_pairs(layers) == [(0, 2), (3, 6)]
    sliced = parallelize_linears(nn.Sequential(*layers), rank=0, world_size=2)
    kinds = [type(m).__name__ for m in sliced]
    assert kinds == ["ColumnParallelLinear", "ReLU", "RowParallelLinear", "ColumnParallelLinear", "GELU", "Identity",
                     "RowParallelLinear", "Linear", "Dropout", "Linear"]
