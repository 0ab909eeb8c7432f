"""The device mesh on one GPU (``pytest -m gpu``): ranks sharing cuda:0 over gloo, each mesh through the same
``labkit.train.loop.fit`` a user runs, against the same mesh on CPU ranks.

NCCL refuses two ranks on one GPU, so the ranks run gloo with CUDA tensors, as ``labkit train --device cuda
--backend gloo`` does: labkit.dist.group's collectives go through the CPU, ring attention stages each KV message
through it. A rank's DistEnv there is the one ``distributed(device="cuda", backend="gloo")`` gives: cuda:0, made
the current device. Pipeline stages and parameter servers send CUDA tensors point to point, which gloo cannot
(its transport fails, "writev ... Bad address"): ``--mesh pp=2``, ``--strategy pipeline`` and ``--strategy ps``
on gloo with CUDA are refused in one line before any work (labkit.strategies.backends), checked here through ``labkit
train``.

One 2-rank spawn runs, on CPU tensors and then on CUDA tensors, a 2-layer GPT (d=32, T=16, 4 heads, vocabulary 64,
dropout 0) on ``--mesh cp=2`` (ring attention) and ``tp=2``, and the mixture-of-experts GPT (4 experts, top-1;
float64, so that no near-tie in the router flips between the devices) on ``ep=2``; then ``tp=2`` at dropout 0.5
on CUDA (labkit.parallel.tp_rng's tracker on the CUDA generator): one step by hand, the 5 replicated masks
(embedding, residuals) equal on both ranks, the sharded attention masks apart (twin heads: rank 1's q/k/v a copy
of rank 0's), the CPU and CUDA random streams given back equal on both ranks; fit twice with one seed,
bit-identical, the 15 replicated parameters bit-identical on the two ranks. One 4-rank spawn: ``dp=2,tp=2`` and
``cp=2,tp=2``. A fit is one epoch of 2 steps (SGD with momentum), then an evaluation.

Tolerances: TF32 off and deterministic kernels (``labkit train --deterministic``; the dropout runs' attention by
SDPA's math kernel); every step's loss within 1e-4 of the CPU run's (a loss near ln 64 = 4.16), every weight after
the epoch within 1e-4; the dropout checks are exact. The runs go in order, each rank saving its results as it goes: the first run that fails ends its spawn, the tests of it and of the runs after it fail with
its traceback, and the earlier runs are still checked.
"""
import dataclasses
import functools
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from labkit.dist.testing import record_losses, run_ranks
from labkit.models.gpt import GPT, GPTConfig

GPU = "cuda"  # the device of the runs compared with CPU ones (this file's logic was checked with "cpu" here)
CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32, dropout=0.0)
BATCH, STEPS, SEED, TOL, TIMEOUT = 8, 2, 5, 1e-4, 90
TWO = {"cp=2": {"mesh": "cp=2"}, "tp=2": {"mesh": "tp=2"}, "ep=2": {"mesh": "ep=2"}}
FOUR = {"dp=2,tp=2": {"mesh": "dp=2,tp=2"}, "cp=2,tp=2": {"mesh": "cp=2,tp=2"}}
HALF = CFG.n_embd // 2  # rank r's q/k/v rows under tp=2: its 2 of the 4 heads
REPLICATED = ("ln1.weight", "ln1.bias", "ln2.weight", "ln2.bias", "attn.proj.bias", "mlp.proj.bias",
              "ln_f.weight", "ln_f.bias", "pos_emb.weight")


def _model(key: str, dropout: float = 0.0):
    torch.manual_seed(1)
    if key == "ep=2":
        from labkit.models.moe import gpt_moe

        return gpt_moe("gpt-moe-tiny", vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32,
                       dropout=0.0).double()
    return GPT(CFG.replace(dropout=dropout))


def _data():
    tokens = torch.randint(0, CFG.vocab_size, (STEPS * BATCH + 4, CFG.block_size + 1),
                           generator=torch.Generator().manual_seed(0))
    n = STEPS * BATCH
    return TensorDataset(tokens[:n, :-1], tokens[:n, 1:]), TensorDataset(tokens[n:, :-1], tokens[n:, 1:])


def _on(env, device: str):
    """This rank's DistEnv with its tensors on ``device`` (cuda: cuda:0, made current, as distributed() does)."""
    if device == "cuda":
        torch.cuda.set_device(0)
    return dataclasses.replace(env, device=torch.device("cuda", 0) if device == "cuda" else torch.device(device))


