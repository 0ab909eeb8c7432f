"""Megatron tensor + sequence parallelism (labkit.parallel.megatron) against the single-process GPT and against
PyTorch's ``parallelize_module``: one 2-rank gloo spawn checks loss, gradients, a few optimiser steps, the
bytes each collective moves and the activation memory saved for backward; the rest runs on one process.

Tolerances: fp32, sums taken in another order across the ranks: loss and every gradient within 1e-5 absolute
(gradients are of order 1e-2), weights after 3 SGD steps (lr 0.5, momentum 0.9) within 1e-5.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from labkit.dist import group as kdist
from labkit.dist.testing import run_ranks
from labkit.errors import ConfigError
from labkit.models.gpt import GPT, GPTConfig
from labkit.parallel import megatron_cost as cost
from labkit.parallel.megatron import (
    VocabParallelCrossEntropy,
    parallelize_gpt,
    sequence_parallel_params,
    sync_sequence_parallel_grads,
)
from labkit.parallel.memory import layer_activation_bytes

CFG = GPTConfig(vocab_size=33, block_size=16, n_layer=2, n_head=4, n_embd=32)
B, T, TOL = 2, 16, 1e-5


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(CFG)


def _batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, CFG.vocab_size, (B, T), generator=g), torch.randint(0, CFG.vocab_size, (B, T), generator=g)


def _reference():
    model = _model()
    x, y = _batch()
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    return model, loss.item(), {n: p.grad for n, p in model.named_parameters()}


def _full(name, local, ref_shape, group):
    """Gather a shard back to the full tensor (along the dim whose size differs from the reference's; the
    vocabulary's 33 rows are split 17 + 16)."""
    local = local.full_tensor() if hasattr(local, "full_tensor") else local
    if tuple(local.shape) == tuple(ref_shape):
        return local
    d = next(i for i, (a, b) in enumerate(zip(local.shape, ref_shape)) if a != b)
    parts = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, local.detach(), group=group)
    return torch.cat(parts, dim=d)


def _max_grad_diff(model, ref_grads, group) -> float:
    return max((_full(n, p.grad, ref_grads[n].shape, group) - ref_grads[n]).abs().max().item()
               for n, p in model.named_parameters())


def _counting(log: list):
    """Wrap the collectives labkit.dist.group and labkit.parallel.mappings call; log (name, elements of this rank's part)."""
    # the reduce-scatter under the name this torch gives it (reduce_scatter_single from 2.13, reduce_scatter_tensor
    # before), logged as "reduce_scatter" either way
    names = {"all_reduce": "all_reduce", "all_gather": "all_gather", kdist.REDUCE_SCATTER_TENSOR: "reduce_scatter"}
    originals = {n: getattr(dist, n) for n in names}

    def wrap(name, fn):
        def counted(*args, **kwargs):
            log.append((name, args[1].numel() if name == "all_gather" else args[0].numel()))
            return fn(*args, **kwargs)
        return counted
    for n, label in names.items():
        setattr(dist, n, wrap(label, originals[n]))
    return originals


