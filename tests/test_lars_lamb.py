"""LARS and LAMB: one step equals the paper formulas worked out by hand on a two-layer net (literal numbers),
the trust ratio per layer, biases excluded by default, agreement with torch's SGD / AdamW when the ratio is
off, and K-FAC feeding LAMB through ``labkit train`` (runs, resumes bit-identically)."""
import pytest
import torch
from torch import nn

from labkit.errors import ConfigError
from labkit.optim import build_optimizer
from labkit.optim.lamb import LAMB
from labkit.optim.lars import LARS, param_groups
from labkit.train.checkpoint import load_checkpoint


def two_layer(w1, b1, w2, b2, g1, gb1, g2, gb2) -> nn.Module:
    """Linear(2, 2) -> Linear(2, 1) in float64 with the given weights and gradients."""
    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1)).double()
    for p, value, grad in zip(net.parameters(), (w1, b1, w2, b2), (g1, gb1, g2, gb2)):
        with torch.no_grad():
            p.copy_(torch.tensor(value, dtype=torch.float64))
        p.grad = torch.tensor(grad, dtype=torch.float64)
    return net


def lars_net() -> nn.Module:
    return two_layer([[3.0, 0.0], [0.0, 4.0]], [1.0, -1.0], [[0.0, 2.0]], [0.0],
                     [[0.0, 0.6], [0.8, 0.0]], [0.5, 0.5], [[0.3, 0.4]], [0.2])


def test_lars_one_step_by_hand():
    # η = 0.1, β = 0.5, γ = 0.7.  W1: ‖w‖ = 5, ‖∇w‖ = 1 -> λ = 0.1·5 / (1 + 0.5·5) = 1/7,
    #   g = ∇w + 0.5 w = [[1.5, 0.6], [0.8, 2]], v = 0.7/7 · g = 0.1 g, w - v = [[2.85, -0.06], [-0.08, 3.8]]
    # W2: ‖w‖ = 2, ‖∇w‖ = 0.5 -> λ = 0.2 / 1.5 = 2/15, g = [0.3, 1.4], v = 0.7·2/15 · g = [0.028, 0.130666…]
    # biases excluded: λ = 1, no decay: b1 - 0.7·0.5, b2 - 0.7·0.2
    net = lars_net()
    opt = LARS(param_groups(net, weight_decay=0.5), lr=0.7, momentum=0.9, trust_coefficient=0.1)
    opt.step()
    w1, b1, w2, b2 = net.parameters()
    torch.testing.assert_close(w1, torch.tensor([[2.85, -0.06], [-0.08, 3.8]], dtype=torch.float64))
    torch.testing.assert_close(b1, torch.tensor([0.65, -1.35], dtype=torch.float64))
    torch.testing.assert_close(w2, torch.tensor([[-0.028, 2 - 0.196 / 1.5]], dtype=torch.float64))
    torch.testing.assert_close(b2, torch.tensor([-0.14], dtype=torch.float64))
    ratios = [opt.last_ratios[id(p)].item() for p in (w1, b1, w2, b2)]
    assert ratios == pytest.approx([1 / 7, 1.0, 2 / 15, 1.0])
    # second step, same bias gradient: v = 0.9·0.35 + 0.35 = 0.665 (momentum), b1[0] = 0.65 - 0.665
    opt.step()
    assert b1[0].item() == pytest.approx(-0.015)


def test_lars_trust_all_params_puts_the_ratio_on_biases_too():
    net = lars_net()
    opt, pre = build_optimizer("lars", net, 0.7, 0.9, 0.5, {"lars_trust_coefficient": 0.1, "trust_all_params": True})
    assert pre is None and len(opt.param_groups) == 1
    opt.step()
    _, b1, _, _ = net.parameters()
    # ‖b1‖ = √2, ‖∇b1‖ = √0.5 -> λ = 0.1·√2 / (√0.5 + 0.5·√2) = 0.1; g = ∇b + 0.5 b = [1, 0]
    assert opt.last_ratios[id(b1)].item() == pytest.approx(0.1)
    torch.testing.assert_close(b1, torch.tensor([1 - 0.07, -1.0], dtype=torch.float64))


def test_lamb_one_step_by_hand():
    # t = 1: m̂ = g, v̂ = g², r = g / (|g| + ε) = sign(g) (ε = 1e-12), λ = 0.1875, γ = 0.1.
    # W1 = diag(0, 4), ∇ = e11: u = [[1, 0], [0, 0.75]], ‖u‖ = 1.25, φ = 4 / 1.25 = 3.2 -> w - 0.32 u
    # W2 = [0, 2], ∇ = [0, -3]: u = [0, -0.625], φ = 2 / 0.625 = 3.2 -> [0, 2 + 0.2]
    # biases excluded: φ = 1, no decay: b1 - 0.1 sign(∇b1); b2 has no gradient signal (0) and stays
    net = two_layer([[0.0, 0.0], [0.0, 4.0]], [1.0, -1.0], [[0.0, 2.0]], [0.0],
                    [[1.0, 0.0], [0.0, 0.0]], [0.5, -0.5], [[0.0, -3.0]], [0.0])
    opt = LAMB(param_groups(net, weight_decay=0.1875), lr=0.1, eps=1e-12)
    opt.step()
    w1, b1, w2, b2 = net.parameters()
    torch.testing.assert_close(w1, torch.tensor([[-0.32, 0.0], [0.0, 3.76]], dtype=torch.float64))
    torch.testing.assert_close(b1, torch.tensor([0.9, -0.9], dtype=torch.float64))
    torch.testing.assert_close(w2, torch.tensor([[0.0, 2.2]], dtype=torch.float64))
    torch.testing.assert_close(b2, torch.tensor([0.0], dtype=torch.float64))
    ratios = [opt.last_ratios[id(p)].item() for p in (w1, b1, w2, b2)]
    assert ratios == pytest.approx([3.2, 1.0, 3.2, 1.0])


