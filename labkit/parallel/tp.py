"""The ``tp`` dimension of a mesh: Megatron tensor parallelism (+ sequence parallelism) of the GPT, and of a CNN/MLP's
``Linear`` pairs.

    torchrun --nproc_per_node 2 -m labkit train --mesh tp=2 --model gpt-tiny --dataset text-sample
    torchrun --nproc_per_node 4 -m labkit train --mesh dp=2,tp=2 --sequence-parallel --model gpt-tiny ...
    torchrun --nproc_per_node 2 -m labkit train --mesh tp=2 --model mlp      # = --strategy tensor-parallel

The ranks of one ``tp`` group (neighbours: ``tp`` is the mesh's innermost dimension) hold the same batch and
each a ``1/tp`` of every block's matrices (:func:`labkit.parallel.megatron.parallelize_gpt`): attention heads,
MLP columns, vocabulary rows. The model's output is this rank's slice of the logits, so the loss is the
vocabulary-parallel cross-entropy; evaluation gathers the slices. ``--sequence-parallel`` also cuts the
activations between the layers along the sequence and sums the layer norms' gradients over the group after
backward. Bytes per step and activation memory: :mod:`labkit.parallel.megatron_cost`. With ``--dropout`` the
masks on a rank's own heads or sequence slice come from its own stream (:mod:`labkit.parallel.tp_rng`).

Any other model is built as a flat ``nn.Sequential`` and its ``Linear → elementwise… → Linear`` pairs are split
column → row (:func:`parallelize_linears`, the same layers, :mod:`labkit.parallel.layers`): one all-reduce forward
and one backward per pair; its output is whole on every rank, so the loss and evaluation are unchanged.
"""
from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn

from labkit.dist import group as kdist
from labkit.errors import ConfigError
from labkit.models.gpt import GPT, GPT_SIZES
from labkit.parallel.base import Dimension, refuse_moe
from labkit.parallel.layers import ColumnParallelLinear, RowParallelLinear
from labkit.parallel.mappings import group_size, part
from labkit.parallel.megatron import VocabParallelCrossEntropy, parallelize_gpt, sync_sequence_parallel_grads
from labkit.parallel.megatron_cost import ring_wire_bytes, tp_step_bytes

#: ``labkit train --mesh ...`` flags of this dimension, plain data read without importing it (labkit.flags)
FLAGS = [
    {"flag": "--sequence-parallel", "action": "store_true",
     "help": "tp dimension: layer norms and dropout on sequence shards, all-gather / reduce-scatter in place of "
             "the all-reduces (Korthikanti et al. 2022)"},
]
#: ``labkit advise --model gpt-*``'s mesh search (labkit.parallel.pricing): the pricing function below
ADVISOR = {"price": "labkit.parallel.tp:mesh_time"}

#: modules that act on each feature independently: a column slice can pass through them unchanged
ELEMENTWISE = (nn.ReLU, nn.GELU, nn.Tanh, nn.Sigmoid, nn.SiLU, nn.LeakyReLU, nn.ELU, nn.Identity)


def linear_pairs(layers) -> list[tuple[int, int]]:
    """``(i, j)``: the ``Linear → elementwise… → Linear`` pairs of ``layers``, in order, none sharing a layer."""
    pairs, i = [], 0
    while i < len(layers):
        j = i + 1
        while j < len(layers) and isinstance(layers[j], ELEMENTWISE):
            j += 1
        if isinstance(layers[i], nn.Linear) and j < len(layers) and isinstance(layers[j], nn.Linear):
            pairs.append((i, j))
            i = j + 1
        else:
            i += 1
    return pairs


def parallelize_linears(model: nn.Sequential, group=None, rank: int | None = None,
                        world_size: int | None = None) -> nn.Sequential:
    """Replace each ``Linear → elementwise… → Linear`` pair of a flat Sequential by column → row layers.

    A Linear left without a partner (e.g. a 10-class head) stays whole on every rank: its input and its
    output gradient are identical everywhere, so its gradient is too and it needs no communication.

    Raises:
        ConfigError: no pair to slice, or a hidden size not divisible by the world size.
    """
    layers = list(model)
    pairs = linear_pairs(layers)
    if not pairs:
        raise ConfigError("tensor-parallel found no Linear → activation → Linear pair to slice in this model; "
                          "use --model mlp")
    p = group_size(group) if world_size is None else world_size
    out, done = [], 0
    for i, j in pairs:
        hidden = layers[i].out_features
        if hidden % p:
            raise ConfigError(f"layer {i} ({layers[i]}): {hidden} features, not divisible by world size {p}; "
                              f"run on a number of ranks that divides {hidden}")
        out += [*layers[done:i], ColumnParallelLinear(layers[i], group, enter=True, rank=rank, world_size=world_size),
                *layers[i + 1:j], RowParallelLinear(layers[j], group, rank=rank, world_size=world_size)]
        done = j + 1
    # the same names as the whole model's (``fc1``, or ``0``, ``1``, ...): one checkpoint layout on every mesh
    return nn.Sequential(OrderedDict(zip((name for name, _ in model.named_children()), [*out, *layers[done:]],
                                         strict=True)))




