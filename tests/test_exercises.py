"""Every workshop exercise: its checker passes a right answer, fails a wrong one with the reason, writes a
starting file with ``--init``; and every notebook's exercise cell, untouched, fails its checker."""
import json
from pathlib import Path

import pytest
import torch

from labkit.checks import CHECKS, STARTERS, run_check, write_starter
from labkit.errors import ConfigError
from labkit.exercises import average_gradients, kfac_factors, lr_schedule, training_step

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
    assert "append a column of ones" in problems[0] and "N times too small" in problems[1]
    mean_g = lambda a, g: (kfac_factors.reference(a, g)[0], g.T @ g / len(g))  # noqa: E731
    assert "N² times too small" in kfac_factors.check(mean_g)[0]


def test_lr_schedule_checker():
    assert lr_schedule.check(lr_schedule.reference) == []
    no_warmup = lambda step, base_lr, world_size, spe, warm: base_lr * world_size  # noqa: E731
    assert "starts at base_lr and rises linearly" in lr_schedule.check(no_warmup)[0]
    assert "expected" in lr_schedule.check(_from_source(lr_schedule.STARTER, "lr_at"))[0]
    # the checker's ground truth is the schedule labkit train runs; spot-check it against the rule
    assert lr_schedule.expected(0, 0.1, 8, 10, 2) == pytest.approx(0.1)
    assert lr_schedule.expected(10, 0.1, 8, 10, 2) == pytest.approx(0.1 + 0.7 * 10 / 20)
    assert lr_schedule.expected(25, 0.1, 8, 10, 2) == pytest.approx(0.8)


def test_average_gradients_checker_passes_the_solution():
    # the reference, on 2 ranks against DDP; a wrong answer (the notebook's untouched stub) fails below
    assert average_gradients.check_file(None) == []


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
    nb = json.loads(path.read_text())
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] == "code":
            assert cell.get("outputs") == [] and cell.get("execution_count") is None, f"{path.name} cell {i}"


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
        assert "the gradients differ from DDP's" in out
