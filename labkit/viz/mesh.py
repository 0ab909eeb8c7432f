"""What every rank of a ``--mesh`` holds and sends: measured on real gloo ranks, then drawn (notebook 09).

    facts = run_ranks(rank_facts, 4, "dp=2,tp=2", vocab_size=103, batch=4, seq_len=32)   # one dict per rank
    plot_mesh({"dp": 2, "tp": 2}); plot_shards(facts); plt.show()

:func:`rank_facts` builds the GPT on the mesh through :class:`labkit.parallel.mesh.MeshStrategy` (the code
``labkit train --mesh`` runs), then, on each rank: where it sits on the mesh, which rows and columns of each
weight it holds (found by locating its tensor in the whole model's), the bytes it hands to each collective in
one training step (``forward_backward`` and ``sync_gradients``, counted per process group), the bytes its
pipeline sends point to point, and the bytes one transformer block saves for backward (every saved storage
once, parameters left out). The pictures only draw those facts.
"""
from __future__ import annotations

import math

#: weights drawn by :func:`plot_shards`: the embedding, attention's q and output projection, the MLP's two
WEIGHTS = ("tok_emb.weight", "blocks.0.attn.q.weight", "blocks.0.attn.proj.weight", "blocks.0.mlp.fc.weight",
           "blocks.0.mlp.proj.weight", "blocks.1.mlp.fc.weight")
#: the kinds of collective counted (the reduce-scatter: under the name this torch gives it)
_COUNTED = ("all_reduce", "all_gather", "reduce_scatter")


def _locate(local, full) -> tuple[int, int, int, int] | None:
    """``(row0, row1, col0, col1)`` of ``full`` (2-D) that equals ``local``; None if no contiguous block does."""
    import torch

    rows, cols = local.shape
    for r0 in range(full.shape[0] - rows + 1):
        for c0 in range(full.shape[1] - cols + 1):
            if torch.equal(full[r0:r0 + rows, c0:c0 + cols], local):
                return r0, r0 + rows, c0, c0 + cols
    return None


def _saved_bytes(module, x) -> int:
    """Bytes of the tensors ``module``'s forward saves for backward, each storage once, parameters left out."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x)
    return sum(seen.values())


def rank_facts(env, mesh: str, vocab_size: int, batch: int, seq_len: int, sequence_parallel: bool = False,
               model: str = "gpt-tiny", microbatches: int = 2) -> dict:
    """On one rank of ``mesh`` (e.g. ``"dp=2,tp=2"``): coordinates, weight regions, bytes per step, activations.

    ``batch`` is the rank's data-parallel batch (``labkit train --batch-size``). Returns ``coords``,
    ``regions`` (``{weight: (row0, row1, col0, col1)}`` of the whole weight, for :data:`WEIGHTS` this rank
    holds), ``shapes`` (the whole model's), ``bytes`` (``{group: {collective: bytes}}`` handed to each, groups
    named by their mesh dimension), ``p2p`` (bytes the pipeline sent), ``params`` (elements of the parameters
    it holds) and ``block_saved`` (bytes one block saves for backward, its input shaped as this rank's
    activations).
    """
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from labkit.dist import group as kdist
    from labkit.models import cnn as kmodels
    from labkit.models.gpt import Block
    from labkit.parallel.mesh import MeshStrategy
    from labkit.train.tasks import get_task

    options = {"mesh": mesh, "sequence_parallel": sequence_parallel, "num_microbatches": microbatches}
    strategy = MeshStrategy(env, options)
    strategy.check_model(model)
    torch.manual_seed(0)
    whole = kmodels.get_model(model, num_classes=vocab_size, seq_len=seq_len)
    full = {n: p.detach().clone() for n, p in whole.named_parameters()}
    torch.manual_seed(0)
    net = strategy.prepare(kmodels.get_model(model, num_classes=vocab_size, seq_len=seq_len))
    regions = {}
    for name, p in net.named_parameters():
        name = name.removeprefix("module.")
        if name in WEIGHTS:
            regions[name] = _locate(p.detach(), full[name])
    groups = {id(d.group): d.name for d in strategy.dims}
    if isinstance(net, DistributedDataParallel):  # PyTorch's own hook: the same all-reduce, called from Python
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        net.register_comm_hook(net.process_group, allreduce_hook)
    if strategy.pipeline is not None and strategy.pipeline.embedding_group is not None:
        groups.setdefault(id(strategy.pipeline.embedding_group), "pp")
    counted: dict[str, dict[str, int]] = {}
    called = {"all_reduce": "all_reduce", "all_gather": "all_gather", "reduce_scatter": kdist.REDUCE_SCATTER_TENSOR}
    originals = {called[n]: getattr(dist, called[n]) for n in _COUNTED}

    def wrap(name, fn):
        def counting(*args, **kwargs):
            tensor = args[1] if name == "all_gather" else args[0]
            group = groups.get(id(kwargs.get("group")), "world")
            per_op = counted.setdefault(group, {})
            per_op[name] = per_op.get(name, 0) + tensor.numel() * tensor.element_size()
            return fn(*args, **kwargs)
        return counting

    g = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, vocab_size, (batch, seq_len), generator=g) for _ in range(2))
    p2p = {"bytes": 0}
    criterion = get_task("lm").criterion()
    for n in _COUNTED:
        setattr(dist, called[n], wrap(n, originals[called[n]]))
    try:
        if strategy.pipeline is not None:
            from labkit.parallel.pp import p2p_bytes_sent

            with p2p_bytes_sent() as p2p:
                strategy.forward_backward(net, x, y, criterion)
        else:
            strategy.forward_backward(net, x, y, criterion)
        strategy.sync_gradients(net)
    finally:
        for n, fn in originals.items():
            setattr(dist, n, fn)
    block = next(m for m in net.modules() if isinstance(m, Block))
    tp = strategy.shape["tp"]
    rows = seq_len // tp if sequence_parallel else seq_len
    block_in = torch.randn(batch, rows, whole.cfg.n_embd, requires_grad=True)
    return {"rank": env.rank, "coords": strategy.shape.coordinates(env.rank), "shape": strategy.shape,
            "regions": regions, "shapes": {n: tuple(t.shape) for n, t in full.items() if n in WEIGHTS},
            "bytes": counted, "p2p": p2p["bytes"], "block_saved": _saved_bytes(block, block_in),
            "block_input": tuple(block_in.shape), "cfg": whole.cfg,
            "params": sum(p.numel() for p in net.parameters())}


def train_and_facts(env, cfg, vocab_size: int) -> dict:
    """Train ``cfg`` (a :class:`labkit.train.run.TrainConfig` with ``strategy="mesh"``: what ``labkit train
    --mesh`` builds from its flags) through ``labkit.train.run.run`` on this rank's process group, its results
    written to ``cfg.out`` as usual, then return this rank's :func:`rank_facts` of the same mesh: one start of
    the ranks for both."""
    from labkit.train.run import run

    run(cfg, env=env)
    opts = cfg.strategy_options
    return rank_facts(env, opts["mesh"], vocab_size, cfg.batch_size, cfg.seq_len,
                      opts.get("sequence_parallel", False), cfg.model, opts.get("num_microbatches", 2))


def _layout(shape: dict[str, int]) -> tuple[list[str], int, int]:
    """The named dimensions (size > 1, mesh order), and the grid: rows = all but the last, columns = the last."""
    named = [n for n, s in shape.items() if s > 1] or ["dp"]
    cols = shape.get(named[-1], 1)
    return named, math.prod(shape[n] for n in named) // cols, cols


def plot_mesh(shape: dict[str, int], axes=None):
    """The ranks on the grid, once per named dimension: each rank in its own colour (the colour it has in every
    picture of the kit, :func:`labkit.viz.allreduce.rank_color`), with its coordinate along the dimension and its
    group of the dimension written in (a group: the ranks that differ only in that coordinate)."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    from labkit.dist.mesh import MeshShape
    from labkit.viz.allreduce import rank_color
    from labkit.viz.figcheck import unlabelled

    shape = MeshShape(shape)
    named, rows, cols = _layout(shape)
    if axes is None:
        _, axes = plt.subplots(1, len(named), figsize=(2.2 * len(named) + 0.4 * cols, 0.6 * rows + 1.2),
                               squeeze=False)
        axes = axes[0]
    for ax, dim in zip(axes, named):
        groups: dict[tuple, int] = {}
        for rank in range(rows * cols):
            row, col = divmod(rank, cols)
            coords = shape.coordinates(rank)
            group = groups.setdefault(tuple(v for d, v in coords.items() if d != dim), len(groups))
            ax.add_patch(Rectangle((col - 0.45, row - 0.4), 0.9, 0.8, facecolor=rank_color(rank), alpha=0.3,
                                   edgecolor=rank_color(rank)))
            ax.text(col, row, f"rank {rank}\n{dim} {coords[dim]}, group {group}", ha="center", va="center",
                    fontsize=7.5)
        ax.set_xlim(-0.5, cols - 0.5), ax.set_ylim(rows - 0.5, -0.5)
        ax.set_xticks([]), ax.set_yticks([])
        ax.set_title(f"{dim}: coordinate and group", fontsize=9)
        unlabelled(ax, "a diagram of the ranks")
    return axes


