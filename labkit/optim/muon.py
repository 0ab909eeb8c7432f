r"""Muon (Jordan et al. 2024; "Muon is Scalable for LLM Training", Liu et al. 2025): momentum orthogonalised by
Newton–Schulz, for the hidden layers' weight matrices; AdamW for everything else, as its authors do.

For a hidden weight matrix W with gradient G, ``torch.optim.Muon`` (which this module uses) steps::

    B  ← μ B + G                              momentum μ
    B̃  = G + μ B  (Nesterov)                  or B
    O  = NS_k(B̃)  ≈ U Vᵀ  where  B̃ = U S Vᵀ   the orthogonalised update: every singular value ≈ 1
    W  ← W − η λ W − η·a(m, n)·O              decoupled weight decay λ; a = 0.2·√max(m, n) ("match_rms_adamw")

``a(m, n)`` gives O the RMS of an AdamW update, so Muon and the AdamW beside it share one learning rate
(Moonlight's rule; ``--muon-adjust-lr original`` is Keller Jordan's √max(1, m/n)).

**Newton–Schulz** (:func:`newton_schulz`, the kit's own, checked against ``U Vᵀ`` from an SVD and against
torch's): scale ``X₀ = B̃ / ‖B̃‖_F`` (so every singular value is in (0, 1]; work on the transpose when m > n,
so that ``X Xᵀ`` is the smaller Gram matrix), then k times::

    A  = X Xᵀ
    X  ← a X + (b A + c A²) X                 = p(X) with p(σ) = a σ + b σ³ + c σ⁵ on each singular value

The iteration never forms U or V: it maps every singular value σ through the odd polynomial p, k times. With
(a, b, c) = (15/8, −10/8, 3/8) every σ in (0, 1] converges to 1, so X → U Vᵀ. Muon's (3.4445, −4.7750, 2.0315)
trade that convergence for speed: a steep slope at 0 lifts small singular values in 5 steps, and the result
is U S' Vᵀ with S' between about 0.7 and 1.2 — as good for training, at a fraction of the cost.

**Which parameters.** Muon takes the weights of the hidden ``nn.Linear`` layers: not the last Linear (the
classifier or language-model head), not a weight shared with an ``nn.Embedding``, and not convolutions
(``torch.optim.Muon`` takes 2-D parameters only; Keller Jordan's reference flattens conv filters). AdamW
(β = 0.9, 0.95) takes the rest.

Under ``torch.distributed`` each parameter has one owner rank (in each group of ranks, see
:mod:`labkit.optim.split`), which alone keeps its momentum (and the Adam moments) and runs its Newton–Schulz; the stepped parameters then travel from their owners
(:mod:`labkit.optim.split`), as in Moonlight's ZeRO-1-style distributed Muon (which all-gathers the
gradient shards first because its gradients are reduce-scattered; here DDP's all-reduce already left every
gradient whole on every rank). ``--muon-worker-fraction`` f keeps W·f copies, one per group of 1/f ranks.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from labkit.errors import ConfigError
from labkit.optim.split import OwnerSplit, mark_split, refuse_partial

MUON_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
#: (a, b, c) of the classic quintic Newton–Schulz iteration: every singular value in (0, 1] converges to 1
CONVERGENT_COEFFICIENTS = (15 / 8, -10 / 8, 3 / 8)
ADAMW_BETAS = (0.9, 0.95)

FLAGS = [
    {"flag": "--muon-ns-steps", "type": "int", "range": "[1, 99]", "default": 5, "metavar": "K",
     "help": "Newton–Schulz iterations per step"},
    {"flag": "--muon-adjust-lr", "choices": ["match_rms_adamw", "original", "spectral_unclamped"],
     "default": "match_rms_adamw",
     "help": "the step's scale per matrix shape: match_rms_adamw (Moonlight: one learning rate for Muon and AdamW), "
             "original (Keller Jordan's √max(1, m/n)) or spectral_unclamped (√(m/n))"},
    {"flag": "--muon-worker-fraction", "type": "float", "range": "(0, 1]", "default": None, "metavar": "F",
     "help": "several ranks: the fraction of them holding each matrix's state and step, 1/W (default: one owner, "
             "the least memory) .. 1 (every rank steps every matrix, nothing travels); f·W must divide W, as "
             "--kfac-grad-worker-fraction"},
]


def newton_schulz(g: Tensor, steps: int = 5, coefficients: tuple[float, float, float] = MUON_COEFFICIENTS,
                  eps: float = 1e-7) -> Tensor:
    """The orthogonalised ``g`` (m, n): ``steps`` Newton–Schulz iterations (module docstring), in ``g``'s dtype."""
    a, b, c = coefficients
    tall = g.shape[0] > g.shape[1]
    x = g.t() if tall else g
    x = x / x.norm().clamp(min=eps)                             # X₀ = G / ‖G‖_F: singular values in (0, 1]
    for _ in range(steps):
        gram = x @ x.t()                                         # A = X Xᵀ
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)   # bA + cA² (one fused call, as torch.optim.Muon)
        x = torch.addmm(x, poly, x, beta=a)                      # X ← aX + (bA + cA²)X
    return x.t() if tall else x


def muon_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The weights Muon takes: every hidden ``nn.Linear``'s (not the last Linear, not one tied to an embedding)."""
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    linear = [m.weight for m in model.modules() if isinstance(m, nn.Linear) and m.weight.requires_grad]
    return [w for w in linear[:-1] if id(w) not in embedded]


def _cost(p: Tensor) -> float:
    """Newton–Schulz's work on an (m, n) matrix, m·n·min(m, n); a parameter's size otherwise (AdamW)."""
    return float(p.numel() * min(p.shape)) if p.ndim == 2 else float(p.numel())


