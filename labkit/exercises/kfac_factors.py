"""Notebook 05's exercise (``labkit check kfac-factors FILE``): the Kronecker factors of a Linear layer.

``kfac_factors(a, g)`` gets what K-FAC's hooks see for one ``nn.Linear`` layer with a bias on a batch of N:

    a  (N, d_in)   the layer's inputs
    g  (N, d_out)  the gradients of the batch-MEAN loss w.r.t. the layer's outputs (so N g is per sample)

and returns ``(A, G)`` with the bias as the last column of W, i.e. ``ā = [a; 1]``:

    A = 1/N Σ_n ā_n ā_nᵀ            (d_in + 1, d_in + 1)
    G = 1/N Σ_n (N g_n)(N g_n)ᵀ      (d_out, d_out)

so that A ⊗ G approximates the Fisher block of ``[W b]``. The checker compares with the factors
:class:`labkit.optim.KFAC` captures from the same layer (itself checked against curvlinops), and names the
usual slips: the missing column of ones, the missing 1/N, the missing N² of the batch-mean gradients.
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

    from labkit.optim.kfac import KFAC

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
    elif got_a.shape == (n, n) or got_a.shape == (n + 0, n):
        problems.append(f"A has shape {tuple(got_a.shape)} (samples x samples): use ā.T @ ā, not ā @ ā.T")
    elif got_a.shape != want_a.shape:
        problems.append(f"A has shape {tuple(got_a.shape)}, expected {tuple(want_a.shape)}")
    elif torch.allclose(got_a, want_a * n):
        problems.append("A is N times too large: divide the sum over the batch by N (a mean)")
    elif not torch.allclose(got_a, want_a):
        problems.append(f"A differs from K-FAC's by up to {(got_a - want_a).abs().max().item():.3g}")
    if got_g.shape != want_g.shape:
        problems.append(f"G has shape {tuple(got_g.shape)}, expected {tuple(want_g.shape)} = (d_out, d_out)")
    elif torch.allclose(got_g * n * n, want_g):
        problems.append("G is N² times too small: g is the gradient of the batch MEAN, so per-sample "
                        "gradients are N g; average (N g)(N g)ᵀ")
    elif torch.allclose(got_g * n, want_g):
        problems.append("G is N times too small: average the outer products of the per-sample gradients N g")
    elif not torch.allclose(got_g, want_g):
        problems.append(f"G differs from K-FAC's by up to {(got_g - want_g).abs().max().item():.3g}")
    return problems


def reference(a, g):
    """The solution, written from the definition."""
    import torch

    n = a.shape[0]
    a_bar = torch.cat([a, torch.ones(n, 1, dtype=a.dtype)], 1)  # (N, d_in + 1)
    return a_bar.T @ a_bar / n, (n * g).T @ (n * g) / n


def main(argv: list[str]) -> int:
    return command("kfac-factors", __doc__, "kfac_factors", check,
                   "A and G equal the factors K-FAC captures from the same Linear layer", argv)