def _fit(env, key: str, options: dict, dropout: float = 0.0) -> dict:
    """``fit`` on the mesh ``options``: this rank's loss every step (None off the loss's owner), its weights."""
    from labkit.parallel.mesh import MeshStrategy
    from labkit.train.loop import fit
    from labkit.train.tasks import LanguageModelling

    strategy = MeshStrategy(env, dict(options))
    strategy.check_model("gpt-moe-tiny" if key == "ep=2" else "gpt-tiny")
    model = strategy.prepare(_model(key, dropout))
    losses = record_losses(strategy)
    train, test = _data()
    task = LanguageModelling()
    fit(model, DataLoader(train, batch_size=BATCH // strategy.data_parallel_size, drop_last=True,
                          sampler=strategy.sampler(train, True, SEED)),
        DataLoader(test, batch_size=2, sampler=strategy.sampler(test, False, SEED)),
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), epochs=1, strategy=strategy, seed=SEED,
        criterion=task.criterion(), task=task, printer=lambda line: None)
    return {"losses": [None if loss is None else loss.cpu() for loss in losses],
            "weights": {name: p.detach().cpu() for name, p in model.named_parameters()},
            "device": next(model.parameters()).device.type}


def _one_step(env) -> dict:
    """One step of the GPT sharded over tp=2 at dropout 0.5, by hand: the masks, the attention outputs of twin
    heads in eval and training mode, the random states after it."""
    from labkit.parallel.megatron import VocabParallelCrossEntropy, parallelize_gpt

    torch.manual_seed(0)
    model = GPT(CFG.replace(dropout=0.5))
    with torch.no_grad():
        for layer in (layer for block in model.blocks for layer in (block.attn.q, block.attn.k, block.attn.v)):
            layer.weight[HALF:], layer.bias[HALF:] = layer.weight[:HALF].clone(), layer.bias[:HALF].clone()
    model = parallelize_gpt(model.to(env.device), None)
    seen = {"masks": [], "attn": []}
    for drop in [model.drop] + [block.drop for block in model.blocks]:
        drop.register_forward_hook(lambda m, args, out: seen["masks"].append((out == 0).cpu()))
    for block in model.blocks:
        block.attn.proj.register_forward_pre_hook(lambda m, args: seen["attn"].append(args[0].detach().cpu()))
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, CFG.vocab_size, (2, CFG.block_size), generator=g).to(env.device) for _ in range(2))
    with torch.no_grad():
        model.eval()(x)
    eval_attn, seen["attn"], seen["masks"] = seen["attn"], [], []
    torch.manual_seed(11)  # every stream, the same on both ranks (fit seeds a tp group alike)
    VocabParallelCrossEntropy(None, CFG.vocab_size)(model.train()(x), y).backward()
    rng = [torch.get_rng_state()] + ([torch.cuda.get_rng_state()] if env.device.type == "cuda" else [])
    return dict(seen, eval_attn=eval_attn, rng=rng, device=next(model.parameters()).device.type)


def _dropout(env) -> dict:
    """:func:`_one_step`, then ``fit`` on tp=2 at dropout 0.5 twice with one seed; attention by SDPA's math
    kernel (a fused kernel's backward may add with atomics: two runs would differ in the last bits for a reason
    other than the random streams)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        return dict(_one_step(env), fits=[_fit(env, "tp=2", {"mesh": "tp=2"}, dropout=0.5) for _ in range(2)])


def _ranks(env, table: dict, gpu: str, out: str, dropout: bool = False) -> None:
    """Every mesh of ``table`` on CPU tensors ("... cpu"), then on ``gpu`` tensors ("... gpu"); with ``dropout``,
    :func:`_dropout` on ``gpu`` after them. The results so far go to ``out/rank{r}.pkl`` after each
    run, so that a run that fails (or crashes its rank) leaves the earlier ones to be checked."""
    from labkit.dist.group import deterministic_kernels

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    deterministic_kernels()
    runs = [(f"{key} {side}", functools.partial(_fit, _on(env, device), key, options))
            for key, options in table.items() for side, device in (("cpu", "cpu"), ("gpu", gpu))]
    if dropout:
        runs.append(("dropout", functools.partial(_dropout, _on(env, gpu))))
    done, path = {}, Path(out) / f"rank{env.rank}.pkl"
    for name, run in runs:
        done[name] = run()
        path.with_suffix(".tmp").write_bytes(pickle.dumps(done))
        path.with_suffix(".tmp").replace(path)


def _spawn(world_size: int, table: dict, out: Path, dropout: bool = False) -> tuple[list[dict], str | None]:
    """Every rank's results (:func:`_ranks`) and the error that stopped the ranks (None: they all finished)."""
    try:
        run_ranks(_ranks, world_size, table, GPU, str(out), dropout, timeout=TIMEOUT)
        error = None
    except (RuntimeError, TimeoutError) as exc:
        error = str(exc)
    files = [out / f"rank{r}.pkl" for r in range(world_size)]
    return [pickle.loads(f.read_bytes()) if f.exists() else {} for f in files], error


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    return _spawn(2, TWO, tmp_path_factory.mktemp("two"), dropout=True)


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    return _spawn(4, FOUR, tmp_path_factory.mktemp("four"))


