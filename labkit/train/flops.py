"""The FLOPs of one training step, counted and by formula, and the gap between the two named term by term.

    f = step_flops("lenet", num_classes=10, in_channels=1, image_size=28)
    f.model, f.formula, f.gap        # 1,517,040 and 1,689,840 per sample; {"first layer's input gradient": 172,800}

**Counted** (:func:`count_step`): one forward pass, the loss and one backward pass of one sample under
``torch.utils.flop_counter.FlopCounterMode``, which adds up the FLOPs of every matrix product and convolution
PyTorch dispatches (``mm``, ``addmm``, ``bmm``, convolutions and their backward, the fused attention kernels), each
by its shape: ``2·m·n·k`` for an ``(m, k) @ (k, n)`` product. It counts nothing else: no softmax, GELU, ReLU,
norm, pooling, residual add, bias add, loss or optimizer step. The count runs on a fresh copy of the model on
PyTorch's ``meta`` device (shapes only: no memory, no arithmetic, and the random streams are untouched), so it
adds no work to training and reads nothing of the run's weights. The MoE GPTs route by the data (``bincount``,
``nonzero``), which the meta device cannot do: they are counted on the CPU on one sequence of random tokens, under
the math attention kernel, in a forked random state. The step's FLOPs are the per-sample count × the batch: every
op here is linear in the batch (a MoE routes each sequence on its own).

Attention is counted as PyTorch computes it, the whole ``T × T`` score matrix: the causal mask sets half of it to
-inf after it is computed (a flash kernel that skips the masked blocks does about half that work). On a CPU tensor
FlopCounterMode misses attention altogether (torch 2.14's CPU flash kernel has no FLOP formula: gpt-tiny,
vocabulary 96, 16 tokens, counts 38,928,384 per sample on CPU tensors against 39,714,816 on meta, where attention
is two ``bmm`` s), which is why the count runs on meta, or under the math kernel.

**Formula** (:func:`formula_flops`), per sample:

- GPT (Kaplan et al. 2020; PaLM's appendix B): ``F = 6·N·T + 12·L·C·T²`` with N the parameters a token uses (every
  parameter, the tied embedding/head matrix once; of a MoE layer's E experts only its k), T the tokens of a
  sample, L layers of width C. 6·N·T: each weight multiplies each token once forward (2 FLOPs) and twice backward
  (the input's gradient and the weight's: 4). 12·L·C·T²: per layer ``q kᵀ`` and ``p v`` are 2·T²·C FLOPs each
  forward, twice that backward.
- CNNs and the MLP (layer sums): ``F = 3·Σ 2·MACs`` over every convolution and linear layer's forward pass, with
  ``MACs = out_elements · in_channels/groups · kh · kw`` for a convolution and ``out_features · in_features`` for a
  linear layer, per sample; ×3: backward costs twice the forward (input gradient and weight gradient).

**The gap** ``formula − counted`` (:attr:`StepFlops.gap`), each term counted from the model, and the test holds
``counted + Σ gap = formula`` exactly:

- ``"position table"``: 6·T·(rows × C) of the GPT's learned positions, which N counts but which are looked up,
  never multiplied. (The token table is also looked up, but the tied head multiplies the same matrix, so its 6·V·C
  per token is real.)
- ``"linear biases"``, ``"norm weights"``: 6·T per bias and per LayerNorm parameter: N counts them, but they are
  added or scaled elementwise (FlopCounterMode counts only ``addmm``'s product).
- ``"dropped choices"`` (MoE with a capacity): 6·8·C² per token choice over capacity (an expert's two matrices);
  the formula assumes every token reaches its k experts.
- ``"first layer's input gradient"`` (CNNs, MLP): 2·MACs of the first layer: the data needs no gradient, so
  autograd never computes it.

Neither side counts the elementwise work (activations, norms, softmax, the loss, the optimizer step): MFU is a
statement about matrix products, and time spent on the rest shows as a lower MFU.
"""
from __future__ import annotations

import copy
import hashlib
import importlib.metadata
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from labkit.models import cnn as kmodels
from labkit.models import gpt as kgpt
from labkit.models import moe as kmoe
from labkit.models.gpt import GPT
from labkit.models.moe import MOE_SIZES, MoE, moe_layers
from labkit.models.names import LANGUAGE_MODELS
from labkit.train.peak import cache_folder, read_table, store_entry
from labkit.train.tasks import get_task


