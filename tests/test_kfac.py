"""K-FAC == its dense math.

* the factors A and G equal their definitions, computed here with explicit loops over samples and
  (for Conv2d) kernel positions from activations/gradients captured by plain hooks;
* the preconditioned gradient equals a dense ``torch.linalg.solve`` with ``torch.kron`` — eigen: exactly
  ``(A ⊗ G + γI)⁻¹ vec(∇W)``; inverse: ``((A + π√γI) ⊗ (G + √γ/π I))⁻¹ vec(∇W)``, which is *not*
  ``(A ⊗ G + γI)⁻¹`` (checked too);
* the seed's Kronecker example and identities hold numerically;
* an independent oracle, curvlinops' empirical K-FAC (expand and reduce), gives the same factors (our
  conventions are chosen so the fitted scale is exactly 1);
* KL clipping, checkpoints, ``labkit train`` with the seed's flags, and clear errors for bad input.

Everything runs in float64 so agreement is checked to ~1e-10, far below any modelling difference.
"""
import io
import json
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from labkit.errors import CheckpointError, ConfigError, LabkitError
from labkit.optim.kfac.correlation import applies, by_pixels, conv_input_covariance
from labkit.optim.kfac.layers import conv_patches
from labkit.optim.kfac.linalg import precondition_eigen, symmetric_eigen, unvec, vec
from labkit.optim.kfac.preconditioner import KFAC, from_options

TOL = dict(rtol=1e-9, atol=1e-12)


def small_net() -> nn.Module:
    """Conv with bias, stride 2 and padding; conv without bias; linear: (N, 2, 8, 8) -> (N, 5)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 3, 3, stride=2, padding=1), nn.ReLU(), nn.Conv2d(3, 4, 3, bias=False),
                         nn.Tanh(), nn.Flatten(), nn.Linear(16, 5)).double()


def batch(seed: int, n: int = 6):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 2, 8, 8, generator=g, dtype=torch.float64), torch.randint(0, 5, (n,), generator=g)


class Recorder:
    """Plain hooks: each layer's input and the gradient of the mean loss w.r.t. its output."""

    def __init__(self, model: nn.Module):
        self.inputs, self.outputs = {}, {}
        self.layers = {name: m for name, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d))}
        for name, module in self.layers.items():
            module.register_forward_hook(self._hook(name))

    def _hook(self, name):
        def hook(module, inputs, output):
            self.inputs[name] = inputs[0].detach()
            output.retain_grad()
            self.outputs[name] = output
        return hook

    def factors(self, name: str, approx: str = "expand") -> tuple[torch.Tensor, torch.Tensor]:
        """A = 1/(N T) Σ_{n,t} ā āᵀ and G = 1/N Σ_{n,t} (N g)(N g)ᵀ, one sample and one position at a time.

        ``approx="reduce"``: one row per sample, the mean of its patches and the sum of its output gradients.
        """
        layer, a, g = self.layers[name], self.inputs[name], self.outputs[name].grad
        n = a.shape[0]
        rows_a, rows_g = [], []
        if isinstance(layer, nn.Conv2d):
            (k, _), (s, _), (p, _) = layer.kernel_size, layer.stride, layer.padding
            padded = F.pad(a, (p, p, p, p))
            for i in range(n):
                patches = [padded[i, :, y * s:y * s + k, x * s:x * s + k].reshape(-1)  # (C·k·k,)
                           for y in range(g.shape[2]) for x in range(g.shape[3])]
                grads = [g[i, :, y, x] for y in range(g.shape[2]) for x in range(g.shape[3])]
                if approx == "reduce":
                    patches, grads = [sum(patches) / len(patches)], [sum(grads)]
                rows_a += patches
                rows_g += grads
        else:
            rows_a, rows_g = list(a), list(g)
        if layer.bias is not None:
            rows_a = [torch.cat([r, r.new_ones(1)]) for r in rows_a]
        big_a = sum(torch.outer(r, r) for r in rows_a) / len(rows_a)
        big_g = sum(torch.outer(n * r, n * r) for r in rows_g) / n
        return big_a, big_g


def grad_matrix(layer: nn.Module) -> torch.Tensor:
    """∇W (d_out, d_in) with the bias gradient as last column, built independently of labkit."""
    grad = layer.weight.grad.reshape(layer.weight.shape[0], -1)
    return torch.cat([grad, layer.bias.grad[:, None]], 1) if layer.bias is not None else grad.clone()


