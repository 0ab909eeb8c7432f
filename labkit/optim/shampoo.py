r"""Shampoo (Gupta, Koren & Singer 2018; Anil et al. 2020; distributed Shampoo, Shi et al. 2023): a Kronecker-factored
preconditioner kept by the optimizer itself, with its step length grafted from Adam or SGD.

K-FAC approximates a layer's Fisher block by ``A ⊗ G`` from the activations and the output gradients. Shampoo
builds its two factors from the gradient matrix alone, so it needs no hooks and works for any parameter that
can be viewed as a matrix (a convolution's (out, in·kh·kw)). For a parameter W viewed as an (m, n) matrix with
gradient ∇W, in the order :meth:`Shampoo.step` codes it::

    G  = ∇W + λ W                                           L2 weight decay λ
    L  ← β L + G Gᵀ          (m, m)                         β = 1: the sum L = Σ_t G_t G_tᵀ of the paper
    R  ← β R + Gᵀ G          (n, n)                         R = Σ_t G_tᵀ G_t
    every F steps (and on the first):
        L^{-1/4} = Q_L diag((λ_L + ε)^{-1/4}) Q_Lᵀ           from the eigendecomposition L = Q_L diag(λ_L) Q_Lᵀ
        R^{-1/4} = Q_R diag((λ_R + ε)^{-1/4}) Q_Rᵀ           (a side longer than max_dim keeps I instead)
    P  = L^{-1/4} G R^{-1/4}                                Shampoo's direction
    D  = G                                  graft "sgd"     the direction whose length P borrows
       = G / (√v̂ + ε_a),  v ← β₂ v + (1−β₂) G²,  v̂ = v / (1−β₂ᵗ)        graft "adam" (its second moment only)
    P ← (‖D‖ / ‖P‖) P                                       grafting: Shampoo's direction, D's step length
    V ← μ V + P                                             momentum μ
    W ← W − η V                                             learning rate η

Why the power −1/4: for a matrix, ``(R ⊗ L)`` (column-stacking vec) is the full-matrix AdaGrad statistic's
Kronecker bound, and its inverse *square* root ``(R ⊗ L)^{-1/2} = R^{-1/2} ⊗ L^{-1/2}`` is split evenly
between the two sides, ``vec(L^{-1/4} G R^{-1/4}) = (R^{-1/4} ⊗ L^{-1/4}) vec(G)``. The test checks exactly that
identity, on a dense float64 Kronecker product. A one-dimensional parameter (a bias) gets the grafted
direction alone, ``P = D``.

Grafting (Agarwal et al. 2020) takes only the *direction* from Shampoo and the per-layer step length from a
well-tuned first-order method, so the learning rate of that method carries over. The roots are recomputed every
``update_freq`` steps (the dear part, O(m³ + n³) per matrix); in between the stale ones precondition each step.

What the reference implementation (facebookresearch/optimizers, which needs Python >= 3.12) does that this one
does not: blocking of large matrices into max_dim × max_dim blocks (here a long side is left unpreconditioned),
the ε chosen relative to the largest eigenvalue, inverse roots by coupled Newton iterations, the first steps on
the graft alone (``start_preconditioning_step``), bias correction of L and R, and fp64 statistics.

Under ``torch.distributed`` each rank steps only the parameters it owns and broadcasts them
(:mod:`labkit.optim.split`): the roots are computed once per group of G ranks, not W times
(``--shampoo-worker-fraction`` f = 1/G, distributed Shampoo's per-group workers).
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from labkit.optim.kfac.linalg import symmetric_eigen
from labkit.optim.split import SplitOptimizer

GRAFTS = ("adam", "sgd")

FLAGS = [
    {"flag": "--shampoo-update-freq", "type": "int", "range": "[1, inf)", "default": 10, "metavar": "STEPS",
     "help": "steps between the eigendecompositions of L and R (their inverse fourth roots)"},
    {"flag": "--shampoo-decay", "type": "float", "range": "(0, 1]", "default": 1.0, "metavar": "BETA",
     "help": "L ← βL + GGᵀ, R ← βR + GᵀG; 1 keeps the plain sums of the paper"},
    {"flag": "--shampoo-eps", "type": "float", "range": "(0, inf)", "default": 1e-6,
     "help": "ε added to the eigenvalues of L and R before the root"},
    {"flag": "--shampoo-graft", "choices": ["adam", "sgd"], "default": "adam",
     "help": "whose step length Shampoo's direction borrows: Adam's (its second moment, β₂ 0.999) or SGD's"},
    {"flag": "--shampoo-max-dim", "type": "int", "range": "[1, inf)", "default": 1024, "metavar": "D",
     "help": "a side longer than D is left unpreconditioned (identity)"},
    {"flag": "--shampoo-worker-fraction", "type": "float", "range": "(0, 1]", "default": None, "metavar": "F",
     "help": "several ranks: the fraction of them holding each matrix's state and step, 1/W (default: one owner, "
             "the least memory) .. 1 (every rank steps every matrix, nothing travels); f·W must divide W, as "
             "--kfac-grad-worker-fraction"},
]


def as_matrix(p: Tensor) -> Tensor:
    """A parameter as the matrix Shampoo and SOAP precondition: (out, everything else); a view, not a copy."""
    return p.reshape(p.shape[0], -1)


def inverse_root(stat: Tensor, eps: float, root: int) -> Tensor:
    """``(stat + εI)^{-1/root}`` of a symmetric PSD matrix through its eigendecomposition."""
    q, lam = symmetric_eigen(stat)
    return (q * (lam + eps).pow(-1.0 / root)) @ q.t()


def matrix_cost(p: Tensor, max_dim: int) -> float:
    """Work per step of a parameter, for the owners: m³ + n³ for the sides that are preconditioned, else its size."""
    if p.ndim < 2:
        return float(p.numel())
    m, n = as_matrix(p).shape
    return float(sum(d ** 3 for d in (m, n) if d <= max_dim) + p.numel())


class Shampoo(SplitOptimizer):
    """Shampoo with grafting and momentum (formulas in the module docstring).

    Args:
        params: parameters (one list, or groups).
        lr: η > 0.
        momentum: μ in [0, 1).
        weight_decay: λ >= 0 (added to the gradient, as SGD does).
        update_freq: F >= 1, steps between the roots' eigendecompositions.
        decay: β in (0, 1] for L and R.
        eps: ε > 0 added to their eigenvalues.
        graft: ``"adam"`` or ``"sgd"``.
        graft_beta2, graft_eps: β₂ and ε_a of the Adam graft.
        max_dim: sides longer than this are not preconditioned.
        distributed: split the parameters over the ranks (:mod:`labkit.optim.split`); None: when a process group
            of several ranks is running.
        worker_fraction: f, the fraction of the ranks holding each parameter's state (:mod:`labkit.optim.split`;
            f·W must divide W); None: 1/W, one owner.

    Attributes:
        split: the :class:`~labkit.optim.split.OwnerSplit` (owners, bytes sent).
    """

    name = "shampoo"

    def __init__(self, params, lr: float, momentum: float = 0.9, weight_decay: float = 0.0, update_freq: int = 10,
                 decay: float = 1.0, eps: float = 1e-6, graft: str = "adam", graft_beta2: float = 0.999,
                 graft_eps: float = 1e-8, max_dim: int = 1024, distributed: bool | None = None,
                 worker_fraction: float | None = None):
        if not lr > 0:
            raise ValueError(f"Shampoo learning rate must be > 0, got {lr}")
        if not 0 <= momentum < 1:
            raise ValueError(f"Shampoo momentum must be in [0, 1), got {momentum}")
        if not weight_decay >= 0:
            raise ValueError(f"Shampoo weight decay must be >= 0, got {weight_decay}")
        if isinstance(update_freq, bool) or not isinstance(update_freq, int) or update_freq < 1:
            raise ValueError(f"Shampoo update frequency must be an integer >= 1, got {update_freq!r}")
        if not 0 < decay <= 1:
            raise ValueError(f"Shampoo decay must be in (0, 1], got {decay}")
        if not eps > 0:
            raise ValueError(f"Shampoo ε must be > 0, got {eps}")
        if graft not in GRAFTS:
            raise ValueError(f"Shampoo graft must be one of {', '.join(GRAFTS)}, got {graft!r}")
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, update_freq=update_freq, decay=decay,
                        eps=eps, graft=graft, graft_beta2=graft_beta2, graft_eps=graft_eps, max_dim=max_dim)
        super().__init__(params, defaults)
        self._split([matrix_cost(p, g["max_dim"]) for g in self.param_groups for p in g["params"]], distributed,
                    worker_fraction)

    def _step_one(self, p: Tensor, group: dict) -> None:
        state = self.state[p]
        lam, beta, eps = group["weight_decay"], group["decay"], group["eps"]
        grad = p.grad.add(p, alpha=lam) if lam else p.grad                          # G = ∇W + λW
        if not state:
            state["step"] = 0
            state["momentum"] = torch.zeros_like(p)
            if group["graft"] == "adam":
                state["graft_v"] = torch.zeros_like(p)
        t = state["step"] = state["step"] + 1
        direction = None
        if p.ndim >= 2:
            g = as_matrix(grad)
            m, n = g.shape
            sides = [("L", m, lambda: g @ g.t()), ("R", n, lambda: g.t() @ g)]
            roots = {}
            for key, d, outer in sides:
                if d > group["max_dim"]:
                    continue
                if key not in state:
                    state[key] = torch.zeros(d, d, dtype=g.dtype, device=g.device)
                state[key].mul_(beta).add_(outer())                                  # L ← βL + GGᵀ, R ← βR + GᵀG
                if (t - 1) % group["update_freq"] == 0:                              # every F steps, and the first
                    state[f"{key}_root"] = inverse_root(state[key], eps, 4)          # L^{-1/4}, R^{-1/4}
                roots[key] = state[f"{key}_root"]
            direction = g
            if "L" in roots:
                direction = roots["L"] @ direction
            if "R" in roots:
                direction = direction @ roots["R"]                                   # P = L^{-1/4} G R^{-1/4}
            direction = direction.reshape_as(p)
        if group["graft"] == "adam":
            b2 = group["graft_beta2"]
            v = state["graft_v"].mul_(b2).addcmul_(grad, grad, value=1 - b2)         # v ← β₂v + (1−β₂)G²
            graft = grad / ((v / (1 - b2 ** t)).sqrt_().add_(group["graft_eps"]))   # D = G / (√v̂ + ε_a)
        else:
            graft = grad                                                             # D = G
        if direction is None:
            direction = graft                                                        # a vector: P = D
        else:
            norm = torch.linalg.vector_norm(direction)
            scale = torch.where(norm > 0, torch.linalg.vector_norm(graft) / norm, torch.zeros_like(norm))
            direction = direction * scale                                            # P ← (‖D‖/‖P‖) P
        buf = state["momentum"].mul_(group["momentum"]).add_(direction)              # V ← μV + P
        p.sub_(buf, alpha=group["lr"])                                               # W ← W − ηV


def build(model: nn.Module, lr: float, momentum: float, weight_decay: float, options: dict) -> Shampoo:
    """``labkit train --optimizer shampoo``: Shampoo over ``model``'s trainable parameters, from its flags."""
    params = [p for p in model.parameters() if p.requires_grad]
    return Shampoo(params, lr=lr, momentum=momentum, weight_decay=weight_decay,
                   update_freq=options["shampoo_update_freq"], decay=options["shampoo_decay"],
                   eps=options["shampoo_eps"], graft=options["shampoo_graft"], max_dim=options["shampoo_max_dim"],
                   worker_fraction=options.get("shampoo_worker_fraction"))

