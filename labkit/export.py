"""``labkit export RUN OUT.pt``: a run's checkpoint as one whole file, for ``labkit sample`` and plain PyTorch.

    labkit export runs/gpt model.pt
    labkit sample --out model.pt --tokens 200

    import torch
    from labkit.models.cnn import get_model
    saved = torch.load("model.pt", weights_only=True)       # {"model", "config", "epoch"}
    model = get_model(saved["config"]["model"], ...)          # the run's model, built as labkit train built it
    model.load_state_dict(saved["model"])                     # the whole state_dict, one tensor per name

A CNN/MLP trained with tensor or pipeline parallelism is the flat ``nn.Sequential`` form of the model
(``get_model(name, ..., sequential=True)``), and its file has that form's names (``fc1.weight``, ...).

The run may have trained on any mesh whose checkpoint reshards (:mod:`labkit.train.reshard`): tensor-parallel
shards are joined, replicas read once. Nothing starts a process group; the file is written atomically. What does
not reshard (a pipeline split, ZeRO or FSDP shards, ...) is refused in one line. The parser imports no torch.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from labkit.errors import CheckpointError, ConfigError


def add_parser(sub) -> None:
    p = sub.add_parser("export", help="write a run's checkpoint as one whole model file (any mesh that reshards)",
                       description="Join a labkit train run's checkpoint (one file, or one per rank) into one file "
                                   "{'model': whole state_dict, 'config', 'epoch'} that labkit sample and "
                                   "torch.load + model.load_state_dict read.")
    p.add_argument("run", metavar="RUN", help="the run folder (labkit train --out)")
    p.add_argument("file", metavar="OUT.pt", help="the file to write")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    state = export(args.run, args.file)
    print(f"wrote {args.file}: {len(state['model'])} tensors of {state['config'].get('model') or 'the model'}, "
          f"after epoch {state['epoch']}")
    return 0


def whole_model(run: str | Path) -> dict:
    """``{"model": whole state_dict, "config", "epoch"}`` of the run in folder ``run``.

    Raises:
        ConfigError: no checkpoint there. CheckpointError: damaged, or written on a setup that does not reshard.
    """
    from labkit.train.checkpoint import checkpoint_files, read_all
    from labkit.train.reshard import whole_state

    files = checkpoint_files(run)
    if not files:
        raise ConfigError(f"{run}: no checkpoint there (checkpoint.pt or checkpoint.rank*.pt); train with "
                          "labkit train --out RUN (checkpoints are on by default)")
    try:
        states = read_all(files)
    except CheckpointError as exc:
        raise CheckpointError(f"{run}: {exc}") from None
    model, _ = whole_state(states)
    return {"model": model, "config": states[0].get("config") or {}, "epoch": states[0]["epoch"]}


def export(run: str | Path, file: str | Path) -> dict:
    """Write :func:`whole_model` of ``run`` to ``file`` atomically; return it."""
    import torch

    from labkit.results import atomic_write

    if Path(file).is_dir():
        raise ConfigError(f"{file} is a folder; name the file to write, e.g. {Path(file) / 'model.pt'}")
    state = whole_model(run)
    atomic_write(Path(file), lambda f: torch.save(state, f), binary=True)
    return state