def backward(model, seed):
    model.zero_grad()
    x, y = batch(seed)
    F.cross_entropy(model(x), y).backward()


@pytest.mark.parametrize("approx", ["expand", "reduce"])
def test_factors_equal_their_definitions_and_running_averages(approx):
    model = small_net()
    rec = Recorder(model)
    assert [l.name for l in KFAC(small_net(), skip_layers=["5"]).layers] == ["0", "2"]
    assert [l.name for l in KFAC(small_net(), skip_layers=["Conv2d"]).layers] == ["5"]
    kfac = KFAC(model, factor_decay=0.8, factor_update_freq=2, kl_clip=0, approx=approx)
    assert [layer.name for layer in kfac.layers] == ["0", "2", "5"]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    by_hand = []
    for step in range(3):
        backward(model, seed=step)
        by_hand.append({name: rec.factors(name, approx) for name in rec.layers})
        kfac.step()
        optimizer.step()
    for layer in kfac.layers:
        (a0, g0), (a2, g2) = by_hand[0][layer.name], by_hand[2][layer.name]
        # factors from steps 0 and 2 only (update interval 2), averaged with decay 0.8
        torch.testing.assert_close(layer.A, 0.8 * a0 + 0.2 * a2, **TOL)
        torch.testing.assert_close(layer.G, 0.8 * g0 + 0.2 * g2, **TOL)
        assert layer.A.shape == (layer.d_in, layer.d_in) and layer.G.shape == (layer.d_out, layer.d_out)


@pytest.mark.parametrize("conv", [dict(kernel_size=3, stride=2, padding=1), dict(kernel_size=(3, 2), dilation=(2, 1)),
                                  dict(kernel_size=3, padding="same"), dict(kernel_size=5, padding="valid")])
def test_conv_patches_match_unfold(conv):
    layer = nn.Conv2d(3, 4, **conv)
    x = torch.randn(2, 3, 9, 8)
    pad = layer.padding if isinstance(layer.padding, tuple) else {"same": 1, "valid": 0}[layer.padding]
    unfolded = F.unfold(x, layer.kernel_size, layer.dilation, pad, layer.stride)  # (N, K, T)
    assert torch.equal(conv_patches(x, layer), unfolded.transpose(0, 1).reshape(unfolded.shape[1], -1))


@pytest.mark.parametrize("channels", [3, 16])
@pytest.mark.parametrize("conv", [dict(kernel_size=3, padding=1), dict(kernel_size=5), dict(kernel_size=(3, 5), padding=(1, 2)),
                                  dict(kernel_size=1), dict(kernel_size=3, padding="same", bias=False),
                                  dict(kernel_size=5, padding=2), dict(kernel_size=(1, 3)), dict(kernel_size=2),
                                  dict(kernel_size=3, padding=2, bias=False), dict(kernel_size=4, padding=1)])
