"""What K-FAC keeps for one layer: the Kronecker factors A and G, captured from Linear and Conv2d layers.

For a batch of N samples with T positions each (T = 1 for Linear, H_out·W_out for Conv2d)::

    ā  (N·T, d_in)   layer inputs, Conv2d: unfolded kernel patches (Grosse & Martens 2016), with a
                     trailing 1 when the layer has a bias (the bias is the last column of W)
    g  (N·T, d_out)  gradients of the batch-mean loss w.r.t. the layer outputs (so N·g is per-sample)

    A = 1/(N·T) Σ ā āᵀ              (d_in, d_in)    positions averaged
    G = 1/N Σ (N g)(N g)ᵀ = N Σ g gᵀ  (d_out, d_out)  positions summed

A ⊗ G equals Grosse & Martens' Ω ⊗ Γ (they sum positions in Ω and average them in Γ: same product) and
the empirical K-FAC ("expand") of curvlinops exactly. The loss must be a mean over the batch, as
``nn.CrossEntropyLoss()`` is by default.

``approx="reduce"`` (K-FAC-reduce, Eschenhagen et al. 2023) first averages each sample's patches over its
positions, ``ā_n = 1/T Σ_t ā_{n,t}``, and sums its output gradients, ``g_n = Σ_t g_{n,t}``; then
``A = 1/N Σ_n ā_n ā_nᵀ`` and ``G = N Σ_n g_n g_nᵀ``. For Conv2d that is T times less work (no patch matrix,
no product over N·T rows); for Linear layers on (N, d) inputs both are the same. Its batch factors have rank
at most N, so it usually wants more damping than ``expand`` (LeNet/MNIST: ten times as much).

A stride-1 convolution gets its ``expand`` A without unfolding every patch: from the image correlated with
shifted copies of itself (:mod:`labkit.optim.kfac.correlation`, the same matrix).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from labkit.errors import CheckpointError
from labkit.optim.kfac.correlation import applies, conv_input_covariance, conv_padding
from labkit.optim.kfac.linalg import (
    damped_inverse,
    eigen_operands,
    factored_damping,
    precondition_eigen,
    precondition_inverse,
    symmetric_eigen,
)


def supports(module: nn.Module) -> bool:
    """Linear, and Conv2d with one group and zero padding: the layers whose weight gradient is ``g āᵀ``."""
    if isinstance(module, nn.Conv2d):
        odd = module.padding != "same" or all(d * (k - 1) % 2 == 0 for k, d in zip(module.kernel_size, module.dilation))
        return module.groups == 1 and module.padding_mode == "zeros" and odd and module.weight.requires_grad
    return isinstance(module, nn.Linear) and module.weight.requires_grad


def gram(columns: Tensor) -> Tensor:
    """``X Xᵀ`` of X (d, M) -> (d, d), symmetric: from d = 96 on, as two halves ``X₁, X₂`` of rows whose three
    blocks ``X₁X₁ᵀ, X₂X₁ᵀ, X₂X₂ᵀ`` are multiplied (the fourth is a transpose): 3/4 of the products."""
    d = columns.shape[0]
    if d < 96:
        return columns @ columns.t()
    h = d // 2
    top, bottom = columns[:h], columns[h:]
    out = columns.new_empty(d, d)
    out[:h, :h] = top @ top.t()
    out[h:, :h] = bottom @ top.t()
    out[:h, h:] = out[h:, :h].t()
    out[h:, h:] = bottom @ bottom.t()
    return out


def input_covariance(columns: Tensor, bias: bool) -> Tensor:
    """``1/M Σ ā āᵀ`` of M columns (d, M) -> (d + bias, d + bias), ``ā = [a; 1]``, without a row of ones."""
    d, m = columns.shape
    if not bias:
        return gram(columns).div_(m)
    cov = columns.new_empty(d + 1, d + 1)
    cov[:d, :d] = gram(columns)
    total = columns.sum(1)  # Σ a: the cross terms with the constant 1
    cov[:d, d] = total
    cov[d, :d] = total
    cov[d, d] = m
    return cov.div_(m)


def patch_view(x: Tensor, conv: nn.Conv2d) -> Tensor:
    """Every kernel patch of ``x`` as a strided view, no copy: (N, C, H, W) -> (N, C, H_out, W_out, kh, kw)."""
    (kh, kw), (sh, sw), (dh, dw) = conv.kernel_size, conv.stride, conv.dilation
    ph, pw = conv_padding(conv)
    x = F.pad(x, (pw, pw, ph, ph)) if ph or pw else x
    patches = x.unfold(2, dh * (kh - 1) + 1, sh).unfold(3, dw * (kw - 1) + 1, sw)  # (N, C, Ho, Wo, kh', kw')
    return patches[..., ::dh, ::dw] if dh > 1 or dw > 1 else patches


def conv_patches(x: Tensor, conv: nn.Conv2d) -> Tensor:
    """The kernel patches of ``x`` as columns: (N, C, H, W) -> (C·kh·kw, N·H_out·W_out).

    Row order (c, i, j) matches ``conv.weight.reshape(C_out, -1)``; column order (n, y, x). Same result as
    ``F.unfold`` followed by a transpose, but built from strided views with a single copy (2-10x faster).
    """
    patches = patch_view(x, conv)
    n, c, ho, wo, kh, kw = patches.shape
    return patches.permute(1, 4, 5, 0, 2, 3).reshape(c * kh * kw, n * ho * wo)


class LayerFactors:
    """One registered layer: captures ``ā`` and ``g``, keeps running A and G and its decomposition.

    Args:
        name: the module's qualified name in the model.
        module: an ``nn.Linear`` or ``nn.Conv2d`` (see :func:`supports`).
        dtype: dtype of the factors (float32 unless the weights are float64).
        approx: ``"expand"`` (Grosse & Martens) or ``"reduce"`` (see the module docstring).
    """

    def __init__(self, name: str, module: nn.Module, dtype: torch.dtype, approx: str = "expand"):
        self.name = name
        self.module = module
        self.dtype = dtype
        self.approx = approx
        self.bias = module.bias is not None and module.bias.requires_grad
        self.d_out = module.weight.shape[0]
        self.d_in = module.weight[0].numel() + int(self.bias)
        self.A: Tensor | None = None      # running averages, (d_in, d_in) and (d_out, d_out)
        self.G: Tensor | None = None
        self.decomposition: dict[str, Tensor] = {}  # eigen: qa, la, qg, lg; inverse: a_inv, g_inv
        self._a_batch: list[Tensor] = []  # this step's captures (several if the layer ran several times)
        self._g_batch: list[Tensor] = []

    # ----- capture (called from the module hooks on factor-update steps) -----------------------------

    def input_columns(self, x: Tensor) -> Tensor:
        """Layer input -> the ā without the 1, as columns: (d_in - bias, N·T), or (d_in - bias, N) for reduce."""
        conv = isinstance(self.module, nn.Conv2d)
        if self.approx == "reduce":
            if conv:
                return patch_view(x, self.module).mean((2, 3)).reshape(x.shape[0], -1).t()  # mean patch per sample
            return x.reshape(x.shape[0], -1, x.shape[-1]).mean(1).t()
        return conv_patches(x, self.module) if conv else x.reshape(-1, x.shape[-1]).t()

    def output_columns(self, grad: Tensor) -> Tensor:
        """Gradient w.r.t. the layer output -> the g as columns: (d_out, N·T), or (d_out, N) for reduce."""
        conv = isinstance(self.module, nn.Conv2d)
        if self.approx == "reduce":
            return (grad.sum((2, 3)) if conv else grad.reshape(grad.shape[0], -1, grad.shape[-1]).sum(1)).t()
        if conv:
            return grad.transpose(0, 1).reshape(grad.shape[1], -1)  # (N, C, H, W) -> (C, N·H·W)
        return grad.reshape(-1, grad.shape[-1]).t()

    def capture_input(self, x: Tensor) -> None:
        x = x.detach().to(self.dtype)
        if self.approx == "expand" and isinstance(self.module, nn.Conv2d) and applies(self.module):
            self._a_batch.append(conv_input_covariance(x, self.module, self.bias))  # no unfolded patches
        else:
            self._a_batch.append(input_covariance(self.input_columns(x), self.bias))

    def capture_output_grad(self, grad: Tensor) -> None:
        columns = self.output_columns(grad.detach().to(self.dtype))
        self._g_batch.append((columns @ columns.t()).mul_(grad.shape[0]))  # N Σ g gᵀ

    def has_batch(self) -> bool:
        return bool(self._a_batch) and bool(self._g_batch)

    def pop_batch(self) -> tuple[Tensor, Tensor]:
        """This step's (A_batch, G_batch), averaged over the layer's calls; clears the captures."""
        a = torch.stack(self._a_batch).mean(0) if len(self._a_batch) > 1 else self._a_batch[0]
        g = torch.stack(self._g_batch).mean(0) if len(self._g_batch) > 1 else self._g_batch[0]
        self._a_batch, self._g_batch = [], []
        return a, g

    def clear_batch(self) -> None:
        self._a_batch, self._g_batch = [], []

    def update_factors(self, a: Tensor, g: Tensor, decay: float) -> None:
        """Running averages ``A ← ε A + (1 - ε) A_batch`` (the first batch initialises them)."""
        if self.A is None:
            self.A, self.G = a.clone(), g.clone()
        else:
            self.A.mul_(decay).add_(a, alpha=1 - decay)
            self.G.mul_(decay).add_(g, alpha=1 - decay)

    # ----- the gradient as one matrix -------------------------------------------------------------------

    def has_grad(self) -> bool:
        return self.module.weight.grad is not None

    def grad_matrix(self, out: Tensor) -> Tensor:
        """∇W with the bias gradient as last column, written into ``out`` (d_out, d_in) of the factors' dtype."""
        grad = self.module.weight.grad.reshape(self.d_out, -1)
        if self.bias:
            return torch.cat([grad, self.module.bias.grad.reshape(-1, 1)], dim=1, out=out)
        return out.copy_(grad)

    def set_grad(self, matrix: Tensor) -> None:
        """Write a (d_out, d_in) matrix back into ``weight.grad`` (and ``bias.grad``) in place."""
        weight = self.module.weight
        columns = self.d_in - int(self.bias)
        weight.grad.copy_(matrix[:, :columns].reshape(weight.shape))
        if self.bias:
            self.module.bias.grad.copy_(matrix[:, columns])

    # ----- decomposition and preconditioning (formulas in labkit.optim.kfac.linalg) ------------------------------

    def decompose(self, method: str, damping: float) -> None:
        """Eigendecompositions ``Q_A, λ_A, Q_G, λ_G`` or damped inverses of the current A and G."""
        if method == "eigen":
            qa, la = symmetric_eigen(self.A)
            qg, lg = symmetric_eigen(self.G)
            self.decomposition = {"qa": qa, "la": la, "qg": qg, "lg": lg}
        else:
            shift_a, shift_g = factored_damping(self.A, self.G, damping)
            self.decomposition = {"a_inv": damped_inverse(self.A, shift_a), "g_inv": damped_inverse(self.G, shift_g)}

    def precondition(self, grad: Tensor, damping: float) -> Tensor:
        """The preconditioned gradient (d_out, d_in) from the current decomposition."""
        d = self.decomposition
        if "qa" in d:
            return precondition_eigen(grad, d["qa"], d["la"], d["qg"], d["lg"], damping)
        return precondition_inverse(grad, d["a_inv"], d["g_inv"])

    def operands(self, damping: float) -> tuple[Tensor, ...]:
        """The current decomposition as :func:`~labkit.optim.kfac.linalg.precondition_batched` takes it (eigen:
        ``(Q_G, Q_A, 1 / (λ_G λ_Aᵀ + γ))``, precomputed; inverse: ``(G_d⁻¹, A_d⁻¹)``)."""
        d = self.decomposition
        if "qa" in d:
            return eigen_operands(d["qa"], d["la"], d["qg"], d["lg"], damping)
        return d["g_inv"], d["a_inv"]

    def decomposition_shapes(self, method: str) -> dict[str, tuple[int, ...]]:
        """Shapes of the tensors a decomposition holds (so non-owning ranks can receive them)."""
        if method == "eigen":
            return {"qa": (self.d_in, self.d_in), "la": (self.d_in,), "qg": (self.d_out, self.d_out),
                    "lg": (self.d_out,)}
        return {"a_inv": (self.d_in, self.d_in), "g_inv": (self.d_out, self.d_out)}

    def numel(self) -> int:
        return self.d_out * self.d_in

    def decomposition_cost(self) -> float:
        """Relative cost of decomposing A and G (both O(d³)): the load-balancing weight."""
        return float(self.d_in) ** 3 + float(self.d_out) ** 3

    # ----- checkpoints ---------------------------------------------------------------------------------------

    def state(self) -> dict[str, Tensor]:
        """Running factors and the decomposition this rank holds."""
        return {"A": self.A, "G": self.G, **self.decomposition}

    def load_state(self, saved: dict[str, Tensor], method: str | None) -> bool:
        """Restore from :meth:`state`; returns whether the ``method`` decomposition was restored too."""
        if saved["A"].shape != (self.d_in, self.d_in) or saved["G"].shape != (self.d_out, self.d_out):
            raise CheckpointError(f"K-FAC factors of layer {self.name!r} have shapes {tuple(saved['A'].shape)}, "
                                  f"{tuple(saved['G'].shape)}; expected ({self.d_in}, {self.d_in}), "
                                  f"({self.d_out}, {self.d_out}): the checkpoint is from another model")
        device = self.module.weight.device
        self.A, self.G = saved["A"].to(device, self.dtype), saved["G"].to(device, self.dtype)
        keys = self.decomposition_shapes(method) if method else {}
        if not keys or any(k not in saved for k in keys):
            self.decomposition = {}
            return False
        self.decomposition = {k: saved[k].to(device, self.dtype) for k in keys}
        return True
