"""The same pipeline under several schedules, measured in one fork of gloo ranks, for notebook 04b.

    runs = measure_schedules({"1F1B": {"pp_schedule": "1f1b"}, "ZB-H1": {"pp_schedule": "zb-h1"}}, ranks=4)
    runs["ZB-H1"]["trace"]      # the measured timeline (labkit.viz.pipeline reads it), as --pipeline-trace writes it
    runs["ZB-H1"]["losses"]     # the loss of every step, from the rank that holds the last stage

Each schedule trains a fresh copy of one small GPT (``n_layer`` blocks, the same seed, the same batches of the
``text-sample`` dataset) for ``steps`` steps through :func:`labkit.train.loop.fit` with ``MeshStrategy``
(``--mesh pp=<ranks>`` and the schedule's options, Adam), recording steps ``1 .. trace_steps`` on the
:class:`labkit.parallel.pp.Timeline`. One fork for all of them: the ranks import torch once.
"""
from __future__ import annotations

from labkit.dist.testing import run_ranks

CONFIG = {"n_layer": 8, "n_head": 2, "n_embd": 64, "seq_len": 32}


def measure_schedules(schedules: dict[str, dict], ranks: int = 4, steps: int = 4, trace_steps: int = 2,
                      batch: int = 16, microbatches: int = 8, timeout: float = 600.0, **config) -> dict[str, dict]:
    """``{name: {"trace", "losses"}}`` of each schedule (its options as ``labkit train`` dests, e.g.
    ``{"pp_schedule": "zbv"}``), measured on ``ranks`` forked gloo ranks."""
    results = run_ranks(_measure, ranks, schedules, steps, trace_steps, batch, microbatches, {**CONFIG, **config},
                        timeout=timeout)
    return results[0]


def _measure(env, schedules, steps, trace_steps, batch, microbatches, config) -> dict | None:
    import torch
    from torch.utils.data import DataLoader

    from labkit.data.tensor import load_split
    from labkit.models.gpt import GPT, GPT_SIZES
    from labkit.parallel.mesh import MeshStrategy
    from labkit.train.loop import fit
    from labkit.train.tasks import get_task

    seq = config["seq_len"]
    train = load_split("torch", "text-sample", True, limit=steps * batch, seq_len=seq)
    test = load_split("torch", "text-sample", False, limit=batch, seq_len=seq)
    gpt = GPT_SIZES["gpt-tiny"].replace(n_layer=config["n_layer"], n_head=config["n_head"],
                                        n_embd=config["n_embd"], block_size=seq)
    out = {}
    for name, options in schedules.items():
        strategy = MeshStrategy(env, {"mesh": f"pp={env.world_size}", "num_microbatches": microbatches,
                                      "trace_steps": trace_steps, **options})
        torch.manual_seed(0)
        model = strategy.prepare(GPT(gpt))
        losses, inner = [], strategy.forward_backward

        def recorded(*args, inner=inner, losses=losses):
            loss, result = inner(*args)
            losses.append(None if loss is None else float(loss))
            return loss, result
        strategy.forward_backward = recorded
        loader = DataLoader(train, batch_size=batch, sampler=strategy.sampler(train, True, 0))
        optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
        fit(model, loader, DataLoader(test, batch_size=batch), optimizer, epochs=1, strategy=strategy,
            task=get_task("lm"), printer=lambda line: None)
        trace = strategy.pipeline.trace()
        owner = [None] * env.world_size
        torch.distributed.all_gather_object(owner, losses if strategy.metric_owner() else None)
        if env.rank == 0:
            out[name] = {"trace": trace, "losses": next(x for x in owner if x is not None)}
    return out if env.rank == 0 else None