def test_the_shifted_image_correlation_is_the_gram_of_the_unfolded_patches(conv, channels):
    """The input factor of a stride-1 convolution from shifted copies of the image (pixels for 16 channels, rows
    for 3) equals 1/M Σ ā āᵀ over PyTorch's own unfolded patches (``F.unfold``) with a 1 appended for the bias,
    for every kernel shape and padding, including a 1x1 kernel (no frame) and padding wider than the kernel."""
    layer = nn.Conv2d(channels, 2, **conv).double()
    x = torch.randn(4, channels, 7, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    pad = layer.padding if isinstance(layer.padding, tuple) else (1, 1)
    patches = F.unfold(x, layer.kernel_size, padding=pad).transpose(1, 2)
    patches = patches.reshape(-1, channels * math.prod(layer.kernel_size))
    if layer.bias is not None:
        patches = torch.cat([patches, patches.new_ones(len(patches), 1)], 1)
    assert by_pixels(layer) == (channels == 16)
    torch.testing.assert_close(conv_input_covariance(x, layer, layer.bias is not None),
                               patches.T @ patches / len(patches), **TOL)


@pytest.mark.parametrize("channels, kernel, padding", [(16, 3, 1), (3, 5, 0)])
def test_the_correlation_keeps_every_tensor_on_the_inputs_device(channels, kernel, padding):
    """On the meta device any index or mask left on the CPU raises, as it would on a GPU."""
    conv = nn.Conv2d(channels, 4, kernel, padding=padding)
    cov = conv_input_covariance(torch.empty(2, channels, 7, 6, device="meta"), conv, True)
    assert cov.device.type == "meta" and cov.shape == (channels * kernel * kernel + 1,) * 2


def test_which_convolutions_are_correlated():
    assert applies(nn.Conv2d(3, 6, 5)) and not by_pixels(nn.Conv2d(3, 6, 5))  # LeNet's first: rows of 15
    assert applies(nn.Conv2d(6, 16, 5))                                      # LeNet's second: rows of 30
    assert applies(nn.Conv2d(3, 16, 3, padding=1))                           # ResNet's first: rows of 9
    assert applies(nn.Conv2d(2, 16, 3, padding=1))                           # rows of 6
    assert not applies(nn.Conv2d(1, 16, 3, padding=1))                       # rows of 3: unfolded
    assert applies(nn.Conv2d(16, 16, 3, padding=1)) and by_pixels(nn.Conv2d(16, 16, 3, padding=1))
    assert not applies(nn.Conv2d(16, 32, 3, stride=2, padding=1)) and not applies(nn.Conv2d(16, 16, 3, dilation=2))
    assert not applies(nn.Conv2d(16, 16, 3, padding=1, device="meta"))  # off the CPU: unfolded


def test_a_wide_convolution_takes_the_correlation_and_its_factors_agree_with_curvlinops(monkeypatch):
    import curvlinops

    from labkit.optim.kfac import layers as kfac_layers

    calls = []
    monkeypatch.setattr(kfac_layers, "conv_input_covariance",
                        lambda *args: calls.append(args[1]) or conv_input_covariance(*args))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(16, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 5 * 5, 3)).double()
    rec = Recorder(model)
    kfac = KFAC(model, factor_decay=0.0, kl_clip=0)
    x = torch.randn(6, 16, 5, 5, dtype=torch.float64)
    y = torch.randint(0, 3, (6,))
    F.cross_entropy(model(x), y).backward()
    kfac.step()
    assert calls == [model[0]]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        oracle = curvlinops.KFACLinearOperator(model, nn.CrossEntropyLoss(), list(model.parameters()), [(x, y)],
                                               fisher_type="empirical", kfac_approx="expand",
                                               separate_weight_and_bias=False, check_deterministic=False)
        oracle.compute_kronecker_factors()
    conv = kfac.layers[0]
    torch.testing.assert_close(conv.A, oracle.state_dict()["input_covariances"]["0"], **TOL)
    torch.testing.assert_close(conv.A, rec.factors("0")[0], **TOL)


@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_the_preconditioned_gradients_do_not_depend_on_how_the_factor_is_computed(monkeypatch, method):
    """Three K-FAC steps on a net of a narrow 5x5 and a wide 3x3 convolution: the factors and the preconditioned
    gradients from correlating rows (3 channels) and pixels (16) equal those from the unfolded patches, step by
    step."""
    from labkit.optim.kfac import layers as kfac_layers

    def run() -> list[list[torch.Tensor]]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 16, 5, padding=2), nn.ReLU(), nn.Conv2d(16, 8, 3, padding=1, bias=False),
                              nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 5)).double()
        kfac = KFAC(model, factor_update_freq=1, kl_clip=0, method=method)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        seen = []
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(8, 3, 6, 6, generator=g, dtype=torch.float64), torch.randint(0, 5, (8,), generator=g)
            model.zero_grad()
            F.cross_entropy(model(x), y).backward()
            kfac.step()
            seen.append([layer.A.clone() for layer in kfac.layers] + [grad_matrix(l.module) for l in kfac.layers])
            optimizer.step()
        return seen

    narrow, wide = nn.Conv2d(3, 16, 5, padding=2), nn.Conv2d(16, 8, 3, padding=1)
    assert applies(narrow) and applies(wide) and [by_pixels(narrow), by_pixels(wide)] == [False, True]
    shifted = run()
    monkeypatch.setattr(kfac_layers, "applies", lambda conv: False)  # every convolution unfolds its patches
    unfolded = run()
    for step_shifted, step_unfolded in zip(shifted, unfolded):
        for a, b in zip(step_shifted, step_unfolded):
            torch.testing.assert_close(a, b, **TOL)


