"""The linear algebra K-FAC rests on: ``vec``, Kronecker-factored solves, damping.

Conventions (the seed's and Martens & Grosse's): ``vec`` stacks the *columns* of a matrix, so for
``A`` of shape (n, n), ``G`` of shape (m, m) and ``X`` of shape (m, n)::

    (A ⊗ G) vec(X) = vec(G X Aᵀ)          the vec identity (A, G symmetric: vec(G X A))
    (A ⊗ G)⁻¹      = A⁻¹ ⊗ G⁻¹           the inverse identity

so a Kronecker-factored block ``F = A ⊗ G`` of size (nm, nm) is never formed: ``F⁻¹ vec(∇W) =
vec(G⁻¹ ∇W A⁻¹)`` costs two small solves. ``torch.flatten`` stacks rows instead, hence :func:`vec`.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor


def vec(x: Tensor) -> Tensor:
    """Column-stacking ``vec``: (m, n) -> (m·n,), column 0 first."""
    return x.t().reshape(-1)


def unvec(v: Tensor, rows: int) -> Tensor:
    """Inverse of :func:`vec`: (m·n,) -> (m, n) with ``m = rows``."""
    return v.reshape(-1, rows).t()


def symmetric_eigen(factor: Tensor) -> tuple[Tensor, Tensor]:
    """``factor = Q diag(λ) Qᵀ`` for a symmetric PSD factor (d, d) -> (Q (d, d), λ (d,)).

    Round-off can make tiny eigenvalues of a PSD matrix negative; they are clamped to 0 so that
    ``λ_G λ_Aᵀ + γ >= γ > 0`` always holds. float32 LAPACK occasionally fails to converge on strongly
    rank-deficient factors (dead ReLU units give all-zero rows) — by raising, or silently with NaNs in a finite
    factor's result; those are decomposed in float64.
    """
    try:
        eigenvalues, eigenvectors = torch.linalg.eigh(factor)
        converged = factor.dtype == torch.float64 or bool(torch.isfinite(eigenvalues).all()
                                                           and torch.isfinite(eigenvectors).all())
    except torch.linalg.LinAlgError:
        if factor.dtype == torch.float64:
            raise
        converged = False
    if not converged:
        eigenvalues, eigenvectors = (t.to(factor.dtype) for t in torch.linalg.eigh(factor.double()))
    return eigenvectors, eigenvalues.clamp_(min=0.0)


def precondition_eigen(grad: Tensor, qa: Tensor, la: Tensor, qg: Tensor, lg: Tensor, damping: float) -> Tensor:
    """``(A ⊗ G + γI)⁻¹ vec(∇W)`` in the Kronecker eigenbasis, returned as a matrix.

    With ``A = Q_A Λ_A Q_Aᵀ`` and ``G = Q_G Λ_G Q_Gᵀ``, ``A ⊗ G + γI = (Q_A ⊗ Q_G) (Λ_A ⊗ Λ_G + γI) (Q_A ⊗ Q_G)ᵀ``,
    so the damped solve is *exact*::

        Q_G [(Q_Gᵀ ∇W Q_A) / (λ_G λ_Aᵀ + γ)] Q_Aᵀ

    Args:
        grad: ∇W, (d_out, d_in).
        qa, la: eigenvectors (d_in, d_in) and eigenvalues (d_in,) of A.
        qg, lg: eigenvectors (d_out, d_out) and eigenvalues (d_out,) of G.
        damping: γ > 0.
    """
    v = qg.t() @ grad @ qa                     # (d_out, d_in) in the eigenbasis
    v = v / (lg[:, None] * la[None, :] + damping)
    return qg @ v @ qa.t()


def eigen_operands(qa: Tensor, la: Tensor, qg: Tensor, lg: Tensor, damping: float) -> tuple[Tensor, Tensor, Tensor]:
    """What :func:`precondition_eigen` needs, precomputed once per decomposition: ``(Q_G, Q_A, 1 / (λ_G λ_Aᵀ + γ))``,
    the last (d_out, d_in), so that a step only multiplies (:func:`precondition_batched`)."""
    return qg, qa, (lg[:, None] * la[None, :] + damping).reciprocal_()


def precondition_batched(grads: Tensor, operands: tuple[Tensor, ...], out: Tensor | None = None) -> Tensor:
    """Precondition k layers of one shape at once: ``grads`` (k, d_out, d_in) with ``operands`` stacked along a first
    dim of k: ``(Q_G, Q_A, scale)`` of :func:`eigen_operands` (``Q_G [(Q_Gᵀ ∇W Q_A) ⊙ scale] Q_Aᵀ``), or the damped
    inverses ``(G_d⁻¹, A_d⁻¹)`` (``G_d⁻¹ ∇W A_d⁻¹``). Four (two) batched matrix products, whatever k; the last
    one writes into ``out`` when given."""
    if len(operands) == 3:
        qg, qa, scale = operands
        v = torch.matmul(torch.matmul(qg.transpose(-1, -2), grads), qa).mul_(scale)
        return torch.matmul(torch.matmul(qg, v), qa.transpose(-1, -2), out=out)
    g_inv, a_inv = operands
    return torch.matmul(torch.matmul(g_inv, grads), a_inv, out=out)


def factored_damping(a: Tensor, g: Tensor, damping: float) -> tuple[float | Tensor, float | Tensor]:
    """Split γ over the two factors: ``(π√γ, √γ/π)`` with ``π² = (tr A / dim A) / (tr G / dim G)``.

    Martens & Grosse (2015, §6.3): ``(A + π√γ I) ⊗ (G + √γ/π I) = A⊗G + γI + √γ (π I⊗G + A⊗I/π)``;
    π balances the two factors' scales (which differ by orders of magnitude) and minimises the extra
    cross term. A factor with zero trace (a dead layer) gets π = 1.
    """
    ta = a.diagonal().mean()
    tg = g.diagonal().mean()
    pi = torch.where((ta > 0) & (tg > 0), torch.sqrt(ta / tg.clamp(min=torch.finfo(g.dtype).tiny)),
                     torch.ones_like(ta))
    root = math.sqrt(damping)
    return pi * root, root / pi


def damped_inverse(factor: Tensor, shift: float | Tensor) -> Tensor:
    """``(F + shift·I)⁻¹`` of a symmetric PSD factor through its Cholesky factor (d, d) -> (d, d)."""
    eye = torch.eye(factor.shape[0], dtype=factor.dtype, device=factor.device)
    chol = torch.linalg.cholesky(factor + shift * eye)
    return torch.cholesky_inverse(chol)


def precondition_inverse(grad: Tensor, a_inv: Tensor, g_inv: Tensor) -> Tensor:
    """``((A + π√γI) ⊗ (G + √γ/π I))⁻¹ vec(∇W) = vec(G_d⁻¹ ∇W A_d⁻¹)``: (d_out, d_in) -> (d_out, d_in)."""
    return g_inv @ grad @ a_inv
