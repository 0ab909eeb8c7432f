"""Every workshop exercise: its checker passes a right answer, fails a wrong one with the reason, writes a
starting file with ``--init``; and every notebook's exercise cell, untouched, fails its checker."""
import json
from pathlib import Path

import pytest
import torch

from labkit.cli import main
from labkit.errors import ConfigError
from labkit.exercises import (
    activation_memory,
    average_gradients,
    kfac_factors,
    lr_schedule,
    online_softmax,
    row_parallel,
    training_step,
)
from labkit.exercises.cli import CHECKS, STARTERS, run_check, write_starter

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def _from_source(source: str, name: str):
    namespace: dict = {}
    exec(compile(source, f"<{name}>", "exec"), namespace)
    return namespace[name]


def test_training_step_checker():
    assert training_step.check(training_step.reference_step) == []

    def no_zero_grad(model, optimizer, criterion, x, y):
        loss = criterion(model(x), y)
        loss.backward()
        optimizer.step()
        return loss.item()

    def no_step(model, optimizer, criterion, x, y):
        optimizer.zero_grad()
        loss = criterion(model(x), y)
        loss.backward()
        return loss.item()

    assert "optimizer.zero_grad()" in training_step.check(no_zero_grad)[0]
    assert "call optimizer.step()" in training_step.check(no_step)[0]
    assert "call loss.backward()" in training_step.check(_from_source(training_step.STARTER, "train_step"))[0]


def test_kfac_factors_checker_against_the_literal_fisher():
    a, g, A, G = kfac_factors.captured()
    # the checker's ground truth, from the definition: A ⊗ G is the Fisher block for one sample,
    # vec(∇W_n) vec(∇W_n)ᵀ with ∇W_n = (N g_n) ā_nᵀ (column-stacking vec)
    ones = torch.ones(len(a), 1, dtype=a.dtype)
    a_bar, per_sample = torch.cat([a, ones], 1), len(a) * g
    n_in, n_out = a_bar.shape[1], g.shape[1]
    fisher_a = sum(torch.outer(v, v) for v in a_bar) / len(a)
    fisher_g = sum(torch.outer(v, v) for v in per_sample) / len(a)
    assert torch.allclose(A, fisher_a) and torch.allclose(G, fisher_g)
    one = torch.outer(per_sample[0], a_bar[0]).T.reshape(-1)  # vec(∇W_0), columns stacked
    assert torch.allclose(torch.kron(torch.outer(a_bar[0], a_bar[0]), torch.outer(per_sample[0], per_sample[0])),
                          torch.outer(one, one))
    assert (n_in, n_out) == (A.shape[0], G.shape[0])

    assert kfac_factors.check(kfac_factors.reference) == []
    problems = kfac_factors.check(_from_source(kfac_factors.STARTER, "kfac_factors"))
    assert "append a column of ones" in problems[0] and problems[1].startswith("G is N = 7 times too small")


def _kfac_slip(ones_first=False, a_scale=1.0, g_scale=1.0):
    def kfac_factors_with_a_slip(a, g):
        n = len(a)
        ones = torch.ones(n, 1, dtype=a.dtype)
        a_bar = torch.cat([ones, a] if ones_first else [a, ones], 1)
        return a_bar.T @ a_bar / n * a_scale, (n * g).T @ (n * g) / n * g_scale
    return kfac_factors_with_a_slip


@pytest.mark.parametrize("slip, expected", [
    (dict(ones_first=True), ["the column of ones is the FIRST column of ā: the bias is the LAST column of W = [W b], "
                             "so append the ones after a (torch.cat([a, ones], 1))"]),
    (dict(ones_first=True, a_scale=7), ["the column of ones is the FIRST column of ā: the bias is the LAST column "
                                        "of W = [W b], so append the ones after a (torch.cat([a, ones], 1)); and A "
                                        "is N = 7 times too large: A is the MEAN over the batch: divide ā.T @ ā by "
                                        "N, once"]),
    (dict(a_scale=1 / 7), ["A is N = 7 times too small: A is the MEAN over the batch: divide ā.T @ ā by N, once"]),
    (dict(g_scale=7), ["G is N = 7 times too large: g is the gradient of the batch MEAN, so per-sample gradients "
                       "are N g; average (N g)(N g)ᵀ over the batch"]),
    (dict(g_scale=1 / 49), ["G is N² = 49 times too small: g is the gradient of the batch MEAN, so per-sample "
                            "gradients are N g; average (N g)(N g)ᵀ over the batch"]),
    (dict(g_scale=2), ["G differs from K-FAC's by up to"]),
], ids=["ones-first", "ones-first-and-sum", "A-mean-twice", "G-sum", "G-without-N", "G-other"])
def test_kfac_factors_checker_names_the_slip(slip, expected):
    problems = kfac_factors.check(_kfac_slip(**slip))
    assert len(problems) == len(expected) and problems[0].startswith(expected[0])


