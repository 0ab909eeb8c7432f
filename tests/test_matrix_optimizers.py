"""Shampoo, SOAP and Muon: each against an independent reference, their state counted, and ``labkit train`` with them.

* Shampoo: three steps against a dense float64 implementation written here from the formulas, whose preconditioner
  is ``((R + εI) ⊗ (L + εI))^{-1/4} vec(G)`` from one eigendecomposition of the Kronecker product; one step by hand.
* SOAP: its first step is the polar factor ``U Vᵀ`` of the gradient (SVD); with identity bases it is torch's AdamW.
* Newton–Schulz: the convergent coefficients give ``U Vᵀ`` of an SVD; Muon's give ``U S' Vᵀ`` with S' in
  [0.6, 1.3]; in bfloat16 it matches the step of ``torch.optim.Muon``.
* Optimizer-state bytes: literal numbers worked out in the comments.
"""
import copy
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from labkit.cli import main as cli_main
from labkit.errors import ConfigError
from labkit.optim import build_optimizer
from labkit.optim.muon import CONVERGENT_COEFFICIENTS, MuonWithAdamW, muon_parameters, newton_schulz
from labkit.optim.shampoo import Shampoo
from labkit.optim.soap import SOAP
from labkit.optim.split import state_bytes
from labkit.parallel.dp import refuse_layerwise

F64 = torch.float64


