"""The same tensor (+ sequence) parallel GPT built with PyTorch's own ``parallelize_module``: the reference the
hand-written :mod:`labkit.parallel.megatron` is checked and benchmarked against.

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    model = parallelize_gpt_dtensor(GPT(cfg), mesh["tp"], sequence_parallel=True)
    with loss_parallel():
        loss = F.cross_entropy(model(idx).flatten(0, 1), targets.flatten())   # logits: DTensor Shard(-1)

The plan is torchtitan's for a Llama block, adapted to this GPT: ``ColwiseParallel`` for q, k, v and fc,
``RowwiseParallel`` for the projections, the embedding ``RowwiseParallel`` (vocabulary rows), the tied head
``ColwiseParallel`` with its logits left sharded for ``loss_parallel``; with SP, ``SequenceParallel`` on the
layer norms, ``PrepareModuleInput`` all-gathering the sequence into attention and the MLP, the projections'
outputs reduce-scattered along it, and the position table's output cut to this rank's positions. All of these
run on gloo CPU ranks (torch 2.6 and later).
"""
from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from labkit.models.gpt import GPT


def dtensor_plan(n_layer: int, sequence_parallel: bool = False) -> dict:
    """``parallelize_module``'s plan for a :class:`labkit.models.gpt.GPT` of ``n_layer`` blocks."""
    if not sequence_parallel:
        plan = {"tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
                "head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
        for i in range(n_layer):
            plan.update({f"blocks.{i}.attn.{n}": ColwiseParallel() for n in ("q", "k", "v")})
            plan.update({f"blocks.{i}.attn.proj": RowwiseParallel(), f"blocks.{i}.mlp.fc": ColwiseParallel(),
                         f"blocks.{i}.mlp.proj": RowwiseParallel()})
        return plan
    seq = Shard(1)
    plan = {"tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
            "pos_emb": PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0)),
            "ln_f": SequenceParallel(),
            "head": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False)}
    gather = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),))
    for i in range(n_layer):
        plan.update({f"blocks.{i}.ln1": SequenceParallel(), f"blocks.{i}.ln2": SequenceParallel(),
                     f"blocks.{i}.attn": gather, f"blocks.{i}.mlp": gather,
                     f"blocks.{i}.attn.proj": RowwiseParallel(output_layouts=seq),
                     f"blocks.{i}.mlp.proj": RowwiseParallel(output_layouts=seq)})
        plan.update({f"blocks.{i}.attn.{n}": ColwiseParallel() for n in ("q", "k", "v")})
        plan[f"blocks.{i}.mlp.fc"] = ColwiseParallel()
    return plan


def parallelize_gpt_dtensor(model: GPT, mesh: DeviceMesh, sequence_parallel: bool = False) -> GPT:
    """``model`` sharded in place by ``parallelize_module`` over the 1-D ``mesh``; returns it. The head is tied
    to the embedding again afterwards (both are the (V, C) table split by rows: ``Shard(0)``)."""
    parallelize_module(model, mesh, dtensor_plan(model.cfg.n_layer, sequence_parallel))
    model.head.weight = model.tok_emb.weight
    return model