def test_lr_schedule_checker():
    assert lr_schedule.check(lr_schedule.reference) == []
    no_warmup = lambda step, base_lr, world_size, spe, warm: base_lr * world_size  # noqa: E731
    assert "starts at base_lr and rises linearly" in lr_schedule.check(no_warmup)[0]
    assert "expected" in lr_schedule.check(_from_source(lr_schedule.STARTER, "lr_at"))[0]
    # the checker's ground truth is the schedule labkit train runs; spot-check it against the rule
    assert lr_schedule.expected(0, 0.1, 8, 10, 2) == pytest.approx(0.1)
    assert lr_schedule.expected(10, 0.1, 8, 10, 2) == pytest.approx(0.1 + 0.7 * 10 / 20)
    assert lr_schedule.expected(25, 0.1, 8, 10, 2) == pytest.approx(0.8)



def _merged(out_a, lse_a, out_b, lse_b, w_a, w_b, lse):
    return w_a.unsqueeze(-1) * out_a + w_b.unsqueeze(-1) * out_b, lse


@pytest.mark.parametrize("slip, expected", [
    (lambda oa, la, ob, lb: (oa + ob, torch.logaddexp(la, lb)), ["out adds the partial outputs as they are"]),
    (lambda oa, la, ob, lb: _merged(oa, la, ob, lb, torch.exp(torch.logaddexp(la, lb) - la),
                                    torch.exp(torch.logaddexp(la, lb) - lb), torch.logaddexp(la, lb)),
     ["out's weights have the wrong sign"]),
    (lambda oa, la, ob, lb: _merged(oa, la, ob, lb, torch.exp(la - torch.maximum(la, lb)),
                                    torch.exp(lb - torch.maximum(la, lb)), torch.logaddexp(la, lb)),
     ["out is rescaled by exp(lse_x - max) but not renormalised"]),
    (lambda oa, la, ob, lb: online_softmax.reference(oa, la, ob, lb)[:1] + (torch.maximum(la, lb),),
     ["lse is the max of the two"]),
    (lambda oa, la, ob, lb: _merged(oa, la, ob, lb, torch.exp(la) / (torch.exp(la) + torch.exp(lb)),
                                    torch.exp(lb) / (torch.exp(la) + torch.exp(lb)),
                                    torch.log(torch.exp(la) + torch.exp(lb))),
     ["out holds inf or nan: exp() of a log-sum-exp overflows", "lse holds inf or nan"]),
], ids=["no-rescale", "wrong-sign", "no-renormalisation", "max-for-lse", "overflow"])
def test_online_softmax_checker_names_the_slip(slip, expected):
    problems = online_softmax.check(slip)
    assert len(problems) == len(expected) and all(p.startswith(e) for p, e in zip(problems, expected)), problems


def test_online_softmax_checker_passes_the_answers_and_its_oracle_is_sdpa():
    from labkit.parallel.ring_attention import merge

    assert online_softmax.check(online_softmax.reference) == [] and online_softmax.check(merge) == []
    q, k, v, (out_a, lse_a, out_b, lse_b) = online_softmax._blocks(*online_softmax.CASES[0])
    assert (out_a.shape, lse_a.shape, out_b.shape) == ((2, 2, 5, 4), (2, 2, 5), (2, 2, 5, 4))
    # the first block's output is SDPA over its 3 keys alone; the starting file is judged wrong
    # (torch.allclose: torch.testing's first call imports for a second or more)
    assert torch.allclose(out_a, torch.nn.functional.scaled_dot_product_attention(
        q, k[..., :3, :], v[..., :3, :], scale=0.5), rtol=1e-12, atol=1e-12)
    starter = online_softmax.check(_from_source(online_softmax.STARTER, "merge"))
    assert starter[0].startswith("out adds the partial outputs") and starter[1].startswith("lse is one block's")