def two_layer(dtype=torch.float32) -> nn.Module:
    """Linear(5, 4) -> tanh -> Linear(4, 3): two matrices, two biases."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).to(dtype)


def batches(steps: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 5, generator=g, dtype=dtype), torch.randint(0, 3, (6,), generator=g)) for _ in range(steps)]


def train(net: nn.Module, opt, steps: int, dtype=torch.float32) -> list[list[torch.Tensor]]:
    """Gradients of every step (before the step)."""
    grads = []
    for x, y in batches(steps, dtype):
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        grads.append([p.grad.clone() for p in net.parameters()])
        opt.step()
    return grads


def dense_shampoo(params, grads_per_step, lr, mu, eps, freq, b2=0.999, graft_eps=1e-8):
    """Shampoo written from the formulas with dense Kronecker products (float64, column-stacking vec)."""
    w = [p.detach().clone() for p in params]
    L = {i: torch.zeros(p.shape[0], p.shape[0], dtype=F64) for i, p in enumerate(w) if p.ndim == 2}
    R = {i: torch.zeros(p.shape[1], p.shape[1], dtype=F64) for i, p in enumerate(w) if p.ndim == 2}
    root = {}
    v = [torch.zeros_like(p) for p in w]
    buf = [torch.zeros_like(p) for p in w]
    for t, grads in enumerate(grads_per_step, start=1):
        for i, g in enumerate(grads):
            v[i] = b2 * v[i] + (1 - b2) * g * g
            d = g / ((v[i] / (1 - b2 ** t)).sqrt() + graft_eps)
            if g.ndim == 2:
                L[i] = L[i] + g @ g.T
                R[i] = R[i] + g.T @ g
                if (t - 1) % freq == 0:
                    eye_l, eye_r = torch.eye(len(L[i]), dtype=F64), torch.eye(len(R[i]), dtype=F64)
                    lam, q = torch.linalg.eigh(torch.kron(R[i] + eps * eye_r, L[i] + eps * eye_l))
                    root[i] = q @ torch.diag(lam ** -0.25) @ q.T
                vec_g = g.T.reshape(-1)
                p = (root[i] @ vec_g).reshape(g.shape[1], g.shape[0]).T
                d = p * d.norm() / p.norm()
            buf[i] = mu * buf[i] + d
            w[i] = w[i] - lr * buf[i]
    return w


def test_shampoo_equals_a_dense_kronecker_implementation():
    net = two_layer(F64)
    start = [p.detach().clone() for p in net.parameters()]
    opt = Shampoo(net.parameters(), lr=0.1, momentum=0.9, update_freq=2, eps=1e-3, graft="adam")
    grads = train(net, opt, 3, F64)  # roots on steps 1 and 3, stale on step 2
    want = dense_shampoo([p.clone() for p in start], grads, lr=0.1, mu=0.9, eps=1e-3, freq=2)
    for got, expected in zip(net.parameters(), want, strict=True):
        torch.testing.assert_close(got.detach(), expected, rtol=1e-10, atol=1e-12)


def test_shampoo_one_step_by_hand():
    # W = 0, G = diag(3, 4): L = diag(9, 16), R = diag(9, 16), P = L^{-1/4} G R^{-1/4} = diag(3/3, 4/4) = I (ε = 1e-12)
    # graft sgd: ‖D‖ = ‖G‖ = 5, ‖P‖ = √2 -> P = 5/√2 I; lr 0.1, no momentum yet: W = -0.1 · 5/√2 I
    w = nn.Parameter(torch.zeros(2, 2, dtype=F64))
    w.grad = torch.diag(torch.tensor([3.0, 4.0], dtype=F64))
    Shampoo([w], lr=0.1, momentum=0.9, eps=1e-12, graft="sgd").step()
    torch.testing.assert_close(w.detach(), -0.5 / math.sqrt(2) * torch.eye(2, dtype=F64))


def test_shampoo_without_preconditioning_is_torch_sgd():
    """max_dim 1 leaves every side unpreconditioned and graft sgd keeps G: SGD with momentum and L2 decay."""
    ours, theirs = two_layer(), two_layer()
    train(ours, Shampoo(ours.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01, graft="sgd", max_dim=1), 3)
    train(theirs, torch.optim.SGD(theirs.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01), 3)
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(a, b)


def test_soap_first_step_is_the_polar_factor():
    # t = 1: M̂ = G, V̂ = G'², G' = Q_Lᵀ G Q_R = diag(±σ): N' = sign(G'), N = Q_L sign(G') Q_Rᵀ = U Vᵀ
    # (a square G of full rank: L and R have no null space, whose round-off ε would turn into ±1)
    g = torch.randn(4, 4, generator=torch.Generator().manual_seed(2), dtype=F64)
    w = nn.Parameter(torch.zeros(4, 4, dtype=F64))
    w.grad = g
    SOAP([w], lr=1.0, eps=1e-9).step()  # ε above the round-off of the zero off-diagonal entries of G' (1e-15)
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    torch.testing.assert_close(-w.detach(), u @ vh, rtol=0, atol=1e-5)  # ε/σ and round-off/ε: about 1e-6


def test_soap_with_identity_bases_is_torch_adamw():
    ours, theirs = two_layer(), two_layer()
    train(ours, SOAP(ours.parameters(), lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, max_dim=1), 3)
    train(theirs, torch.optim.AdamW(theirs.parameters(), lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1), 3)
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("shape", [(8, 5), (5, 8)])
def test_newton_schulz_converges_to_the_svd_polar_factor(shape):
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(3), dtype=F64)
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    torch.testing.assert_close(newton_schulz(g, steps=30, coefficients=CONVERGENT_COEFFICIENTS), u @ vh,
                               rtol=0, atol=1e-10)
    # Muon's coefficients, 5 steps: the same singular vectors, singular values only near 1
    o = newton_schulz(g, steps=5)
    s = u.T @ o @ vh.T
    torch.testing.assert_close(s - torch.diag(s.diagonal()), torch.zeros_like(s), rtol=0, atol=1e-10)
    assert 0.6 <= s.diagonal().min() and s.diagonal().max() <= 1.3, s.diagonal()


def test_newton_schulz_in_bfloat16_is_torch_muons_step():
    # momentum 0, no decay, lr 1: torch.optim.Muon steps W ← W − √max(1, 6/4) · NS(G) in bfloat16
    g = torch.randn(6, 4, generator=torch.Generator().manual_seed(4))
    w = nn.Parameter(torch.zeros(6, 4))
    w.grad = g.clone()
    torch.optim.Muon([w], lr=1.0, weight_decay=0.0, momentum=0.0, nesterov=False).step()
    ours = newton_schulz(g.bfloat16()).float() * math.sqrt(6 / 4)
    torch.testing.assert_close(-w.detach(), ours, rtol=0, atol=0)


def test_muon_takes_the_hidden_linear_weights_and_adamw_the_rest():
    net = nn.Sequential(nn.Embedding(7, 5), nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 4), nn.Linear(4, 7))
    assert muon_parameters(net) == [net[1].weight, net[3].weight]  # not the embedding, not the head
    opt, pre = build_optimizer("muon", net, 0.01, 0.9, 0.0, {})
    assert pre is None and isinstance(opt, MuonWithAdamW)
    assert [len(g["params"]) for g in opt.param_groups] == [2, 5]
    with pytest.raises(ConfigError, match="no hidden nn.Linear weight"):
        build_optimizer("muon", nn.Sequential(nn.Linear(3, 2)), 0.01, 0.9, 0.0, {})


def test_optimizer_state_bytes():
    # two_layer(): W1 (4, 5), b1 (4), W2 (3, 4), b2 (3), float32 (4 bytes each)
    # shampoo (graft adam): per matrix momentum + v (2mn) + L, L^{-1/4} (2m²) + R, R^{-1/4} (2n²); per bias momentum + v
    #   W1: 40 + 32 + 50 = 122, b1: 8, W2: 24 + 18 + 32 = 74, b2: 6 -> 210 numbers = 840 bytes
    # soap: per matrix M, V (2mn), L, Q_L (2m²), R, Q_R (2n²); per bias M, V: the same 210 numbers = 840 bytes
    # muon: W1 is Muon's (momentum 20); AdamW's b1, W2, b2 hold two moments each, 2·(4 + 12 + 3) = 38, and a 0-d
    #   step count each, 3 -> 61 numbers = 244 bytes
    # sgd (momentum): 39 numbers = 156 bytes; adam: 78 moments + 4 step counts = 82 numbers = 328 bytes
    expected = {"shampoo": 840, "soap": 840, "muon": 244, "sgd": 156, "adam": 328}
    for name, want in expected.items():
        net = two_layer()
        opt, _ = build_optimizer(name, net, 0.01, 0.9, 0.0, {})
        train(net, opt, 1)
        assert state_bytes(opt) == want, name


def test_bad_values_are_one_clear_error():
    with pytest.raises(ConfigError, match="Shampoo decay must be in"):
        build_optimizer("shampoo", two_layer(), 0.01, 0.9, 0.0, {"shampoo_decay": 1.5})
    with pytest.raises(ConfigError, match="--muon-worker-fraction 0.5 on 1 ranks: f·W must divide W; choose one of 1/1"):
        build_optimizer("muon", _split_model(), 0.01, 0.9, 0.0, {"muon_worker_fraction": 0.5})
    with pytest.raises(ConfigError, match="--optimizer muon with --strategy zero: Muon orthogonalises"):
        refuse_layerwise("muon", "zero", "a shard")


@pytest.mark.parametrize("optimizer", ["shampoo", "soap", "muon"])
def test_labkit_train_runs_and_learns(optimizer, tmp_path, capsys):
    # lenet: small hidden Linear layers (torch.optim.Muon's Newton–Schulz runs in bfloat16, slow on a CPU)
    code = cli_main(["train", "--model", "lenet", "--optimizer", optimizer, "--train-size", "256", "--test-size", "64",
                     "--batch-size", "32", "--max-steps", "6", "--epochs", "2", "--no-checkpoint",
                     "--out", str(tmp_path), "--log-every", "100"])
    assert code == 0
    records = [line for line in capsys.readouterr().out.splitlines() if line.startswith("epoch ")]
    losses = [float(line.split("train loss ")[1].split()[0]) for line in records]
    assert len(losses) == 2 and losses[1] < losses[0], records


# ----- split over two data-parallel ranks == one process on the global batch, through fit ------------------------

# Square 8 × 8 matrices and a global batch of 24: L and R have full rank from the first step. (A rank-deficient L or
# R, as any non-square matrix's, leaves round-off to pick the basis of its null space, and SOAP's elementwise Adam
# in that basis then differs between two runs by more than round-off. With full rank, float64 and eigenvectors
# that move with the eigenvalue gaps, SOAP stays within 5e-9 of one process.)
WORLD, B, STEPS = 2, 12, 3


def _split_data():
    g = torch.Generator().manual_seed(0)
    n = STEPS * WORLD * B  # one step per epoch: every epoch record is one step's loss
    return torch.utils.data.TensorDataset(torch.randn(n, 8, generator=g, dtype=F64),
                                          torch.randint(0, 8, (n,), generator=g))


def _split_model() -> nn.Module:
    """Linear(8, 8) -> Tanh -> Linear(8, 8) -> Tanh -> Linear(8, 8), float64: three matrices, three biases."""
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)).double()


SPLIT_OPTIONS = {"shampoo": {"shampoo_update_freq": 2}, "soap": {"soap_update_freq": 2}, "muon": {}}
#: the worker fractions 2 ranks allow: 1/2 (one owner per parameter) and 1 (every rank steps every parameter)
FRACTIONS = (0.5, 1.0)


def _split_run(env, name: str, fraction: float | None):
    """The model (placed), its loader, strategy and optimizer for one run of :func:`_fit_split`."""
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    from labkit.parallel.ddp import DDPStrategy

    train_set = _split_data()
    if env is None:
        model, strategy = _split_model(), None
        loader = DataLoader(train_set, batch_size=WORLD * B, drop_last=True,
                            sampler=DistributedSampler(train_set, num_replicas=1, rank=0, shuffle=True, seed=5))
    else:
        strategy = DDPStrategy(env, {"allreduce": "ddp"})
        model = strategy.prepare(_split_model())
        loader = DataLoader(train_set, batch_size=B, sampler=strategy.sampler(train_set, True, 5), drop_last=True)
    net = model if strategy is None else strategy.unwrap(model)
    opt, _ = build_optimizer(name, net, 0.01, 0.9, 0.0, {**SPLIT_OPTIONS[name], f"{name}_worker_fraction": fraction})
    return model, loader, strategy, opt


def _fit_split(env, name: str, fraction: float | None = None, save_to: str | None = None):
    """fit with the DDP strategy (or one process on the global batch when env is None) and worker fraction
    ``fraction``: per-step losses, final weights, the optimizer's owners, bytes sent and state bytes. With
    ``save_to``, the checkpoint after step 2 is also resumed by a fresh run (same fraction, and f = 1 for Shampoo)
    for step 3: its loss and weights."""
    from labkit.train.checkpoint import load_training_state, save_training_state
    from labkit.train.loop import fit

    model, loader, strategy, opt = _split_run(env, name, fraction)
    net = model if strategy is None else strategy.unwrap(model)
    path = None if save_to is None else Path(save_to) / f"{name}.pt"
    # one step per epoch (the sampler's shard of the data is one batch): an epoch record per step
    history = []
    for epoch in range(STEPS):
        history += fit(model, loader, None, opt, epochs=epoch + 1, start_epoch=epoch, strategy=strategy, seed=5,
                       max_steps=1, printer=lambda line: None)
        if path is not None and epoch == STEPS - 2:  # every rank saves (rank 0 writes the gathered state)
            save_training_state(path, strategy, model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
                                None, {"epoch": epoch + 1}, {})
    out = dict(losses=[h["train_loss"] for h in history], weights=[p.detach().clone() for p in net.parameters()],
               owners=opt.split.owners, sent=opt.split.bytes_sent, per_step=opt.split.communication_per_step(),
               state=state_bytes(opt))
    for resume_fraction in ([] if path is None else [fraction] + ([1.0] if name == "shampoo" else [])):
        model, loader, strategy, resumed = _split_run(env, name, resume_fraction)
        load_training_state(path, strategy, model, resumed, torch.optim.lr_scheduler.LambdaLR(resumed, lambda s: 1.0),
                            None)
        last = fit(model, loader, None, resumed, epochs=STEPS, start_epoch=STEPS - 1, strategy=strategy, seed=5,
                   max_steps=1, printer=lambda line: None)
        out[f"resumed {resume_fraction}"] = dict(loss=last[0]["train_loss"], state=state_bytes(resumed),
                                                 weights=[p.detach().clone() for p in strategy.unwrap(model).parameters()])
    return out


def _split_ranks(env, save_to: str):
    results = {(name, f): _fit_split(env, name, f, save_to if f == 0.5 else None)
               for name in SPLIT_OPTIONS for f in FRACTIONS}
    try:  # rank 1 holds other parameters (as a pipeline stage would): one clear error on every rank, not a hang
        Shampoo(_split_model().parameters() if env.rank == 0 else [nn.Parameter(torch.zeros(3, 2))], lr=0.1)
    except ConfigError as exc:
        results["mismatch"] = str(exc)
    try:  # the same shape, other values (a tensor-parallel shard): refused too, not overwritten by rank 0's
        SOAP([nn.Parameter(torch.full((3, 2), float(env.rank)))], lr=0.1)
    except ConfigError as exc:
        results["shards"] = str(exc)
    return results


def test_split_over_two_ranks_equals_one_process(tmp_path):
    from labkit.dist.testing import run_ranks

    ranks = run_ranks(_split_ranks, WORLD, str(tmp_path), timeout=240)
    # parameters: three 8 × 8 matrices and three biases of 8, 216 numbers, 8 bytes each: 1728 bytes leave their
    # owners every step (3 steps: 5184 bytes)
    # owners, largest cost first to the least-loaded rank (ties: the lower rank). Shampoo and SOAP, in parameter order
    # W1 b1 W2 b2 W3 b3, costs 8³ + 8³ + 64 = 1088 per matrix and 8 per bias: W1 -> 0, W2 -> 1, W3 -> 0, the biases
    # -> 1. Muon's order is its groups', W1 W2 (Muon, cost 8·8·8 = 512) then b1 b2 W3 b3 (AdamW, cost their size):
    # W1 -> 0, W2 -> 1, W3 (64) -> 0, the biases -> 1
    owners = {"shampoo": [0, 1, 1, 1, 0, 1], "soap": [0, 1, 1, 1, 0, 1], "muon": [0, 1, 1, 1, 0, 1]}
    # state bytes per rank: Shampoo keeps per matrix momentum, v, L, L^{-1/4}, R, R^{-1/4} (6 · 64 = 384 numbers),
    # per bias momentum and v (16). Rank 0: W1, W3 = 768 numbers = 6144 bytes; rank 1: W2 + 3 biases = 432 numbers
    # = 3456 bytes. SOAP: M, V, L, Q_L, R, Q_R and M, V: the same. Muon rank 0: W1's momentum 64 + W3's two AdamW
    # moments 128 = 192 numbers = 1536 bytes + W3's step count (a 0-d float32) 4 = 1540; rank 1: W2's momentum 64 +
    # the biases' moments 48 = 112 numbers = 896 bytes + 3 step counts = 908
    state = {"shampoo": [6144, 3456], "soap": [6144, 3456], "muon": [1540, 908]}
    # worker fraction 1 (groups of G = 1 rank): each rank owns all six parameters, holds the single process's state
    # (Shampoo, SOAP 6144 + 3456 = 9600; Muon 1540 + 908 = 2448) and sends nothing
    whole = {"shampoo": 9600, "soap": 9600, "muon": 2448}
    for name in SPLIT_OPTIONS:
        single = _fit_split(None, name)
        for fraction in FRACTIONS:
            for rank, per_rank in enumerate(ranks):
                got, case = per_rank[name, fraction], (name, fraction, rank)
                for step, (a, b) in enumerate(zip(got["losses"], single["losses"], strict=True)):
                    assert a == pytest.approx(b, abs=1e-9), (*case, step)
                for a, b in zip(got["weights"], single["weights"], strict=True):
                    torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-6, msg=lambda m: f"{case}: {m}")
                if fraction == 0.5:
                    assert got["owners"] == owners[name], case
                    assert (got["per_step"], got["sent"], got["state"]) == (1728, 3 * 1728, state[name][rank]), case
                else:
                    assert got["owners"] == [rank] * 6, case
                    assert (got["per_step"], got["sent"], got["state"]) == (0, 0, whole[name]), case
            for a, b in zip(ranks[0][name, fraction]["weights"], ranks[1][name, fraction]["weights"], strict=True):
                assert torch.equal(a, b)  # the replicas stay identical
        # the checkpoint after step 2 of the f = 1/2 run (rank 0 wrote the whole state, gathered from both owners)
        # resumed: step 3 bit for bit as without the stop, each rank holding its share again (f = 1/2) or all (f = 1)
        for rank, per_rank in enumerate(ranks):
            for resume_fraction in (0.5, 1.0) if name == "shampoo" else (0.5,):
                resumed, case = per_rank[name, 0.5][f"resumed {resume_fraction}"], (name, resume_fraction, rank)
                assert resumed["loss"] == per_rank[name, 0.5]["losses"][-1], case
                assert all(torch.equal(a, b) for a, b in zip(resumed["weights"], per_rank[name, 0.5]["weights"])), case
                assert resumed["state"] == (state[name][rank] if resume_fraction == 0.5 else whole[name]), case
        assert single["sent"] == 0 and single["state"] == sum(state[name]) == whole[name], name
    for per_rank in ranks:
        assert "needs the whole model on every rank" in per_rank["mismatch"]
        assert "needs the whole model on every rank" in per_rank["shards"]


def test_worker_fraction_counts_state_and_bytes_per_rank():
    """On 6 ranks each worker fraction f groups the ranks by G = 1/f; each group holds one copy of the state.

    _split_model(), float64: matrices W1 W2 W3 (64 numbers) and biases b1 b2 b3 (8). Shampoo keeps 6 · 64 = 384 numbers
    per matrix (3072 bytes) and 16 per bias (128). Owners within a group of G, largest cost first to the least loaded
    (costs 1088 per matrix, 8 per bias): G = 6: W1 W2 W3 b1 b2 b3 -> 0..5; G = 3: W1 b1 -> 0, W2 b2 -> 1, W3 b3 -> 2
    (3200 each); G = 2: as on 2 ranks, 6144 and 3456; G = 1: all, 9600. Muon (order W1 W2 | b1 W3 b2 b3, costs 512 512
    | 8 64 8 8), G = 3: W1 b1 -> 0, W2 b2 -> 1, W3 b3 -> 2; W1's momentum 512 bytes, a bias's AdamW moments 128 + its
    step count 4, W3's 1024 + 4: 644, 644, 1160. Every parameter leaves its owner once per step in each group of
    G > 1: 216 · 8 = 1728 bytes; none for G = 1."""
    expected = {("shampoo", 1 / 6): [3072] * 3 + [128] * 3, ("shampoo", 1 / 3): [3200] * 6,
                ("shampoo", 1 / 2): [6144, 3456] * 3, ("shampoo", 1.0): [9600] * 6, ("muon", 1 / 3): [644, 644, 1160] * 2}
    for name in ("shampoo", "muon"):
        net = _split_model()
        opt, _ = build_optimizer(name, net, 0.01, 0.9, 0.0, {})
        x, y = _split_data().tensors
        nn.functional.cross_entropy(net(x[:4]), y[:4]).backward()
        opt.step()
        for (which, fraction), want in expected.items():
            if which == name:
                assert opt.split.state_bytes_per_rank(opt, 6, fraction) == want, (name, fraction)
                assert opt.split.communication_per_step(6, fraction) == (0 if fraction == 1 else 1728), (name, fraction)
    with pytest.raises(ConfigError, match="--soap-worker-fraction 0.25 on 6 ranks: f·W must divide W; choose one of "
                                          "1/6, 2/6, 3/6, 6/6"):
        SOAP(net.parameters(), lr=0.1).split.communication_per_step(6, 0.25)


def test_state_round_trips_and_a_split_checkpoint_is_refused():
    """A checkpoint of one process resumes bit-identically; one rank's share of a split run's state (its own
    ``state_dict()``, not the gathered one a checkpoint saves) is refused by every rank alike."""
    from labkit.errors import CheckpointError

    for name in ("shampoo", "soap", "muon"):
        ours, theirs = two_layer(), two_layer()
        opt, _ = build_optimizer(name, ours, 0.01, 0.9, 0.0, {})
        train(ours, opt, 2)
        state = copy.deepcopy(opt.state_dict())  # as a checkpoint file holds it: not the live tensors
        theirs.load_state_dict(ours.state_dict())
        resumed, _ = build_optimizer(name, theirs, 0.01, 0.9, 0.0, {})
        resumed.load_state_dict(state)
        train(ours, opt, 2)
        train(theirs, resumed, 2)
        assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), theirs.parameters())), name
        with pytest.raises(CheckpointError, match="split over 2 ranks and holds one rank's share only"):
            resumed.load_state_dict({**state, "split_world_size": 2})