@dataclass(frozen=True)
class StepFlops:
    """FLOPs per sample of one training step (forward + loss + backward); a step is these × the batch.

    ``model``: counted with no recompute (what MFU divides by time). ``hardware``: counted on the model as it trains,
    recomputed forward passes included (HFU); equal to ``model`` without activation checkpointing. ``formula``: the
    module docstring's formula. ``gap``: its named terms, ``formula - model == sum(gap.values())``. ``by_op``: the
    counted FLOPs per aten op. ``tokens``: tokens per sample (1 for images).
    """

    model: int
    hardware: int
    formula: int
    gap: dict[str, int] = field(default_factory=dict)
    by_op: dict[str, int] = field(default_factory=dict)
    tokens: int = 1

    def as_dict(self, batch: int | None = None) -> dict:
        """The summary's ``flops`` block; with ``batch`` (the global batch) also the step's model FLOPs."""
        out = {"model_per_sample": self.model, "hardware_per_sample": self.hardware,
               "formula_per_sample": self.formula, "gap_per_sample": dict(self.gap), "by_op": dict(self.by_op),
               "tokens_per_sample": self.tokens}
        if batch is not None:
            out["model_per_step"] = self.model * batch
        return out


def example(name: str, num_classes: int, in_channels: int, image_size: int, seq_len: int, batch: int = 1,
            device: str | torch.device = "meta") -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of the shape model ``name`` trains on: (B, T) tokens and (B, T) next tokens, or (B, C, S, S) images
    and (B,) labels. Random values from a private generator (the run's random streams are untouched)."""
    gen = torch.Generator().manual_seed(0)
    if name in LANGUAGE_MODELS:
        x = torch.randint(0, num_classes, (batch, seq_len), generator=gen)
        y = torch.randint(0, num_classes, (batch, seq_len), generator=gen)
    else:
        x = torch.randn(batch, in_channels, image_size, image_size, generator=gen)
        y = torch.randint(0, num_classes, (batch,), generator=gen)
    return x.to(device), y.to(device)


def count_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, criterion: nn.Module) -> dict[str, int]:
    """FLOPs per aten op of ``criterion(model(x), y).backward()``, counted by FlopCounterMode (attention under the
    math kernel, which it can count on every device). Gradients are set to None again afterwards."""
    counter = FlopCounterMode(display=False)
    with counter, sdpa_kernel([SDPBackend.MATH]):
        criterion(model(x), y).backward()
    model.zero_grad(set_to_none=True)
    return {str(op).removeprefix("aten."): int(n) for op, n in counter.get_flop_counts()["Global"].items() if n}