def plot_shards(facts: list[dict], weights=WEIGHTS, axes=None):
    """Each weight as its whole (rows × columns) rectangle, with the part each rank holds outlined and labelled
    with the ranks that hold it, filled in their colours (:func:`labkit.viz.allreduce.rank_color`, one stripe
    per rank where replicas share a part); a weight a rank does not hold (a pipeline stage without it) is left
    out for that rank."""
    import matplotlib.patches as patches
    import matplotlib.pyplot as plt

    from labkit.viz.allreduce import rank_color

    shapes = facts[0]["shapes"]
    if axes is None:
        _, axes = plt.subplots(1, len(weights), figsize=(2.3 * len(weights), 2.6))
    for ax, name in zip(axes, weights):
        rows, cols = shapes[name]
        holders: dict[tuple, list[int]] = {}
        for f in facts:
            region = f["regions"].get(name)
            if region is not None:
                holders.setdefault(region, []).append(f["rank"])
        for (r0, r1, c0, c1), ranks in sorted(holders.items()):
            width = (c1 - c0) / len(ranks)  # one stripe per rank holding the part, in that rank's colour
            for k, rank in enumerate(ranks):
                ax.add_patch(patches.Rectangle((c0 + k * width, r0), width, r1 - r0, facecolor=rank_color(rank),
                                               alpha=0.35, edgecolor="none"))
            ax.add_patch(patches.Rectangle((c0, r0), c1 - c0, r1 - r0, facecolor="none", edgecolor="k"))
            ax.text((c0 + c1) / 2, (r0 + r1) / 2, "ranks\n" + ",".join(map(str, ranks)), ha="center",
                    va="center", fontsize=7)
        ax.set_xlim(0, cols), ax.set_ylim(rows, 0)
        ax.set_title(f"{name.replace('.weight', '')}\n({rows} × {cols})", fontsize=8)
        ax.set_xticks([0, cols]), ax.set_yticks([0, rows])
        ax.set_xlabel("column", fontsize=7, labelpad=-6), ax.set_ylabel("row", fontsize=7, labelpad=-6)
        ax.tick_params(labelsize=7)
    return axes