def dense_solve(matrix: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    return unvec(torch.linalg.solve(matrix, vec(grad)), grad.shape[0])


def damped_kron(a, g, damping):
    """A ⊗ G + γI, the matrix the eigen method inverts exactly."""
    return torch.kron(a, g) + damping * torch.eye(a.shape[0] * g.shape[0], dtype=a.dtype)


def factored_kron(a, g, damping):
    """(A + π√γ I) ⊗ (G + √γ/π I), π² = (tr A / d_A) / (tr G / d_G): what the inverse method inverts."""
    pi = math.sqrt((a.trace().item() / a.shape[0]) / (g.trace().item() / g.shape[0]))
    eye_a, eye_g = torch.eye(a.shape[0], dtype=a.dtype), torch.eye(g.shape[0], dtype=g.dtype)
    return torch.kron(a + pi * math.sqrt(damping) * eye_a, g + math.sqrt(damping) / pi * eye_g)


@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_preconditioned_gradient_is_the_dense_kronecker_solve(method):
    damping = 0.01
    model = small_net()
    kfac = KFAC(model, damping=damping, factor_update_freq=1, inv_update_freq=3, kl_clip=0, method=method)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    reference = damped_kron if method == "eigen" else factored_kron
    for step in range(3):
        backward(model, seed=step)
        grads = [grad_matrix(layer.module) for layer in kfac.layers]
        kfac.step()
        if step == 0:  # decomposed at step 0 only: steps 1 and 2 precondition with the step-0 factors
            inverted = [reference(layer.A.clone(), layer.G.clone(), damping) for layer in kfac.layers]
        for layer, grad, matrix in zip(kfac.layers, grads, inverted):
            torch.testing.assert_close(grad_matrix(layer.module), dense_solve(matrix, grad), **TOL)
        optimizer.step()
    if method == "inverse":  # the factored damping is not (A ⊗ G + γI)⁻¹: the cross term √γ(πI⊗G + A⊗I/π)
        layer = kfac.layers[-1]
        plain = dense_solve(damped_kron(layer.A, layer.G, damping), grads[-1])
        assert (plain - grad_matrix(layer.module)).abs().max() > 1e-3 * plain.abs().max()


@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_layers_of_one_shape_are_one_product_into_buffers_kept_between_steps(method):
    """Two layers of one (d_out, d_in), one of them with a bias column, one without: preconditioned together (one
    batched product whose operand and result are views of the step's buffers), each still its own dense solve;
    the buffers are the same memory at every step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 8), nn.Tanh(), nn.Linear(8, 8, bias=False), nn.Tanh(), nn.Linear(8, 5)).double()
    kfac = KFAC(model, damping=0.01, factor_update_freq=1, kl_clip=0, method=method)
    reference = damped_kron if method == "eigen" else factored_kron
    addresses = []
    for step in range(3):
        model.zero_grad()
        x, y = torch.randn(6, 7, dtype=torch.float64), torch.randint(0, 5, (6,))
        F.cross_entropy(model(x), y).backward()
        grads = [grad_matrix(layer.module) for layer in kfac.layers]
        kfac.step()
        for layer, grad in zip(kfac.layers, grads):
            torch.testing.assert_close(grad_matrix(layer.module),
                                       dense_solve(reference(layer.A, layer.G, 0.01), grad), **TOL)
        buffers = kfac._step_buffers[1]
        assert [len(index) for _, index, _, _ in buffers.blocks] == [2, 1]  # the (8, 8) pair, then (5, 9)
        addresses.append([p.data_ptr() for p in buffers.precond + buffers.grads])
    assert addresses[0] == addresses[1] == addresses[2]
    kfac.close()


def test_seed_kronecker_example():
    a = torch.tensor([[1, 2], [3, 4]])
    b = torch.tensor([[5, 6], [7, 8], [9, 0]])
    assert torch.equal(torch.kron(a, b), torch.tensor([[5, 6, 10, 12], [7, 8, 14, 16], [9, 0, 18, 0],
                                                       [15, 18, 20, 24], [21, 24, 28, 32], [27, 0, 36, 0]]))


def test_kronecker_identities():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(3, 3, generator=g, dtype=torch.float64), torch.randn(4, 4, generator=g, dtype=torch.float64)
    a, b = a @ a.T + torch.eye(3), b @ b.T + torch.eye(4)  # symmetric positive definite, like A and G
    torch.testing.assert_close(torch.linalg.inv(torch.kron(a, b)),
                               torch.kron(torch.linalg.inv(a), torch.linalg.inv(b)), **TOL)
    assert torch.equal(vec(torch.tensor([[1, 2], [3, 4]])), torch.tensor([1, 3, 2, 4]))  # columns stacked
    # vec identity (A ⊗ B) vec(C) = vec(B C Aᵀ), rectangular and non-symmetric
    p, q = torch.randn(2, 3, generator=g, dtype=torch.float64), torch.randn(5, 4, generator=g, dtype=torch.float64)
    c = torch.randn(4, 3, generator=g, dtype=torch.float64)
    torch.testing.assert_close(torch.kron(p, q) @ vec(c), vec(q @ c @ p.T), **TOL)
    torch.testing.assert_close(unvec(vec(c), 4), c, rtol=0, atol=0)
    # the eigenbasis form the eigen method codes: (A⊗B + γI)⁻¹ vec(C) = vec(Q_B [(Q_Bᵀ C Q_A) / (λ_B λ_Aᵀ + γ)] Q_Aᵀ)
    c = torch.randn(4, 3, generator=g, dtype=torch.float64)
    (qa, la), (qb, lb) = symmetric_eigen(a), symmetric_eigen(b)
    torch.testing.assert_close(precondition_eigen(c, qa, la, qb, lb, 0.1), dense_solve(damped_kron(a, b, 0.1), c),
                               **TOL)


def test_eigh_failure_in_float32_falls_back_to_float64(monkeypatch):
    # float32 LAPACK fails to converge on some rank-deficient factors (seen with dead ReLU units in LeNet)
    real_eigh = torch.linalg.eigh
    calls = []

    def eigh(m):
        calls.append(m.dtype)
        if m.dtype == torch.float32:
            raise torch.linalg.LinAlgError("linalg.eigh: The algorithm failed to converge")
        return real_eigh(m)

    x = torch.randn(5, 8)
    factor = x.T @ x  # rank 5 of 8
    monkeypatch.setattr(torch.linalg, "eigh", eigh)
    q, lam = symmetric_eigen(factor)
    assert calls == [torch.float32, torch.float64] and q.dtype == torch.float32
    torch.testing.assert_close(q @ torch.diag(lam) @ q.T, factor, rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(torch.linalg, "eigh", lambda m: eigh(m.float()))  # now float64 fails as well
    with pytest.raises(torch.linalg.LinAlgError):
        symmetric_eigen(factor.double())  # a float64 failure is not hidden


@pytest.mark.parametrize("approx", ["expand", "reduce"])
def test_factors_agree_with_curvlinops(approx):
    import curvlinops  # a test dependency: the only oracle independent of labkit's own math
    model = small_net()
    kfac = KFAC(model, factor_decay=0.0, kl_clip=0, approx=approx)
    x, y = batch(seed=3, n=7)
    F.cross_entropy(model(x), y).backward()
    kfac.step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        oracle = curvlinops.KFACLinearOperator(model, nn.CrossEntropyLoss(), list(model.parameters()), [(x, y)],
                                               fisher_type="empirical", kfac_approx=approx,
                                               separate_weight_and_bias=False, check_deterministic=False)
        oracle.compute_kronecker_factors()
    state = oracle.state_dict()
    for layer in kfac.layers:
        for ours, theirs in ((layer.A, state["input_covariances"][layer.name]),
                             (layer.G, state["gradient_covariances"][layer.name])):
            scale = (ours * theirs).sum() / (theirs * theirs).sum()  # fitted scalar: the convention difference
            torch.testing.assert_close(scale, torch.tensor(1.0, dtype=scale.dtype), rtol=1e-10, atol=0)
            torch.testing.assert_close(ours, theirs, **TOL)


def _preconditioned(kl_clip, lr=None, optimizer_lr=None):
    model = small_net()
    optimizer = torch.optim.SGD(model.parameters(), lr=optimizer_lr) if optimizer_lr else None
    kfac = KFAC(model, kl_clip=kl_clip, optimizer=optimizer)
    backward(model, seed=0)
    grads = [grad_matrix(layer.module) for layer in kfac.layers]
    kfac.step(lr=lr)
    return model, kfac, grads, [grad_matrix(layer.module) for layer in kfac.layers]


def test_kl_clipping_scales_the_whole_step():
    lr = 0.5
    _, _, grads, plain = _preconditioned(kl_clip=0)
    vg = sum((p * g).sum() for p, g in zip(plain, grads)).item()
    assert vg > 0
    for nu in (0.5, 1.0):  # κ = ν² α² Σ⟨P, ∇W⟩ gives exactly ν (and ν = min(1, ...) when κ is larger)
        kappa = nu ** 2 * lr ** 2 * vg * (1.0 if nu < 1 else 4.0)
        for kwargs in (dict(lr=lr), dict(optimizer_lr=lr)):
            _, _, _, clipped = _preconditioned(kappa, **kwargs)
            for p, c in zip(plain, clipped):
                torch.testing.assert_close(c, nu * p, **TOL)
    # no optimizer given: the first optimizer stepping the model is attached and applies that step's clip
    model, kfac, _, unclipped = _preconditioned(0.25 * lr ** 2 * vg)
    for p, c in zip(plain, unclipped):
        torch.testing.assert_close(c, p, **TOL)
    before = [layer.module.weight.detach().clone() for layer in kfac.layers]
    torch.optim.SGD(model.parameters(), lr=lr).step()
    for layer, w0, p in zip(kfac.layers, before, plain):
        step = (w0 - layer.module.weight.detach()).reshape(layer.d_out, -1)
        torch.testing.assert_close(step, lr * 0.5 * p[:, :step.shape[1]], **TOL)


@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_checkpoint_resumes_identically(method):
    def run(model, kfac, steps):
        out = []
        for step in steps:
            backward(model, seed=step)
            kfac.step(lr=0.1)
            out.append([grad_matrix(layer.module) for layer in kfac.layers])
        return out

    model = small_net()
    kfac = KFAC(model, factor_update_freq=1, inv_update_freq=10, method=method)
    run(model, kfac, [0, 1])
    buffer = io.BytesIO()
    torch.save(kfac.state_dict(), buffer)
    continued = run(model, kfac, [2, 3])
    buffer.seek(0)
    fresh_model = small_net()  # same weights: run() never steps an optimizer
    fresh = KFAC(fresh_model, factor_update_freq=1, inv_update_freq=10, method=method)
    fresh.load_state_dict(torch.load(buffer, weights_only=True))
    assert fresh.steps == 2 and not fresh._stale  # the step-0 decompositions came back too
    resumed = run(fresh_model, fresh, [2, 3])
    for a, b in zip(continued, resumed):
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, rtol=0, atol=0)
    other = KFAC(nn.Sequential(nn.Linear(3, 2)).double())
    with pytest.raises(CheckpointError, match="layers .* that this model lacks"):
        other.load_state_dict(kfac.state_dict())


def test_bad_input_is_a_clear_error():
    with pytest.raises(ConfigError, match=r"no Linear or Conv2d layer .*Sequential.*BatchNorm1d, ReLU.*optimizer sgd"):
        KFAC(nn.Sequential(nn.ReLU(), nn.BatchNorm1d(3)))
    with pytest.raises(ConfigError, match=r"damping must be > 0, got -0.1 \(--kfac-damping\)"):
        KFAC(small_net(), damping=-0.1)
    with pytest.raises(ConfigError, match=r"--kfac-update-freq must be an integer >= 0 \(0 = plain SGD\), got -1"):
        from_options(small_net(), {"kfac_update_freq": -1})
    with pytest.raises(ConfigError, match=r"--kfac-inv-update-freq must be an integer >= 1 here, got 0"):
        KFAC(small_net(), inv_update_freq=0)
    with pytest.raises(ConfigError, match=r"factor decay must be in \[0, 1\), got 1.0"):
        KFAC(small_net(), factor_decay=1.0)
    with pytest.raises(ConfigError, match=r"--kfac-method 'cholesky' is not one of: eigen, inverse"):
        KFAC(small_net(), method="cholesky")
    with pytest.raises(LabkitError, match="no captured activations: call kfac.step.. once after each loss.backward"):
        KFAC(small_net()).step()
    assert from_options(small_net(), {"kfac_update_freq": 0}) is None


def test_labkit_train_with_the_seed_flags(tmp_path, capsys):
    from labkit.cli import main

    seed_flags = ["--optimizer", "kfac", "--base-lr", "0.1", "--batch-size", "128", "--kfac-update-freq", "10",
                  "--lr-decay", "35", "75", "90"]
    args = ["train", "--model", "resnet20", "--dataset", "synthetic-cifar10", *seed_flags, "--epochs", "1",
            "--max-steps", "1", "--test-size", "16", "--device", "cpu", "--out", str(tmp_path / "run")]
    assert main(args) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["config"]["optim_options"]["kfac_update_freq"] == 10
    assert "K-FAC: 20 layers, eigen" in capsys.readouterr().out  # 19 convolutions + the classifier
    state = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)["preconditioner"]
    assert state["steps"] == 1 and len(state["layers"]) == 20  # one step: factors and decompositions made at step 0
    bad = ["train", "--dataset", "synthetic-mnist", "--optimizer", "kfac", "--kfac-damping", "-1", "--max-steps", "1",
           "--out", str(tmp_path / "bad")]
    with pytest.raises(SystemExit) as stop:  # refused as the flag is read
        main(bad)
    assert stop.value.code == 2 and "labkit: error: --kfac-damping must be > 0, got -1" in capsys.readouterr().err


def test_bench_kfac_writes_timings(tmp_path, capsys):
    from labkit.cli import main
    from labkit.results import load_run

    out = tmp_path / "bench"
    assert main(["bench", "kfac", "--models", "lenet", "--batch-size", "8", "--steps", "2", "--rounds", "1",
                 "--freqs", "1", "2", "--methods", "inverse", "--out", str(out)]) == 0
    run = load_run(out)
    rows = {r["contender"]: r for r in run.records_of("bench")}
    assert list(rows) == ["sgd", "inverse/1", "inverse/2"] and rows["sgd"]["ratio"] == 1.0
    assert rows["sgd"]["cpu_ratio_median"] == 1.0  # each round paired with SGD's own
    assert all(r["cpu_ratio_min"] <= r["cpu_ratio_median"] <= r["cpu_ratio_max"] for r in rows.values())
    for name in ("inverse/1", "inverse/2"):
        assert rows[name]["steps"] == 2 and min(rows[name][f"{p}_ms"] for p in ("factors", "decomposition",
                                                                                 "precondition")) > 0
    assert set(run.summary["metrics"]) == {"lenet/sgd", "lenet/inverse/1", "lenet/inverse/2"}
    # the floor's products, counted: (6, 76), (16, 151), (120, 401), (84, 121), (10, 85), d_out²·d_in + d_out·d_in²
    assert rows["inverse/1"]["precondition_madds"] == rows["inverse/2"]["precondition_madds"] == 27_675_754
    for name, freq in (("inverse/1", 1), ("inverse/2", 2)):
        row = rows[name]
        assert row["floor_ms"] == pytest.approx(row["products_at_peak_ms"] + row["decomposition_step_ms"] / freq)
        assert row["floor_ratio"] == pytest.approx(1 + row["floor_ms"] / rows["sgd"]["cpu_ms"])
    printed = capsys.readouterr().out
    assert "x SGD" in printed and "27.7 M multiply-adds" in printed
    assert main(["bench", "kfac", "--steps", "3", "--freqs", "2", "--out", str(out)]) == 2
    assert "--steps 3 must be a multiple of every --freqs value" in capsys.readouterr().err


def test_symmetric_eigen_redoes_a_silent_float32_failure_in_float64(monkeypatch):
    """float32 LAPACK can return NaNs for a finite rank-deficient factor without raising (seen on LeNet's fc1
    A with dead units); the decomposition must then come from float64, not spread NaNs into the gradients."""
    from labkit.optim.kfac import linalg as kfac_math

    factor = torch.tensor([[2.0, 1.0, 0.0], [1.0, 2.0, 0.0], [0.0, 0.0, 0.0]])
    real_eigh = torch.linalg.eigh

    def float32_fails(matrix):
        values, vectors = real_eigh(matrix)
        if matrix.dtype == torch.float32:
            return values * float("nan"), vectors * float("nan")
        return values, vectors

    monkeypatch.setattr(torch.linalg, "eigh", float32_fails)
    q, lam = kfac_math.symmetric_eigen(factor)
    assert q.dtype == lam.dtype == torch.float32
    assert torch.allclose(lam, torch.tensor([0.0, 1.0, 3.0]), atol=1e-6)
    assert torch.allclose(q @ torch.diag(lam) @ q.T, factor, atol=1e-6)