def counts_on_meta(name: str) -> bool:
    """Can model ``name`` be counted on the meta device? Not the MoE GPTs: their routing reads the data."""
    return LANGUAGE_MODELS.get(name) not in MOE_SIZES


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` (its structure, hooks and wrappers) whose parameters and buffers are on the meta device;
    no tensor's data is copied."""
    memo = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(p.detach().to("meta"), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = b.detach().to("meta")
    return copy.deepcopy(model, memo)


def step_flops(name: str, num_classes: int, in_channels: int = 1, image_size: int = 28, seq_len: int = 128,
               recomputed: nn.Module | None = None) -> StepFlops:
    """Counted and formula FLOPs per sample of one training step of model ``name`` (module docstring).

    ``recomputed``: the model as it trains with activation checkpointing on (any device); its step is counted on a
    meta copy for :attr:`StepFlops.hardware`. None: no recompute, hardware = model.
    """
    task = get_task("lm" if name in LANGUAGE_MODELS else "classification")
    device = "meta" if counts_on_meta(name) else "cpu"
    with torch.random.fork_rng(devices=[]), torch.device(device):  # a CPU build draws its init: not from the run
        torch.manual_seed(0)  # ... and the same init every time (a MoE's routing, so its dropped choices)
        model = kmodels.get_model(name, num_classes=num_classes, in_channels=in_channels, image_size=image_size,
                                  seq_len=seq_len)
    x, y = example(name, num_classes, in_channels, image_size, seq_len, device=device)
    shapes = _layer_shapes(model)
    by_op = count_step(model, x, y, task.criterion())
    for handle in shapes.pop("handles"):
        handle.remove()
    counted = sum(by_op.values())
    formula, gap = formula_flops(model, seq_len if isinstance(model, GPT) else 1, shapes["layers"])
    hardware = counted
    if recomputed is not None:
        copy_ = meta_copy(recomputed) if device == "meta" else copy.deepcopy(recomputed).cpu()
        with torch.random.fork_rng(devices=[]):
            hardware = sum(count_step(copy_, x, y, task.criterion()).values())
    return StepFlops(model=counted, hardware=hardware, formula=formula, gap=gap, by_op=by_op,
                     tokens=seq_len if isinstance(model, GPT) else 1)


def counted_once(name: str, num_classes: int, in_channels: int = 1, image_size: int = 28, seq_len: int = 128,
                 recomputed: nn.Module | None = None, cache: Path | None = None) -> StepFlops:
    """:func:`step_flops`, read from ``flops.json`` in :func:`labkit.train.peak.cache_folder` (or ``cache``) when it
    was counted before for this model, shape, torch and torchvision version and source of the models and of this
    module, else counted and stored there: a run pays for the count once per model and shape. With ``recomputed``
    the step is counted every time (the recompute is the model object's own)."""
    if recomputed is not None:
        return step_flops(name, num_classes, in_channels, image_size, seq_len, recomputed)
    cache = cache or cache_folder() / "flops.json"
    key = cache_key(name, num_classes, in_channels, image_size, seq_len)
    entry = read_table(cache).get(key)
    if isinstance(entry, dict):
        try:
            return StepFlops(**entry)
        except TypeError:  # a stored entry of another shape: count again
            pass
    flops = step_flops(name, num_classes, in_channels, image_size, seq_len)
    store_entry(cache, key, flops.__dict__)
    return flops


def cache_key(name: str, num_classes: int, in_channels: int, image_size: int, seq_len: int) -> str:
    """What the count of model ``name`` depends on: its shape arguments, torch's and torchvision's versions, and a
    digest of the model code and of this module."""
    shape = f"T {seq_len}" if name in LANGUAGE_MODELS else f"{in_channels}x{image_size}x{image_size}"
    digest = hashlib.sha256()
    for module in (kmodels, kgpt, kmoe, sys.modules[__name__]):
        digest.update(Path(module.__file__).read_bytes())
    return (f"{name} | {num_classes} classes | {shape} | torch {torch.__version__} | torchvision "
            f"{_version('torchvision')} | {digest.hexdigest()[:16]}")


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def _layer_shapes(model: nn.Module) -> dict:
    """Forward hooks recording each convolution's and linear layer's (module, input shape, output shape) per call,
    in call order (the CNN formula's layer sums)."""
    layers: list[tuple[nn.Module, tuple, tuple]] = []

    def hook(module, inputs, output):
        layers.append((module, tuple(inputs[0].shape), tuple(output.shape)))

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    return {"layers": layers, "handles": handles}


def layer_macs(module: nn.Module, out_shape: tuple) -> int:
    """Multiply-accumulates of one sample through ``module``: ``out_elements · in_channels/groups · kh · kw`` for a
    convolution, ``out_features · in_features`` per position for a linear layer (biases excluded)."""
    out = 1
    for d in out_shape[1:]:
        out *= d
    if isinstance(module, nn.Conv2d):
        kh, kw = module.kernel_size
        return out * (module.in_channels // module.groups) * kh * kw
    return out * module.in_features


def formula_flops(model: nn.Module, tokens: int, layers: list[tuple[nn.Module, tuple, tuple]]) -> tuple[int, dict]:
    """(formula FLOPs per sample, the gap's named terms) of ``model`` (module docstring); ``layers`` the recorded
    (module, input shape, output shape) of its last forward pass, in call order (images)."""
    if isinstance(model, GPT):
        return gpt_formula(model, tokens)
    macs = [layer_macs(module, out_shape) for module, _, out_shape in layers]
    formula = 3 * sum(2 * m for m in macs)                       # F = 3·Σ 2·MACs
    return formula, {"first layer's input gradient": 2 * macs[0]}


def gpt_formula(model: GPT, T: int) -> tuple[int, dict]:
    """``F = 6·N·T + 12·L·C·T²`` per sample of T tokens (module docstring), and the gap's terms, each 6·T × the
    parameters N counts that no matmul multiplies (plus a MoE's dropped choices, read from its last forward)."""
    L, C = model.cfg.n_layer, model.cfg.n_embd
    terms = {"matmul": 0, "position table": 0, "linear biases": 0, "norm weights": 0}
    for owner, p in _active_parameters(model):
        if owner is model.pos_emb:
            kind = "position table"
        elif isinstance(owner, nn.LayerNorm):
            kind = "norm weights"
        elif isinstance(owner, nn.Linear) and p is owner.bias:
            kind = "linear biases"
        else:
            kind = "matmul"  # linear weights; the token table, which the tied head multiplies
        terms[kind] += p.numel()
    N = sum(terms.values())
    formula = 6 * N * T + 12 * L * C * T * T
    gap = {kind: 6 * T * n for kind, n in terms.items() if kind != "matmul" and n}
    dropped = sum(int(layer.dropped) for layer in moe_layers(model))
    if dropped:
        gap["dropped choices"] = 6 * 8 * C * C * dropped
    return formula, gap


def _active_parameters(model: GPT):
    """(owning module, parameter) for every parameter one token uses, each shared one once: a MoE layer's experts
    contribute k of their E copies (one expert's parameters, k times)."""
    seen = set()
    experts = {id(m) for layer in moe_layers(model) for m in layer.experts.modules()}
    for module in model.modules():
        if id(module) in experts:
            continue
        for p in module.parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                yield module, p
        if isinstance(module, MoE):
            for _ in range(module.moe.top_k):
                for sub in module.experts[0].modules():
                    for p in sub.parameters(recurse=False):
                        yield sub, p