def _block_bytes(tp_divides=True, selective_drops=True, element=None):
    """A learner's block_activation_bytes written from the exercise's list of tensors, with switchable slips."""
    def block_activation_bytes(b, s, h, a, tp, recompute="none", bytes_per_element=2):
        t = tp if tp_divides else 1
        sbh, sb = s * b * h, s * b
        elements = 2 * sbh / t + 4 * sb / t + 2 * sbh + 3 * sbh / t + sbh / t + 8 * sbh / t
        if recompute != "selective" or not selective_drops:
            elements += a * sb / t
        return elements * (element or bytes_per_element)
    return block_activation_bytes


@pytest.mark.parametrize("slip, expected", [
    (_block_bytes(tp_divides=False), "nothing is divided by tp"),
    (_block_bytes(selective_drops=False), "the log-sum-exp is counted under selective recompute"),
    (_block_bytes(element=4), "counted 4 bytes per element: in bf16 an element is 2 bytes"),
    (lambda b, s, h, a, tp, recompute="none", bytes_per_element=2:
     activation_memory.reference(b, s, h, a, tp, recompute, bytes_per_element) + bytes_per_element * a * s * s * b / tp,
     "counted the s × s attention scores"),
], ids=["no-tp", "selective-lse", "fp32-for-bf16", "scores"])
def test_activation_memory_checker_names_the_mistake(slip, expected):
    problems = activation_memory.check(slip)
    assert len(problems) == 1 and problems[0].startswith(expected), problems


def test_activation_memory_checker_passes_an_answer_and_fails_the_starter():
    # b = 2, s = 16, h = 32, a = 4, tp = 2, fp32: 4·(1024·(2 + 14/2) + 4·32/2 + 4·32/2) bytes
    assert activation_memory.reference(2, 16, 32, 4, 2, "none", 4) == 37376
    assert activation_memory.check(_block_bytes()) == [] and activation_memory.check(activation_memory.reference) == []
    starter = activation_memory.check(_from_source(activation_memory.STARTER, "block_activation_bytes"))
    assert starter == ["65536 bytes, expected 37376 (b=2, s=16, h=32, a=4, tp=2, recompute='none', 4 bytes per "
                       "element)"]


AVERAGE_SLIPS = """
import torch.distributed as dist


def right(model):
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()


def summed(model):
    for p in model.parameters():
        dist.all_reduce(p.grad)


def divided_twice(model):
    for p in model.parameters():
        p.grad /= dist.get_world_size()
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()


def untouched(model):
    pass


def divided_only(model):
    for p in model.parameters():
        p.grad /= dist.get_world_size()


def first_only(model):
    p = next(model.parameters())
    dist.all_reduce(p.grad)
    p.grad /= dist.get_world_size()
"""


def test_average_gradients_checker_names_each_slip(tmp_path):
    """One start of 2 ranks judges the right answer and five slips against DDP, each named for what it is."""
    path = tmp_path / "slips.py"
    path.write_text(AVERAGE_SLIPS)
    names = ["right", "summed", "divided_twice", "untouched", "divided_only", "first_only"]
    got = average_gradients.check_functions(path, names, world_size=2)
    assert got == {
        "right": [],
        "summed": ["p.grad holds the SUM over the ranks, 2× DDP's: divide by the world size after the all_reduce "
                   "(p.grad /= world_size)"],
        "divided_twice": ["p.grad is 2× too small: it was divided by the world size twice (dist.all_reduce sums; "
                          "divide once, after it)"],
        "untouched": ["p.grad is still this rank's own gradient: call dist.all_reduce(p.grad) on every parameter"],
        "divided_only": ["p.grad is this rank's own gradient divided by the world size: the dist.all_reduce(p.grad) "
                         "that sums over the ranks is missing"],
        "first_only": [got["first_only"][0]]}
    assert got["first_only"][0].startswith("parameter(s) 1, 2, 3 of model.parameters() (counted from 0) differ "
                                           "from DDP's by up to ")