class TensorParallel(Dimension):
    """The GPT's layers split over the ``tp`` group, the loss reduced over the vocabulary shards; or a flat
    ``nn.Sequential``'s ``Linear`` pairs split, the loss unchanged."""

    name = "tp"

    def __init__(self, mesh, options):
        super().__init__(mesh, options)
        self.sequence_parallel = bool(self.options.get("sequence_parallel"))
        self._criterion = VocabParallelCrossEntropy(self.group)
        self.vocab_size: int | None = None
        self.vocab_parallel = False  # a GPT: its output is this rank's slice of the logits
        self.whole_shapes: dict[str, tuple[int, ...]] = {}  # by name, before parallelize cut them

    def check(self, model_name: str, seq_len: int | None = None, dropout: float = 0.0) -> None:
        refuse_moe("tp", self.size, model_name, "tensor parallelism splits a dense MLP, and a mixture-of-experts "
                   "block has experts in its place")
        if not model_name.startswith("gpt"):
            if self.sequence_parallel:
                raise ConfigError(f"--mesh tp={self.size} --sequence-parallel cuts a transformer's sequence: it needs "
                                  f"--model gpt-tiny|gpt-small|gpt-100m, not {model_name}")
            return  # a CNN/MLP: its Linear pairs (parallelize checks there are some)
        cfg = GPT_SIZES.get(model_name)
        if cfg is not None and cfg.n_head % self.size:
            raise ConfigError(f"--mesh tp={self.size} does not divide {model_name}'s {cfg.n_head} attention heads; "
                              "choose a tp that does")

    def parallelize(self, model: nn.Module) -> nn.Module:
        if self.size == 1:
            return model
        self.whole_shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
        if isinstance(model, nn.Sequential):
            return parallelize_linears(model, self.group)
        if not isinstance(model, GPT):
            raise ConfigError(f"--mesh tp={self.size} needs a labkit GPT or a flat nn.Sequential, got "
                              f"{type(model).__name__}")
        self.vocab_size = self._criterion.vocab_size = model.cfg.vocab_size
        self.vocab_parallel = True
        return parallelize_gpt(model, self.group, self.sequence_parallel)

    def criterion(self, criterion: nn.Module) -> nn.Module:
        return self._criterion if self.vocab_parallel else criterion

    def sync_gradients(self, model: nn.Module) -> None:
        if self.sequence_parallel and self.size > 1:
            sync_sequence_parallel_grads(model, self.group)

    def full_output(self, out: torch.Tensor) -> torch.Tensor:
        """Evaluation: the (B, T, V) logits from every rank's (B, T, V/tp) slice (slices of unequal width padded
        to the widest for the all-gather, then cut back)."""
        if not self.vocab_parallel:
            return out
        V = self.vocab_size or out.shape[-1] * self.size
        widths = [stop - start for start, stop in (part(V, self.size, r) for r in range(self.size))]
        padded = F.pad(out, (0, widths[0] - out.shape[-1])).contiguous()
        parts = kdist.all_gather([torch.empty_like(padded) for _ in widths], padded, group=self.group)
        return torch.cat([p[..., :w] for p, w in zip(parts, widths)], dim=-1)

    def owns_metrics(self) -> bool:
        return self.rank == 0  # every rank of the group has the same loss: count it once

    @staticmethod
    def price(cfg, batch: int, seq: int, tp: int, sequence_parallel: bool = False) -> dict:
        """Bytes this rank hands to each kind of collective per step (:func:`megatron_cost.tp_step_bytes`)."""
        return tp_step_bytes(cfg, batch, seq, tp, sequence_parallel)


def mesh_time(step) -> float:
    """A mesh step's ``tp`` term (:class:`labkit.parallel.pricing.MeshStep`), ``t`` ranks of stride 1:

    ``tp = m·(w·β + (4·L_s + 2)·2(t − 1)·α)``: per micro-batch the ring's wire bytes ``w`` (:func:`ring_wire_bytes`
    of :func:`tp_step_bytes` for the stage's ``L_s`` blocks; sequence parallelism moves the same bytes) and
    ``4·L_s + 2`` collectives of ``2(t − 1)`` ring steps."""
    t = step.plan.tp
    if t == 1:
        return 0.0
    link = step.link(t, 1)
    w = ring_wire_bytes(tp_step_bytes(step.stage, step.b, step.tokens, t, step.plan.sequence_parallel, step.e), t)
    return step.plan.microbatches * (w * link.beta + (4 * step.layers + 2) * 2 * (t - 1) * link.alpha)
