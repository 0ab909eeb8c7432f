"""K-FAC's KL clip on a model whose layers sit on different devices (model-parallel, gpipe): each layer's term of
Σ⟨P, ∇W⟩ is moved to the first layer's device before the sum, and ν is moved to each layer's gradient before the
scaling. Without a second GPU, ``meta`` stands in for the other device, and a recording ν shows where it went."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from labkit.optim.kfac.clip import inner_product
from labkit.optim.kfac.preconditioner import KFAC


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


@pytest.mark.parametrize("how", ["gpipe time", "gpipe memory", "model-parallel time"])
def test_balancing_profiles_a_copy_that_kfac_does_not_see(how):
    """The profiler runs as many passes as fit in its time, on the first device: K-FAC must capture none."""
    from labkit.models.cnn import get_model
    from labkit.strategies.balance import compute_balance
    from labkit.strategies.stage_balance import balance_by_time

    model = get_model("mlp", sequential=True)
    kfac = KFAC(model, factor_update_freq=1)
    x = torch.randn(8, 1, 28, 28)
    if how == "model-parallel time":
        balance = balance_by_time(model, x, 2, timeout_s=0.05)
    else:
        balance = compute_balance(how.split()[1], 2, model, x, 2, torch.device("cpu"), profile_seconds=0.05)
    assert len(balance) == 2 and sum(balance) == 6
    assert [(len(l._a_batch), len(l._g_batch)) for l in kfac.layers] == [(0, 0)] * 3
    kfac.close()