class MuonWithAdamW(torch.optim.Optimizer):
    """``torch.optim.Muon`` on the hidden weight matrices and ``torch.optim.AdamW`` on the rest, as one optimizer
    for the training loop and the learning-rate schedule (which set the ``lr`` of :attr:`param_groups`: group 0
    is Muon's, group 1 AdamW's).

    Args:
        muon_params: the 2-D weights for Muon (:func:`muon_parameters`).
        other_params: every other trainable parameter.
        lr: η > 0, for both.
        momentum: Muon's μ.
        weight_decay: λ >= 0, decoupled, for both.
        ns_steps: Newton–Schulz iterations.
        adjust_lr: ``torch.optim.Muon``'s ``adjust_lr_fn``.
        distributed: split over the ranks (:mod:`labkit.optim.split`); None: when several ranks are running.
        worker_fraction: f, the fraction of the ranks holding each parameter's state; None: 1/W, one owner.

    Attributes:
        muon, adamw: the two torch optimizers over the parameters this rank owns (None where it owns none).
        split: the :class:`~labkit.optim.split.OwnerSplit`.
    """

    def __init__(self, muon_params: list[Tensor], other_params: list[Tensor], lr: float, momentum: float = 0.95,
                 weight_decay: float = 0.0, ns_steps: int = 5, adjust_lr: str = "match_rms_adamw",
                 distributed: bool | None = None, worker_fraction: float | None = None):
        if not muon_params:
            raise ValueError("Muon found no hidden nn.Linear weight to orthogonalise in this model (only the output "
                             "layer, convolutions, embeddings, biases); use --optimizer adam")
        groups = [{"params": list(muon_params), "kind": "muon"}]
        if other_params:
            groups.append({"params": list(other_params), "kind": "adamw"})
        super().__init__(groups, dict(lr=lr, momentum=momentum, weight_decay=weight_decay))
        params = [p for g in self.param_groups for p in g["params"]]
        self.split = OwnerSplit(params, [_cost(p) for p in params], "muon", distributed, worker_fraction)
        owned = {id(p) for i, p in enumerate(params) if self.split.mine(i)}
        mine = [[p for p in g["params"] if id(p) in owned] for g in self.param_groups]
        muon = getattr(torch.optim, "Muon", None)
        if muon is None:  # the kit runs from torch 2.6; torch.optim.Muon came with 2.9
            raise ConfigError(f"--optimizer muon needs torch.optim.Muon, which torch 2.9 added; this is torch "
                              f"{torch.__version__}: upgrade torch, or train with --optimizer adam")
        self.muon = (muon(mine[0], lr=lr, weight_decay=weight_decay, momentum=momentum, ns_steps=ns_steps,
                          adjust_lr_fn=adjust_lr) if mine[0] else None)
        self.adamw = (torch.optim.AdamW(mine[1], lr=lr, betas=ADAMW_BETAS, weight_decay=weight_decay)
                      if len(mine) > 1 and mine[1] else None)

    def _inner(self):
        return [(g, opt) for g, opt in zip(self.param_groups, (self.muon, self.adamw)) if opt is not None]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group, opt in self._inner():
            opt.param_groups[0]["lr"] = group["lr"]               # the schedule sets the outer groups' rate
            opt.step()
        self.split.share()
        return loss

    @property
    def parts(self) -> list[torch.optim.Optimizer]:
        """The torch optimizers this rank steps (where :func:`labkit.optim.split.state_bytes` finds the state)."""
        return [opt for _, opt in self._inner()]

    def _states(self) -> dict[int, dict]:
        """Each parameter's state in the torch optimizer that steps it, by its index in :attr:`param_groups`."""
        index = {id(p): i for i, p in enumerate(self.split.params)}
        return {index[id(p)]: dict(state) for _, opt in self._inner() for p, state in opt.state.items()}

    def state_dict(self) -> dict:
        """This rank's share: ``{"state": {parameter index: its state}, "lr": per group}``, marked as a share."""
        return mark_split({"state": self._states(), "lr": [g["lr"] for g in self.param_groups]}, self.split)

    def gather_state_dict(self) -> dict:
        """The whole state on rank 0 (every owner's, gathered): every rank calls it when a checkpoint is saved."""
        state = {"state": self.split.gather_state(self._states()), "lr": [g["lr"] for g in self.param_groups]}
        return mark_split(state, self.split, gathered=True)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a whole state into the torch optimizers of the parameters this rank owns (any split resumes it)."""
        refuse_partial(state_dict, "muon")
        saved, index = state_dict["state"], {id(p): i for i, p in enumerate(self.split.params)}
        for _, opt in self._inner():
            inner = opt.state_dict()  # torch's own loading puts each tensor on its parameter's device
            inner["state"] = {local: saved[index[id(p)]] for local, p in enumerate(opt.param_groups[0]["params"])
                              if index[id(p)] in saved}
            opt.load_state_dict(inner)
        for group, lr in zip(self.param_groups, state_dict.get("lr", [])):
            group["lr"] = lr


def build(model: nn.Module, lr: float, momentum: float, weight_decay: float, options: dict) -> MuonWithAdamW:
    """``labkit train --optimizer muon``: Muon on the hidden Linear weights, AdamW on the rest, from its flags."""
    muon = muon_parameters(model)
    taken = {id(p) for p in muon}
    other = [p for p in model.parameters() if p.requires_grad and id(p) not in taken]
    return MuonWithAdamW(muon, other, lr=lr, momentum=momentum, weight_decay=weight_decay,
                         ns_steps=options["muon_ns_steps"], adjust_lr=options["muon_adjust_lr"],
                         worker_fraction=options.get("muon_worker_fraction"))
