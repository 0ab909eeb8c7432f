"""Notebook 05b's exercise (``labkit check newton-schulz FILE``): one Newton–Schulz iteration, Muon's core.

``newton_schulz_step(x, a, b, c)`` gets a matrix x (m, n) with m <= n and returns

    A = x xᵀ                         (m, m), the smaller Gram matrix
    a x + (b A + c A²) x             (m, n)

which maps every singular value σ of x to a σ + b σ³ + c σ⁵ and keeps its singular vectors. The checker runs
the step next to :func:`labkit.optim.muon.newton_schulz`'s (one iteration, float64) on a wide and a square matrix,
then runs the learner's step 30 times with (15/8, −10/8, 3/8) and compares with ``U Vᵀ`` from an SVD, and names
the usual slips: an elementwise ``x * x`` for the Gram matrix, b and c swapped, the ``a x`` term missing, the
polynomial applied on the right of x with the (m, m) Gram matrix.
"""
from __future__ import annotations

from typing import Callable

from labkit.exercises import command

STARTER = '''\
import torch


def newton_schulz_step(x, a, b, c):
    """One Newton–Schulz iteration on x (m, n), m <= n: a x + (b A + c A²) x with A = x xᵀ."""
    gram = x  # TODO: A = x xᵀ, the (m, m) Gram matrix
    return a * x  # TODO: add (b A + c A²) x
'''


def reference(x, a, b, c):
    """The solution, written from the definition."""
    gram = x @ x.T
    return a * x + (b * gram + c * gram @ gram) @ x


def _cases():
    import torch

    g = torch.Generator().manual_seed(0)
    out = []
    for shape in ((4, 4), (3, 5)):  # square first: an elementwise x * x still has the right shape there
        x = torch.randn(*shape, generator=g, dtype=torch.float64)
        out.append(x / x.norm())  # singular values in (0, 1], as Newton–Schulz starts
    return out


def _slips(x, a, b, c) -> dict[str, object]:
    """What the usual slips return, with the message that names each."""
    gram = x @ x.T
    elementwise = x * x
    return {
        "A is the matrix product x @ x.T (the Gram matrix), not the elementwise x * x":
            a * x + (b * elementwise + c * elementwise @ elementwise) @ x if x.shape[0] == x.shape[1] else None,
        "b and c are swapped: b multiplies A = x xᵀ (σ³), c multiplies A² (σ⁵)": a * x + (c * gram + b * gram @ gram) @ x,
        "the a·x term is missing: return a x + (b A + c A²) x": (b * gram + c * gram @ gram) @ x,
        "(b A + c A²) with A = x @ x.T multiplies x from the LEFT, (b A + c A²) @ x (on the right of x it would need "
        "the other Gram matrix, x.T @ x)": a * x + x @ (b * gram + c * gram @ gram),
        "only a·x: add (b A + c A²) x with A = x @ x.T — the odd powers σ³ and σ⁵ that push σ towards 1": a * x,
    }


def check(newton_schulz_step: Callable) -> list[str]:
    """Problems of ``newton_schulz_step`` against the reference iteration and the SVD; [] when right."""
    import torch

    from labkit.optim.muon import CONVERGENT_COEFFICIENTS, MUON_COEFFICIENTS, newton_schulz

    a, b, c = MUON_COEFFICIENTS
    for x in _cases():
        try:
            got = torch.as_tensor(newton_schulz_step(x.clone(), a, b, c), dtype=torch.float64)
        except Exception as exc:  # the learner's code: say what it raised, do not crash
            return [f"newton_schulz_step raised {type(exc).__name__} on a {tuple(x.shape)} matrix: {exc}"]
        want = newton_schulz(x, steps=1, coefficients=(a, b, c))  # x has norm 1: its first division changes nothing
        if got.shape != want.shape:
            return [f"on x of shape {tuple(x.shape)} it returned shape {tuple(got.shape)}: (b A + c A²), with "
                    "A = x @ x.T of shape (m, m), multiplies x from the LEFT, giving (m, n)"]
        if torch.allclose(got, want, rtol=1e-10, atol=1e-12):
            continue
        for message, slip in _slips(x, a, b, c).items():
            if slip is not None and torch.allclose(got, slip, rtol=1e-10, atol=1e-12):
                return [message]
        return [f"on a {tuple(x.shape)} matrix it differs from a x + (b A + c A²) x by up to "
                f"{(got - want).abs().max().item():.3g}"]
    x = _cases()[0]
    for _ in range(30):
        x = torch.as_tensor(newton_schulz_step(x, *CONVERGENT_COEFFICIENTS), dtype=torch.float64)
    u, _, vh = torch.linalg.svd(_cases()[0], full_matrices=False)
    if not torch.allclose(x, u @ vh, atol=1e-8):
        return ["30 steps with (15/8, -10/8, 3/8) do not reach U Vᵀ of the SVD: check the step on its own first"]
    return []


def main(argv: list[str]) -> int:
    return command("newton-schulz", __doc__, "newton_schulz_step", check,
                   "one Newton–Schulz iteration: equal to Muon's, and 30 of them reach U Vᵀ of the SVD", argv)