ROW_PARALLEL_SLIPS = """
import torch
import torch.distributed as dist

from labkit.exercises.row_parallel import reference  # noqa: F401  (judged too)


class G(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        y = x.clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class F(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class Both(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        y = x.clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _cols(weight, group):
    r, t = dist.get_rank(group), dist.get_world_size(group)
    k = weight.shape[1] // t
    return weight[:, r * k:(r + 1) * k]


def right(x, weight, bias, group):
    return G.apply(x @ _cols(weight, group).t(), group) + bias


def no_all_reduce(x, weight, bias, group):
    return x @ _cols(weight, group).t() + bias


def all_reduce_in_backward(x, weight, bias, group):
    return F.apply(x @ _cols(weight, group).t(), group) + bias


def all_reduce_in_both(x, weight, bias, group):
    return Both.apply(x @ _cols(weight, group).t(), group) + bias


def first_shard(x, weight, bias, group):
    k = weight.shape[1] // dist.get_world_size(group)
    return G.apply(x @ weight[:, :k].t(), group) + bias


def bias_every_rank(x, weight, bias, group):
    return G.apply(x @ _cols(weight, group).t() + bias, group)


def raises(x, weight, bias, group):
    return G.apply(x @ weight.t(), group) + bias
"""


def test_row_parallel_checker_names_each_slip(tmp_path):
    """One start of 2 ranks judges the library's answer, a right one and each slip against RowParallelLinear."""
    path = tmp_path / "row_slips.py"
    path.write_text(ROW_PARALLEL_SLIPS)
    names = ["reference", "right", "no_all_reduce", "all_reduce_in_backward", "all_reduce_in_both", "first_shard",
             "bias_every_rank", "raises"]
    got = row_parallel.check_functions(path, names)
    assert got == {
        "reference": [], "right": [],
        "no_all_reduce": ["Y is this rank's partial product X_r W_rᵀ + b on each rank: you forgot the all-reduce; "
                          "g's forward must sum the partial products over the ranks (dist.all_reduce) before the "
                          "bias"],
        "all_reduce_in_backward": ["the all-reduce is in g's backward instead of its forward (that is f, the "
                                   "column-parallel layer's operator): Y is still this rank's partial product and dX "
                                   "is 2x too large; g sums the partial products in forward and passes dY through "
                                   "unchanged in backward"],
        "all_reduce_in_both": ["the input's gradient is 2x too large: g's backward all-reduces, but every rank "
                               "already holds the whole dY; g's backward is the identity (return grad, None)"],
        "first_shard": ["the wrong shard of the weight (rank 0's columns on every rank): rank r's input holds "
                        "features r*k to (r+1)*k, so it multiplies the weight's COLUMNS weight[:, r*k:(r+1)*k] "
                        "(k = in/t)"],
        "bias_every_rank": ["Y holds the bias 2 times: the bias was added on every rank before the sum; add it "
                            "once, after g"],
        "raises": ["on rank 0, row_parallel_linear raised RuntimeError: mat1 and mat2 shapes cannot be multiplied "
                   "(5x4 and 8x6)"]}


def test_init_writes_every_starter_and_refuses_to_overwrite(tmp_path, capsys):
    for name in STARTERS:
        assert name in CHECKS
        assert run_check(name, ["--init", str(tmp_path / f"{name}.py")]) == 0
        compile((tmp_path / f"{name}.py").read_text(), name, "exec")
    assert "fill in the TODOs" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="exists"):
        write_starter("allreduce", tmp_path / "allreduce.py")
    with pytest.raises(ConfigError, match="no starting file"):
        write_starter("gpipe-exercise", tmp_path / "x.py")
    with pytest.raises(ConfigError, match="one FILE"):
        run_check("allreduce", ["--init"])


def _notebooks():
    return sorted(NOTEBOOKS.glob("*.ipynb"))


@pytest.mark.parametrize("path", _notebooks(), ids=lambda p: p.stem)
def test_notebook_is_stored_without_outputs(path):
    """No outputs, and every cell with an id of its own (nbformat 4.5: a cell without one is a warning now and an
    error in later nbformat releases)."""
    nb = json.loads(path.read_text())
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] == "code":
            assert cell.get("outputs") == [] and cell.get("execution_count") is None, f"{path.name} cell {i}"
    ids = [cell.get("id") for cell in nb["cells"]]
    assert None not in ids and len(set(ids)) == len(ids), f"{path.name}: cells without an id, or an id twice"