def _saved_bytes(module, x) -> int:
    """Bytes of the tensors ``module``'s forward saves for backward, each storage once, parameters left out."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x)
    return sum(seen.values())


def _tp_rank(env):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    from labkit.parallel.megatron_dtensor import parallelize_gpt_dtensor

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    group = mesh.get_group("tp")
    ref, ref_loss, ref_grads = _reference()
    x, y = _batch()
    out = {}
    for sp in (False, True):
        key = "sp" if sp else "tp"
        model = parallelize_gpt(_model(), group, sequence_parallel=sp)
        criterion = VocabParallelCrossEntropy(group, CFG.vocab_size)
        log = []
        originals = _counting(log)
        try:
            loss = criterion(model(x), y)
            loss.backward()
            sync_sequence_parallel_grads(model, group)
        finally:
            for n, fn in originals.items():
                setattr(dist, n, fn)
        out[key] = {"loss": abs(loss.item() - ref_loss), "grad": _max_grad_diff(model, ref_grads, group),
                    "calls": log, "sp_params": sum(p.numel() for p in sequence_parallel_params(model))}
        # activation memory of one block on this rank: its input is (B, T/t, C) with SP
        block_in = torch.randn(B, T // 2 if sp else T, CFG.n_embd, requires_grad=True)
        out[key]["block_saved"] = _saved_bytes(model.blocks[0], block_in)
        # PyTorch's parallelize_module on the same weights
        theirs = parallelize_gpt_dtensor(_model(), mesh["tp"], sequence_parallel=sp)
        with loss_parallel():
            their_loss = F.cross_entropy(theirs(x).flatten(0, 1), y.flatten())
            their_loss.backward()
        out[key]["torch_loss"] = abs(their_loss.full_tensor().item() - ref_loss)
        out[key]["torch_grad"] = _max_grad_diff(theirs, ref_grads, group)
    # the tp dimension as labkit train --mesh tp=2 --sequence-parallel runs it: a step and an evaluation
    from labkit.parallel.mesh import MeshStrategy

    strategy = MeshStrategy(env, {"mesh": "tp=2", "sequence_parallel": True})
    strategy.check_model("gpt-tiny")
    try:
        strategy.check_model("lenet")
    except ConfigError as err:
        out["refused"] = str(err)
    model = strategy.prepare(_model())
    x, y = _batch()
    loss, _ = strategy.forward_backward(model, x, y, torch.nn.CrossEntropyLoss())
    strategy.sync_gradients(model)
    with torch.no_grad():
        full = strategy.forward(model, x)
        ref_out = _model()(x)
    out["mesh"] = {"loss": abs(loss.item() - ref_loss), "grad": _max_grad_diff(model, ref_grads, group),
                   "eval": (full - ref_out).abs().max().item(), "owner": strategy.metric_owner()}
    # 3 SGD steps (momentum), SP, against the single-process model: loss every step, weights after
    ref, model = _model(), parallelize_gpt(_model(), group, sequence_parallel=True)
    criterion, steps = VocabParallelCrossEntropy(group, CFG.vocab_size), []
    opts = [torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9) for m in (ref, model)]
    for step in range(3):
        x, y = _batch(10 + step)
        losses = []
        for m, opt, lossf in ((ref, opts[0], lambda o: F.cross_entropy(o.flatten(0, 1), y.flatten())),
                              (model, opts[1], lambda o: criterion(o, y))):
            opt.zero_grad()
            loss = lossf(m(x))
            loss.backward()
            if m is model:
                sync_sequence_parallel_grads(m, group)
            opt.step()
            losses.append(loss.item())
        steps.append(abs(losses[0] - losses[1]))
    ref_params = dict(ref.named_parameters())
    out["steps"] = steps
    out["weights"] = max((_full(n, p.detach(), ref_params[n].shape, group) - ref_params[n].detach()).abs().max()
                         .item() for n, p in model.named_parameters())
    return out


def test_tp_and_sp_on_two_ranks_equal_single_and_parallelize_module():
    results = run_ranks(_tp_rank, 2)
    for r in results:
        for key in ("tp", "sp"):
            res = r[key]
            assert res["loss"] < TOL and res["grad"] < TOL, (key, res["loss"], res["grad"])
            assert res["torch_loss"] < TOL and res["torch_grad"] < TOL, (key, res["torch_loss"], res["torch_grad"])
        assert max(r["steps"]) < TOL and r["weights"] < TOL, (r["steps"], r["weights"])
        assert r["mesh"]["loss"] < TOL and r["mesh"]["grad"] < TOL and r["mesh"]["eval"] < TOL, r["mesh"]
        assert r["refused"] == ("--mesh tp=2 --sequence-parallel cuts a transformer's sequence: it needs --model "
                                "gpt-tiny|gpt-small|gpt-100m, not lenet")
    assert [r["mesh"]["owner"] for r in results] == [True, False]  # the tp group's loss counted once
    tp, sp = results[0]["tp"], results[0]["sp"]
    assert results[1]["tp"]["calls"] == tp["calls"] and results[1]["sp"]["calls"] == sp["calls"]
    # without SP, all-reduces only: forward embedding + 2 per block (B·T·C = 1024), the loss's max (B·T = 32)
    # and [sum exp, target logit] (64); backward 2 per block + the final layer norm's f
    assert tp["calls"] == [("all_reduce", 1024)] * 5 + [("all_reduce", 32), ("all_reduce", 64)] + \
        [("all_reduce", 1024)] * 5
    # with SP: reduce-scatter after the embedding, per block 2 (all-gather, reduce-scatter) of B·T/t·C = 512,
    # the all-gather into the head, the loss; backward the conjugates; then the layer norms', row biases' and
    # position table's gradients in one all-reduce
    fwd = [("reduce_scatter", 512)] + [("all_gather", 512), ("reduce_scatter", 512)] * 4 + \
        [("all_gather", 512), ("all_reduce", 32), ("all_reduce", 64)]
    bwd = [("reduce_scatter", 512)] + [("all_gather", 512), ("reduce_scatter", 512)] * 4 + \
        [("all_gather", 512)]
    assert sp["calls"] == fwd + bwd + [("all_reduce", 960)]
    assert sp["sp_params"] == 960  # 2·(2·2·32 + 2·32) + 2·32 + 16·32
    for key, sequence_parallel in (("tp", False), ("sp", True)):
        counted = {}
        for name, n in results[0][key]["calls"]:
            counted[name] = counted.get(name, 0) + 4 * n
        assert counted == cost.tp_step_bytes(CFG, B, T, 2, sequence_parallel), key
    # activation memory of one block per rank (fp32), measured: 4 bytes · (s·b·h·(4 + 12/2) + 4·s·b + a·s·b/2)
    # without SP, 4 · (s·b·h·(2 + 14/2) + 4·s·b/2 + a·s·b/2) with it; the formula gives it exactly
    assert (tp["block_saved"], sp["block_saved"]) == (41728, 37376)
    for key, sequence_parallel in (("tp", False), ("sp", True)):
        formula = layer_activation_bytes(B, T, CFG.n_embd, CFG.n_head, 2, sequence_parallel)
        assert results[0][key]["block_saved"] == formula, key


# ----- one process: the operators are the identity, the modules compute the full model's results ---------


def test_on_one_rank_the_parallel_gpt_is_the_gpt():
    ref, ref_loss, ref_grads = _reference()
    model = parallelize_gpt(_model(), None, sequence_parallel=True)
    x, y = _batch()
    loss = VocabParallelCrossEntropy(None)(model(x), y)
    loss.backward()
    assert abs(loss.item() - ref_loss) < 1e-6
    assert model.head.weight is model.tok_emb.weight
    assert [n for n, _ in model.named_parameters()] == list(ref_grads)
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, ref_grads[n], atol=1e-6), n


def test_vocab_parallel_cross_entropy_matches_torch_on_one_rank():
    g = torch.Generator().manual_seed(3)
    logits = (5 * torch.randn(2, 3, 7, generator=g)).requires_grad_()
    targets = torch.randint(0, 7, (2, 3), generator=g)
    mine = VocabParallelCrossEntropy(None)(logits, targets)
    (d_mine,) = torch.autograd.grad(mine, logits)
    theirs = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    (d_theirs,) = torch.autograd.grad(theirs, logits)
    assert torch.allclose(mine, theirs, atol=1e-6) and torch.allclose(d_mine, d_theirs, atol=1e-7)
    # float64 stays float64 (promoted, never cut to float32): equal to torch's to float64 rounding
    wide = logits.detach().double().requires_grad_()
    mine, theirs = VocabParallelCrossEntropy(None)(wide, targets), F.cross_entropy(wide.flatten(0, 1), targets.flatten())
    assert mine.dtype == torch.float64 and abs(mine.item() - theirs.item()) < 1e-14
    (d_mine,), (d_theirs,) = torch.autograd.grad(mine, wide), torch.autograd.grad(theirs, wide)
    assert d_mine.dtype == torch.float64 and torch.allclose(d_mine, d_theirs, rtol=0, atol=1e-15)


def test_tp_that_does_not_divide_is_one_line(monkeypatch):
    import labkit.parallel.megatron as megatron
    monkeypatch.setattr(megatron, "group_size", lambda group: 3)
    with pytest.raises(ConfigError) as err:
        parallelize_gpt(_model(), None)
    assert str(err.value) == "--mesh tp=3 does not divide the attention heads (4); choose a tp that does"
    with pytest.raises(ConfigError, match=r"the block size \(sequence parallelism\) \(16\)"):
        parallelize_gpt(GPT(CFG.replace(n_head=6, n_embd=36)), None, sequence_parallel=True)


def test_formulas_give_the_counted_sizes_for_gpt_100m():
    cfg = GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768)
    no_sp = cost.tp_step_bytes(cfg, 8, 1024, 4, False)
    with_sp = cost.tp_step_bytes(cfg, 8, 1024, 4, True)
    # 4·L + 2 all-reduces of B·T·C (+ the loss's 3·B·T) vs the same bytes as all-gathers and reduce-scatters
    assert no_sp == {"all_reduce": 4 * (50 * 8 * 1024 * 768 + 3 * 8 * 1024)}
    assert with_sp["all_gather"] == with_sp["reduce_scatter"] == 4 * 50 * 2 * 1024 * 768  # (4L + 2) · B·T·C/t