def _results(spawn: tuple[list[dict], str | None], name: str) -> list[dict]:
    """Every rank's result of run ``name``; where a rank has none, the error that stopped the ranks."""
    ranks, error = spawn
    if not all(name in r for r in ranks):
        pytest.fail(f"{name} did not finish on every rank; the ranks stopped with: {error}")
    return [r[name] for r in ranks]


def _check_equal(spawn: tuple[list[dict], str | None], key: str) -> None:
    cpu, gpu = _results(spawn, f"{key} cpu"), _results(spawn, f"{key} gpu")
    for c, g in zip(cpu, gpu, strict=True):
        assert g["device"] == torch.device(GPU).type and len(c["losses"]) == len(g["losses"]) == STEPS
        assert [loss is None for loss in g["losses"]] == [loss is None for loss in c["losses"]]
        for a, b in zip(g["losses"], c["losses"]):
            if b is not None:
                torch.testing.assert_close(a, b, rtol=0, atol=TOL)
        assert g["weights"].keys() == c["weights"].keys()
        for name, w in c["weights"].items():
            torch.testing.assert_close(g["weights"][name], w, rtol=0, atol=TOL)
    assert sum(loss is not None for r in cpu for loss in r["losses"]) >= STEPS  # some rank owns the loss


@pytest.mark.parametrize("key", list(TWO))
def test_two_ranks_on_one_gpu_over_gloo_equal_cpu_ranks(two, key):
    _check_equal(two, key)


@pytest.mark.parametrize("key", list(FOUR))
def test_four_ranks_on_one_gpu_over_gloo_equal_cpu_ranks(four, key):
    _check_equal(four, key)


def test_tp_dropout_on_the_gpu_draws_replicated_masks_alike_and_sharded_ones_apart(two):
    a, b = _results(two, "dropout")
    assert a["device"] == b["device"] == torch.device(GPU).type
    assert len(a["masks"]) == len(b["masks"]) == 5  # embedding + 2 blocks x (attention, MLP) residuals
    assert all(0.35 < m.float().mean() < 0.65 for m in a["masks"] + b["masks"])  # p = 0.5
    assert [torch.equal(m, n) for m, n in zip(a["masks"], b["masks"])] == [True] * 5
    assert len(a["attn"]) == len(a["eval_attn"]) == 2
    for i in range(2):  # twin heads: equal without dropout, apart under each rank's own attention masks
        assert torch.allclose(a["eval_attn"][i], b["eval_attn"][i], atol=1e-6)
        assert not torch.allclose(a["attn"][i], b["attn"][i], atol=1e-3), i
    assert len(a["rng"]) == (2 if torch.device(GPU).type == "cuda" else 1)
    assert all(torch.equal(s, t) for s, t in zip(a["rng"], b["rng"]))  # the streams given back, alike
    for r in (a, b):  # one seed: the same run, bit for bit
        first, again = r["fits"]
        assert len(first["losses"]) == STEPS and torch.isfinite(torch.stack(first["losses"])).all()
        assert all(torch.equal(x, y) for x, y in zip(first["losses"], again["losses"]))
        assert all(torch.equal(w, again["weights"][name]) for name, w in first["weights"].items())
    replicated = [name for name in a["fits"][0]["weights"] if name.endswith(REPLICATED)]
    assert len(replicated) == 15
    assert all(torch.equal(a["fits"][0]["weights"][n], b["fits"][0]["weights"][n]) for n in replicated)


@pytest.mark.parametrize("args", [["--strategy", "mesh", "--mesh", "pp=2", "--model", "gpt-tiny",
                                   "--dataset", "text-sample", "--seq-len", "16"],
                                  ["--strategy", "pipeline", "--model", "lenet", "--dataset", "synthetic-mnist"],
                                  ["--strategy", "ps", "--ps-mode", "sync", "--model", "mlp", "--dataset",
                                   "synthetic-mnist"]])
def test_point_to_point_messages_on_gloo_with_cuda_tensors_are_refused_in_one_line(args, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "labkit.dist.torchrun", "--standalone", "--nproc-per-node", "2", "-m",
                           "labkit", "train", *args, "--device", GPU, "--backend", "gloo", "--max-steps", "2",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=120, check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("labkit: error:")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-2000:]
    assert "point to point, which gloo does on CPU tensors only" in errors[0]
    assert not (tmp_path / "summary.json").exists()
