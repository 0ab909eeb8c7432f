"""K-FAC's KL clip on a model whose layers sit on different devices (model-parallel, gpipe): each layer's term of
Σ⟨P, ∇W⟩ is moved to the first layer's device before the sum, and ν is moved to each layer's gradient before the
scaling. Without a second GPU, ``meta`` stands in for the other device, and a recording ν shows where it went."""
import torch
import torch.nn.functional as F
from torch import nn

from labkit.optim.kfac import KFAC
from labkit.optim.kfac_clip import inner_product


def test_the_inner_product_is_summed_on_the_first_layers_device():
    precond = [torch.full((2, 3), 2.0), torch.full((4,), 1.0)]
    grads = [torch.full((2, 3), 0.5), torch.full((4,), 3.0)]
    assert inner_product(precond, grads, torch.device("cpu")).item() == 18.0  # 6·1 + 4·3
    assert inner_product(precond, grads, torch.device("meta")).device == torch.device("meta")


class _Nu:
    """ν that records where each layer asks for it."""

    def __init__(self):
        self.asked = []

    def to(self, device, dtype):
        self.asked.append((torch.device(device), dtype))
        return torch.tensor(0.5, dtype=dtype)


def test_nu_scales_every_gradient_on_that_gradients_device():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2, bias=False))
    kfac = KFAC(model, factor_update_freq=1)
    F.cross_entropy(model(torch.randn(8, 4)), torch.randint(0, 2, (8,))).backward()
    before = [p.grad.clone() for p in model.parameters()]
    nu = _Nu()
    kfac._scale_grads(nu)
    grads = [p.grad for p in model.parameters()]
    assert nu.asked == [(g.device, g.dtype) for g in grads] and len(nu.asked) == 3  # weight, bias, weight
    for b, g in zip(before, grads):
        torch.testing.assert_close(g, 0.5 * b)
    kfac.close()
