"""The hybrid strategy FlexFlow found for AlexNet on two GPUs (seed 000), written with torch.distributed.

Convolutions have few weights and big activations: data parallel is cheap for them. Fully-connected
layers have many weights and small activations: replicating them would all-reduce most of the model
every step. So:

* ``model.features`` (convolutions) is replicated; each rank runs it on its own shard of the batch;
* the features are gathered to rank 0, which alone holds ``model.classifier`` (FC layers) and the loss;
* rank 0 scatters the gradient w.r.t. the features back, each rank finishes the backward of its shard,
  and the convolution gradients are all-reduced.

    torchrun --nproc_per_node 2 -m labkit train --strategy hybrid --model alexnet_small --dataset cifar10

The math: the loss is the mean over the global batch of ``W·B`` samples, ``L = 1/(W·B) Σ_n ℓ_n``, computed
on rank 0. The gradient rank 0 scatters to rank r already carries the ``1/(W·B)`` factor, so rank r's
convolution gradient is its shard's share of ∇L and the full gradient is their **sum** (DDP divides by W
instead because each of its ranks starts from its own mean ``1/B Σ ℓ_n``; the two are the same average).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset, Sampler

from labkit.advisor.plan import Estimate
from labkit.advisor.topology import allreduce_time, common_terms, compute_scale, memory_terms, message_time
from labkit.dist import group as kdist
from labkit.errors import ConfigError
from labkit.parallel.data_parallel import DataParallelStrategy, average_gradients, broadcast_from_rank0

#: ``labkit advise`` (labkit.advisor.search): ``p`` ranks, the features' batch split over them
ADVISOR = {"price": "labkit.strategies.hybrid:price_hybrid", "plans": "spread", "batch": "split"}
#: ``labkit bench suite``: a model split into .features/.classifier, so alexnet_small on synthetic-cifar10
BENCH = {"ranks": 2, "flags": ["--model", "alexnet_small", "--dataset", "synthetic-cifar10", "--base-lr", "0.01"]}


class HybridStrategy(DataParallelStrategy):
    """Replicated ``features`` with data-parallel shards, ``classifier`` and loss on rank 0.

    Checkpoints (``replicated = False``): every rank writes ``checkpoint.rank{r}.pt``. Rank 0's file holds
    the whole model (it loads into the single-device model as is); rank r > 0 holds only ``features.*``,
    identical to rank 0's, and its own optimizer state. Evaluation runs on rank 0 alone: it holds every
    layer, so it needs no communication (the other ranks' ``forward`` returns ``None``).
    """

    name = "hybrid"
    replicated = False

    def __init__(self, env, options=None):
        super().__init__(env, options)
        self.num_classes = 0
        self._sizes_group = None  # where the shard sizes meet: a CPU (gloo) group, so reading them waits for no GPU

    @property
    def _root(self) -> bool:
        return self.env.rank == 0

    def prepare(self, model: nn.Module) -> nn.Module:
        if not isinstance(getattr(model, "features", None), nn.Module) or \
                not isinstance(getattr(model, "classifier", None), nn.Module):
            raise ConfigError(f"hybrid needs a model with .features (convolutions, replicated) and .classifier "
                              f"(FC layers, rank 0), got {type(model).__name__}; use --model alexnet_small")
        linears = [m for m in model.classifier.modules() if isinstance(m, nn.Linear)]
        if not linears:
            raise ConfigError("hybrid: model.classifier has no nn.Linear layer to keep on rank 0")
        self.num_classes = linears[-1].out_features
        model = model.to(self.env.device)
        if self.env.distributed:
            if dist.get_backend() != "gloo":
                self._sizes_group = dist.new_group(backend="gloo")  # every rank prepares: a collective call
            broadcast_from_rank0(model.features)  # every rank starts from rank 0's convolutions, whatever its seed
            if not self._root:
                model.classifier = None  # the FC weights live on rank 0 only
        return model

    def sampler(self, dataset: Dataset, train: bool, seed: int) -> Sampler | None:
        if not train:
            return None  # evaluation: rank 0 walks the whole test set; the others pass over it without computing
        return super().sampler(dataset, train, seed)

    def forward(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        return model(x) if self._root else None

    def forward_backward(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                         criterion: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.env.distributed:
            return super().forward_backward(model, x, y, criterion)
        sizes = self._sizes(len(x))
        f = model.features(x)                          # (B_r, C, H, W) this rank's shard
        feats = self._gather(f.detach(), sizes)        # rank 0: (ΣB_r, C, H, W)
        targets = self._gather(y, sizes)               # rank 0: (ΣB_r,)
        grad = logits = None
        if self._root:
            feats.requires_grad_()
            out = model.classifier(torch.flatten(feats, 1))  # (ΣB_r, num_classes)
            criterion(out, targets).backward()
            grad, logits = feats.grad, out.detach()
        f.backward(self._scatter(grad, sizes, f.shape[1:], f.dtype))  # ∂L/∂f of this shard
        # each rank gets its own logits back only to count its metrics (B_r × classes: tiny)
        out_r = self._scatter(logits, sizes, (self.num_classes,), f.dtype)
        return criterion(out_r, y).detach(), out_r

    def sync_gradients(self, model: nn.Module) -> None:
        if not self.env.distributed:
            return
        # Σ_r, not the mean: each shard's gradient is already its share of the global mean (see the module doc)
        average_gradients(model.features.parameters(), average=False)

    # ----- moving rows of the batch between the ranks and rank 0 --------------------------------------

    def _sizes(self, n: int) -> list[int]:
        """Every rank's rows this step (shards may differ). Gathered in host memory over a gloo group: on GPUs,
        reading sizes gathered on the device would wait for every kernel queued before them, every step."""
        sizes = torch.zeros(self.env.world_size, dtype=torch.int64)
        kdist.all_gather_tensor(sizes, torch.tensor([n], dtype=torch.int64), group=self._sizes_group)
        return sizes.tolist()

    def _gather(self, t: torch.Tensor, sizes: list[int]) -> torch.Tensor | None:
        """Every rank's rows, in rank order, on rank 0 (padded to the largest shard on the wire)."""
        m = max(sizes)
        padded = t if len(t) == m else torch.cat([t, t.new_zeros((m - len(t), *t.shape[1:]))])
        parts = [torch.empty_like(padded) for _ in sizes] if self._root else None
        kdist.gather(padded.contiguous(), parts, dst=0)
        return torch.cat([p[:n] for p, n in zip(parts, sizes)]) if self._root else None

    def _scatter(self, t: torch.Tensor | None, sizes: list[int], tail: tuple, dtype: torch.dtype) -> torch.Tensor:
        """Rank 0's rows ``t`` split back to the ranks they came from: (ΣB_r, *tail) -> (B_r, *tail)."""
        m = max(sizes)
        out = torch.empty((m, *tail), dtype=dtype, device=self.env.device)
        parts = None
        if self._root:
            parts = [c if len(c) == m else torch.cat([c, c.new_zeros((m - len(c), *tail))])
                     for c in t.split(sizes)]
            parts = [c.contiguous() for c in parts]
        kdist.scatter(out, parts, src=0)
        return out[:sizes[self.env.rank]]


def price_hybrid(plan, prof, topo) -> Estimate:
    """Seed 000's placement: features ``F`` data parallel on ``p`` ranks (``b = B/p``), classifier ``C`` on rank 0.

    Rank 0's step: ``compute = s·(T_F(b) + T_C(B))``; ``communication = 2(p−1)·msg(b·A_F)`` (gather the
    features, scatter their gradients) ``+ (p−1)·msg(b·classes·4)`` (logits back) ``+ AR(P_F, native, p)``;
    memory ``3P + M_F(b) + M_C(B) + 2·B·A_F + P_F`` (gathered features and their gradient, flat grads).
    """
    if prof.feature_layers is None:
        return Estimate(plan, note="needs a model with .features and .classifier (alexnet_small)")
    p, B = plan.processes, plan.batch_size
    b = B / p
    F, C = range(prof.feature_layers), range(prof.feature_layers, len(prof.layers))
    feat = prof.layers[prof.feature_layers - 1].out_bytes
    logits = prof.layers[-1].out_bytes
    comm = (2 * (p - 1) * message_time(b * feat, topo, p) + (p - 1) * message_time(b * logits, topo, p)
            + allreduce_time(prof.params(F), p, "native", topo))
    time = {"compute": compute_scale(topo, p, prof) * (prof.time(b, F) + prof.time(B, C)), "communication": comm,
            **common_terms(prof, topo, prof.param_bytes, b)}
    memory = memory_terms(prof, topo, prof.param_bytes, prof.saved_bytes(b, F) + prof.saved_bytes(B, C),
                     2 * B * feat + prof.params(F))
    return Estimate(plan, time, memory)