def test_without_the_ratio_they_are_torch_sgd_and_adamw():
    """Trust ratio off: LARS is SGD with momentum and L2 decay, LAMB is AdamW (constant rate, 3 steps)."""
    torch.manual_seed(0)
    for ours, theirs in ((lambda p: LARS(p, lr=0.1, momentum=0.9, weight_decay=0.01, trust_ratio=False),
                          lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01)),
                         (lambda p: LAMB(p, lr=0.01, weight_decay=0.01, eps=1e-8, trust_ratio=False),
                          lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.01, eps=1e-8))):
        a = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).double()
        b = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).double()
        b.load_state_dict(a.state_dict())
        opt_a, opt_b = ours(a.parameters()), theirs(b.parameters())
        for step in range(3):
            x = torch.randn(8, 5, dtype=torch.float64)
            for net, opt in ((a, opt_a), (b, opt_b)):
                opt.zero_grad()
                net(x).square().mean().backward()
                opt.step()
        for p, q in zip(a.parameters(), b.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-12)


def test_bad_values_are_config_errors():
    net = lars_net()
    with pytest.raises(ConfigError, match="trust coefficient must be > 0"):
        build_optimizer("lars", net, 0.1, options={"lars_trust_coefficient": 0})
    with pytest.raises(ConfigError, match="betas must be in"):
        build_optimizer("lamb", net, 0.1, options={"lamb_betas": [0.9, 1.5]})
    with pytest.raises(ConfigError, match="unknown --kfac-base 'rmsprop'"):
        build_optimizer("kfac", net, 0.1, options={"kfac_base": "rmsprop"})


def test_kfac_feeds_lamb_and_resumes_bit_identically(tmp_path, capsys):
    from labkit.cli import main

    # LeNet: K-FAC's largest factor is 257 × 257 (the MLP's 785 × 785 eigendecompositions took most of the time)
    flags = ["train", "--model", "lenet", "--dataset", "synthetic-mnist", "--train-size", "64", "--test-size", "64",
             "--batch-size", "32", "--device", "cpu", "--optimizer", "kfac", "--kfac-base", "lamb",
             "--kfac-update-freq", "3", "--base-lr", "0.01", "--weight-decay", "0.01", "--log-every", "100"]
    assert main([*flags, "--epochs", "2", "--out", str(tmp_path / "straight")]) == 0
    assert main([*flags, "--epochs", "1", "--out", str(tmp_path / "resumed")]) == 0
    assert main([*flags, "--epochs", "2", "--out", str(tmp_path / "resumed"), "--resume"]) == 0
    assert "K-FAC: 5 layers" in capsys.readouterr().out
    a = load_checkpoint(tmp_path / "straight" / "checkpoint.pt")
    b = load_checkpoint(tmp_path / "resumed" / "checkpoint.pt")
    assert a["epoch"] == b["epoch"] == 2
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    state = a["optimizer"]["state"][0]
    assert set(state) == {"step", "exp_avg", "exp_avg_sq"} and state["step"].item() == 4  # LAMB's: 2 steps × 2 epochs
    assert [g["trust_ratio"] for g in a["optimizer"]["param_groups"]] == [True, False]
    assert a["preconditioner"]["steps"] == 4  # factors at steps 0 and 3: one per epoch
    assert a["config"]["optim_options"]["kfac_base"] == "lamb"


def test_bench_largebatch_trains_and_scales_each_recipe(tmp_path, capsys):
    from labkit.bench import largebatch
    from labkit.cli import main
    from labkit.results import load_run

    args = ["bench", "largebatch", "--dataset", "synthetic-mnist", "--optimizers", "sgd", "lamb", "--scales", "1", "4",
            "--epochs", "1",
            "--batch-size", "8", "--train-size", "64", "--test-size", "32", "--device", "cpu",
            "--out", str(tmp_path / "lb")]
    assert main(args) == 0
    rows = load_run(tmp_path / "lb").records_of("bench")
    assert [(r["optimizer"], r["scale"], r["global_batch"]) for r in rows] == \
        [("sgd", 1, 8), ("lamb", 1, 8), ("sgd", 4, 32), ("lamb", 4, 32)]
    assert [r["lr"] for r in rows] == pytest.approx([0.01, 0.003, 0.04, 0.006])  # SGD × k, LAMB × √k
    assert "x4 (32)" in capsys.readouterr().out
    # LARS 4·k^¼ (the trust ratio does most of the scaling); K-FAC updates every 16 / k steps, at least every step
    assert [largebatch.learning_rate("lars", k) for k in (1, 16, 81)] == pytest.approx([4.0, 8.0, 12.0])
    assert [largebatch.optim_options("kfac", k)["kfac_update_freq"] for k in (1, 4, 64)] == [16, 4, 1]