def exercise_cells():
    """(notebook, check name, function name, source) of every cell tagged ``exercise``."""
    found = []
    for path in _notebooks():
        for cell in json.loads(path.read_text())["cells"]:
            meta = cell.get("metadata", {})
            if "exercise" in meta.get("tags", []):
                found.append((path.stem, meta["labkit"]["check"], meta["labkit"]["function"],
                              "".join(cell["source"])))
    return found


def test_every_notebook_has_one_checked_exercise():
    """Every notebook (01b, 07 and 08 too) has exactly one tagged exercise cell, so the test below runs each."""
    names = [nb for nb, *_ in exercise_cells()]
    assert sorted(names) == [p.stem for p in _notebooks()]
    assert {check for _, check, *_ in exercise_cells()} <= set(CHECKS)


@pytest.mark.parametrize("notebook, check, function, source", exercise_cells(), ids=lambda v: str(v)[:30])
def test_untouched_exercise_cell_fails_its_checker(tmp_path, capsys, notebook, check, function, source):
    lines = source.splitlines()
    if lines[0].startswith("%%writefile"):  # the cell writes a module for the rank processes
        lines = lines[1:]
    if check == "gpipe-exercise":  # the exercise is a shipped file; the cell names it
        target = Path(__file__).resolve().parents[1] / "jobs" / "gpipe" / "mnist_gpipe_exercise.py"
    else:
        target = tmp_path / "exercise.py"
        target.write_text("\n".join(line for line in lines if not line.startswith("%")) + "\n")
    argv = {"gpipe-exercise": [str(target)], "column-parallel": [str(target), "--world-sizes", "2"]}
    assert run_check(check, argv.get(check, [f"{target}:{function}"])) == 1
    out = capsys.readouterr().out
    assert "not yet" in out or "WRONG" in out or "missing" in out.lower(), out
    if check == "average-gradients":
        assert "p.grad is still this rank's own gradient: call dist.all_reduce(p.grad)" in out


def test_every_starting_file_read_from_source_is_the_modules_own():
    """``--init`` reads a starting file from its module's source (no torch); it is the module's attribute."""
    from labkit.exercises.cli import _starter_text
    from labkit.flags import resolve

    for name, spec in STARTERS.items():
        assert _starter_text(spec) == resolve(spec), name


def test_newton_schulz_checker_names_the_slip():
    from labkit.exercises import newton_schulz

    assert newton_schulz.check(newton_schulz.reference) == []

    def transposed_gram(x, a, b, c):  # the (n, n) Gram matrix on the right: the same matrix, a right answer
        gram = x.T @ x
        return a * x + x @ (b * gram + c * gram @ gram)

    assert newton_schulz.check(transposed_gram) == []
    slips = {
        "elementwise x * x": lambda x, a, b, c: a * x + (b * (x * x) + c * (x * x) @ (x * x)) @ x,
        "b and c are swapped": lambda x, a, b, c: a * x + (c * x @ x.T + b * x @ x.T @ x @ x.T) @ x,
        "the a·x term is missing": lambda x, a, b, c: (b * x @ x.T + c * x @ x.T @ x @ x.T) @ x,
        "multiplies x from the LEFT": lambda x, a, b, c: a * x + x @ (b * x @ x.T + c * x @ x.T @ x @ x.T),
        "only a·x": _from_source(newton_schulz.STARTER, "newton_schulz_step"),
    }
    for expected, slip in slips.items():
        problems = newton_schulz.check(slip)
        assert len(problems) == 1 and expected in problems[0], (expected, problems)


def test_every_checker_names_a_syntax_error_with_its_file_and_line(tmp_path, capsys):
    """A file that does not parse is one ``labkit: error:`` line with the file and the line, exit 2, from every
    checker alike (the faults checkers before any rank starts)."""
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\n\n\ndef f(x:\n    return x\n")
    for name in CHECKS:
        assert main(["check", name, str(bad)]) == 2, name
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"labkit: error: {bad}, line 4: '(' was never closed; fix it, then run the check again"], name
