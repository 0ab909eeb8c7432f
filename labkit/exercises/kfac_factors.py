"""Notebook 05's exercise (``labkit check kfac-factors FILE``): the Kronecker factors of a Linear layer.

``kfac_factors(a, g)`` gets what K-FAC's hooks see for one ``nn.Linear`` layer with a bias on a batch of N:

    a  (N, d_in)   the layer's inputs
    g  (N, d_out)  the gradients of the batch-MEAN loss w.r.t. the layer's outputs (so N g is per sample)

and returns ``(A, G)`` with the bias as the last column of W, i.e. ``ā = [a; 1]``:

    A = 1/N Σ_n ā_n ā_nᵀ            (d_in + 1, d_in + 1)
    G = 1/N Σ_n (N g_n)(N g_n)ᵀ      (d_out, d_out)

so that A ⊗ G approximates the Fisher block of ``[W b]``. The checker compares with the factors
:class:`labkit.optim.KFAC` captures from the same layer (itself checked against curvlinops), and names the
usual slips: the missing column of ones or ones in the first column, a factor N or N² too large or too small
(the missing 1/N of a mean, the N² of the batch-mean gradients).
"""
from __future__ import annotations

from typing import Callable

from labkit.exercises import command

STARTER = '''\
import torch


def kfac_factors(a, g):
    """a (N, d_in) inputs, g (N, d_out) gradients of the batch-mean loss w.r.t. the outputs -> (A, G)."""
    n = a.shape[0]
    a_bar = a  # TODO: append a column of ones (the bias is the last column of W)
    A = a_bar.T @ a_bar  # TODO: the mean over the batch
    G = g.T @ g  # TODO: per-sample gradients are N g; average their outer products
    return A, G
'''


def captured(seed: int = 0):
    """``(a, g, A, G)``: one Linear layer's inputs and output gradients on a batch, and K-FAC's factors."""
    import torch
    from torch import nn

    from labkit.optim.kfac.preconditioner import KFAC

    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    seen = {}
    layer = net[2]
    layer.register_forward_hook(lambda m, inp, out: seen.__setitem__("a", inp[0].detach().clone()))
    layer.register_full_backward_hook(lambda m, gin, gout: seen.__setitem__("g", gout[0].detach().clone()))
    kfac = KFAC(net, factor_update_freq=1, kl_clip=0)
    x, y = torch.randn(7, 5, dtype=torch.float64), torch.randint(0, 3, (7,))
    nn.functional.cross_entropy(net(x), y).backward()  # a batch mean, as K-FAC requires
    kfac.step()
    factors = next(l for l in kfac.layers if l.module is layer)
    A, G = factors.A.clone(), factors.G.clone()
    kfac.close()
    return seen["a"], seen["g"], A, G


def check(kfac_factors: Callable) -> list[str]:
    """Problems of ``kfac_factors`` against K-FAC's own factors on one batch; [] when right."""
    import torch

    a, g, want_a, want_g = captured()
    n = a.shape[0]
    try:
        got = kfac_factors(a.clone(), g.clone())
        got_a, got_g = (torch.as_tensor(t, dtype=torch.float64) for t in got)
    except Exception as exc:  # the learner's code: say what it raised, do not crash
        return [f"kfac_factors raised {type(exc).__name__}: {exc}"]
    problems = []
    if got_a.shape == (a.shape[1], a.shape[1]):
        problems.append(f"A has shape {tuple(got_a.shape)}: append a column of ones to a (the bias), giving "
                        f"{tuple(want_a.shape)}")
    elif got_a.shape == (n, n):
        problems.append(f"A has shape {tuple(got_a.shape)} (samples x samples): use ā.T @ ā, not ā @ ā.T")
    elif got_a.shape != want_a.shape:
        problems.append(f"A has shape {tuple(got_a.shape)}, expected {tuple(want_a.shape)}")
    else:
        ones_first = torch.roll(want_a, (1, 1), (0, 1))  # the same factor with the ones column moved to the front
        for name, want in (("", want_a), ("ones first", ones_first)):
            slip = _scale_slip(got_a, want, n, "A", "A is the MEAN over the batch: divide ā.T @ ā by N, once")
            if slip is not None:
                if name:
                    slip = ("the column of ones is the FIRST column of ā: the bias is the LAST column of W = [W b], "
                            "so append the ones after a (torch.cat([a, ones], 1))" + ("" if slip == "" else
                                                                                      "; and " + slip))
                if slip:
                    problems.append(slip)
                break
        else:
            problems.append(f"A differs from K-FAC's by up to {(got_a - want_a).abs().max().item():.3g}")
    if got_g.shape != want_g.shape:
        problems.append(f"G has shape {tuple(got_g.shape)}, expected {tuple(want_g.shape)} = (d_out, d_out)")
    else:
        slip = _scale_slip(got_g, want_g, n, "G", "g is the gradient of the batch MEAN, so per-sample gradients "
                           "are N g; average (N g)(N g)ᵀ over the batch")
        if slip is None:
            slip = f"G differs from K-FAC's by up to {(got_g - want_g).abs().max().item():.3g}"
        if slip:
            problems.append(slip)
    return problems


def _scale_slip(got, want, n: int, name: str, rule: str) -> str | None:
    """``""`` when ``got`` equals ``want``; a sentence when it is ``want`` times N, N², 1/N or 1/N² (the usual
    slips of a batch mean); ``None`` when it is something else."""
    import torch

    for power in (0, 1, -1, 2, -2):
        if torch.allclose(got, want * float(n) ** power):
            if power == 0:
                return ""
            size = "N" if abs(power) == 1 else "N²"
            return f"{name} is {size} = {n ** abs(power)} times too {'large' if power > 0 else 'small'}: {rule}"
    return None


def reference(a, g):
    """The solution, written from the definition."""
    import torch

    n = a.shape[0]
    a_bar = torch.cat([a, torch.ones(n, 1, dtype=a.dtype)], 1)  # (N, d_in + 1)
    return a_bar.T @ a_bar / n, (n * g).T @ (n * g) / n


def main(argv: list[str]) -> int:
    return command("kfac-factors", __doc__, "kfac_factors", check,
                   "A and G equal the factors K-FAC captures from the same Linear layer", argv)
