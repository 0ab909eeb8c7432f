"""Checkpoints of ``labkit train``: written atomically, read back with ``weights_only=True``, and refused with
one message that every rank words alike (so a torchrun job prints it once, :func:`labkit.errors.report`).

A strategy decides what a checkpoint holds and where (``checkpoint.pt`` written by rank 0, or one file per rank:
:meth:`~labkit.strategies.base.Strategy.checkpoint_file`); :func:`labkit.train.run.run` decides when to write one.
With one file per rank, the ranks agree (one all-reduce of a flag per rank, at resume only) before any of them
goes on, so no rank is left waiting in a collective for a rank that stopped.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

from labkit.errors import CheckpointError
from labkit.results import atomic_write
from labkit.train.reshard import check, flat_names, param_names, resharded

_RANK_FILE = re.compile(r"checkpoint\.rank(\d+)\.pt")


def checkpoint_files(out_dir: str | Path) -> list[Path]:
    """The checkpoint files of the run in ``out_dir``: ``checkpoint.pt``, else ``checkpoint.rank{r}.pt`` in rank
    order (empty if none)."""
    out = Path(out_dir)
    if (out / "checkpoint.pt").is_file():
        return [out / "checkpoint.pt"]
    ranks = sorted(int(m[1]) for f in (out.glob("checkpoint.rank*.pt") if out.is_dir() else ())
                   if (m := _RANK_FILE.fullmatch(f.name)))
    return [out / f"checkpoint.rank{r}.pt" for r in ranks]


def remove_stale(out_dir: str | Path, strategy) -> None:
    """After a save (rank 0): the files an earlier attempt on another setup left, which this save does not
    replace (``checkpoint.pt`` beside rank files, or rank files beyond this job's ranks), so the folder holds one
    checkpoint."""
    out = Path(out_dir)
    keep = {strategy.checkpoint_file(out).name} if strategy.replicated else {
        f"checkpoint.rank{r}.pt" for r in range(strategy.env.world_size)}
    for f in [out / "checkpoint.pt", *out.glob("checkpoint.rank*.pt")]:
        if f.name not in keep and f.is_file():
            f.unlink()


def written_elsewhere(files: list[Path], strategy) -> bool:
    """Were ``files`` written by another setup than ``strategy``'s (another file set, rank count or mesh)?"""
    expected = [strategy.checkpoint_file(files[0].parent)] if strategy.replicated else [
        files[0].parent / f"checkpoint.rank{r}.pt" for r in range(strategy.env.world_size)]
    if files != expected:
        return True
    try:
        saved = torch.load(files[0], map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # a damaged file: the ordinary load names it (several exception types, as in load_checkpoint)
        return False
    mesh = strategy.mesh_key() if hasattr(strategy, "mesh_key") else None
    return isinstance(saved, dict) and saved.get("mesh") != mesh


def read_all(files: list[Path], strategy=None) -> list[dict]:
    """Every file of one checkpoint (:func:`checkpoint_files`), each through :func:`load_checkpoint`; refused in
    one line where they come from different saves or their writer does not reshard (:func:`labkit.train.reshard.
    check`, naming ``strategy``'s setup)."""
    states = [load_checkpoint(f) for f in files]
    check(states, files[0].parent, strategy)
    return states


def checkpoint_path(out_dir: Path, strategy) -> Path:
    """Where this rank's checkpoint lives: the strategy decides (``checkpoint.pt`` or one file per rank)."""
    return strategy.checkpoint_file(out_dir)


def save_training_state(path: Path, strategy, model: nn.Module, optimizer, scheduler, preconditioner,
                        progress: dict, config: dict) -> None:
    """Checkpoint everything a resumed run needs, if this rank writes one.

    What the model and optimizer parts hold (whole or this rank's shard) is the strategy's
    :meth:`~labkit.strategies.base.Strategy.state_dict`; ``progress`` says where training stands
    (``{"epoch": finished epochs}``); the loop decides when to call this, on every rank. An optimizer whose state is
    split over the ranks (:mod:`labkit.optim.split`) has ``gather_state_dict()``, which every rank calls here so
    that rank 0 saves the whole state (its load keeps each rank's share).
    """
    gathered = optimizer.gather_state_dict() if hasattr(optimizer, "gather_state_dict") else None
    if not strategy.writes_checkpoint():
        return
    state = strategy.state_dict(model, optimizer)
    if gathered is not None:
        state["optimizer"] = gathered
    state.update(scheduler=scheduler.state_dict(), config=config,
                 preconditioner=preconditioner.state_dict() if preconditioner is not None else None, **progress)
    why = strategy.reshard_refusal()  # how the tensors cut the whole model, so another mesh can resume it
    state.update(layout=strategy.shard_layout(model) if why is None else None, layout_refusal=why,
                 param_names=param_names(strategy.unwrap(model), optimizer),
                 flat_names=flat_names(strategy.unwrap(model)) if why is None else {},
                 data_parallel_size=strategy.data_parallel_size)
    save_checkpoint(path, state)
    if strategy.env.is_main:
        remove_stale(path.parent, strategy)


def _ranks_where(flag: bool, strategy) -> list[int]:
    """The ranks of the job for which ``flag`` holds (every rank calls this: one all-reduce)."""
    env = strategy.env
    if not env.distributed:
        return [0] if flag else []
    mine = torch.zeros(env.world_size)
    mine[env.rank] = float(flag)
    return [r for r, v in enumerate(strategy.all_reduce_sum(mine).tolist()) if v]


def _ranks(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def checkpoint_on_every_rank(path: Path, strategy) -> bool:
    """Does the checkpoint exist? With one file per rank, either every rank has its file or it is an error; a
    strategy that reshards (:mod:`labkit.train.reshard`) takes any labkit checkpoint in the folder."""
    if strategy.reshard_refusal() is None and checkpoint_files(path.parent):
        return True
    if strategy.replicated or not strategy.env.distributed:
        return path.exists()
    have = _ranks_where(path.exists(), strategy)
    world = strategy.env.world_size
    if 0 < len(have) < world:
        missing = [r for r in range(world) if r not in have]
        raise CheckpointError(f"{_ranks(missing)} of this {world}-rank job find{'s' if len(missing) == 1 else ''} no "
                              f"checkpoint file in {path.parent} "
                              f"({len(have)} do): it was written by a run of another rank count, or the set is "
                              "incomplete; resume with the rank count that wrote it, or delete "
                              f"{path.parent}/checkpoint.rank*.pt or run without --resume")
    return bool(have)


def load_training_state(path: Path, strategy, model: nn.Module, optimizer, scheduler, preconditioner,
                        config: dict | None = None) -> dict:
    """Restore a checkpoint written by :func:`save_training_state`; return it (``state["epoch"]`` etc.).

    ``config`` (the run's ``asdict(TrainConfig)``): a checkpoint of another model or dataset is refused by name
    before its tensors are tried. With one file per rank, the ranks first agree that every file loads and fits,
    so a bad shard on one rank stops them all with the same :class:`CheckpointError`.
    """
    sharded = not strategy.replicated and strategy.env.distributed
    files = checkpoint_files(path.parent)
    if strategy.reshard_refusal() is None and files and written_elsewhere(files, strategy):
        # another mesh, rank count or strategy wrote it: every rank reads every file (the same answer everywhere)
        sharded = False
        try:
            state, error = resharded(read_all(files, strategy), strategy, model, optimizer), None
            _check_same_batch(state, config or {}, strategy.data_parallel_size)
        except CheckpointError as exc:
            state, error = None, CheckpointError(f"checkpoint in {path.parent}: {exc}")
        except Exception as exc:  # any other failure still reaches the agreement below: no rank left waiting
            state, error = None, CheckpointError(f"checkpoint in {path.parent} could not be resharded "
                                                 f"({type(exc).__name__}: {' '.join(str(exc).split())[:200]})")
        failed = _ranks_where(error is not None, strategy)  # a rank whose part does not fit: all stop
        if failed and error is None:
            error = CheckpointError(f"checkpoint in {path.parent}: {_ranks(failed)} could not cut {'its' if len(failed) == 1 else 'their'} "
                                    "part of it; resume on the setup that wrote it or start without --resume")
    else:
        try:
            state, error = load_checkpoint(path), None
        except CheckpointError as exc:
            state, error = None, exc
    if sharded:
        failed = _ranks_where(error is not None, strategy)
        if failed:
            error = CheckpointError(f"the checkpoint file of {_ranks(failed)} in {path.parent} is corrupt or not a "
                                    f"labkit checkpoint; delete {path.parent}/checkpoint.rank*.pt or run without "
                                    "--resume")
    if error is not None:
        raise error
    _check_same_run(state.get("config") or {}, config or {}, path)
    try:
        strategy.load_state_dict(model, optimizer, state)
    except CheckpointError as exc:
        error = CheckpointError(f"checkpoint in {path.parent}: {' '.join(str(exc).split())}")
    if sharded:
        failed = _ranks_where(error is not None, strategy)
        if failed and (error is None or len(failed) < strategy.env.world_size):
            error = CheckpointError(f"the checkpoint shard of {_ranks(failed)} in {path.parent} does not fit this "
                                    "run; resume with the command that wrote it, or run without --resume")
    if error is not None:
        raise error
    scheduler.load_state_dict(state["scheduler"])
    if preconditioner is not None and state.get("preconditioner") is not None:
        preconditioner.load_state_dict(state["preconditioner"])
    return state


def _check_same_batch(state: dict, config: dict, dp: int) -> None:
    """A mid-epoch position counts steps of the writer's global batch (``--batch-size`` is per data-parallel rank):
    on another data-parallel size the same step holds other samples unless the global batch is the same."""
    saved, position = state.get("config") or {}, state.get("position")
    if not position or not saved.get("batch_size") or not config.get("batch_size"):
        return
    old, new = saved["batch_size"] * state.get("data_parallel_size", 1), config["batch_size"] * dp
    if old != new:
        fix = f"--batch-size {old // dp}" if old % dp == 0 else f"a data-parallel size that divides {old}"
        raise CheckpointError(f"it stopped in epoch {state['epoch'] + 1} after step {position['step']} of global "
                              f"batches of {old} samples, and this run's global batch is {new} ({config['batch_size']} "
                              f"per rank × {dp}); resume with {fix} so that the step holds the same samples")


def _check_same_run(saved: dict, config: dict, path: Path) -> None:
    """A checkpoint of another model or dataset, or of a GPT built with another dropout or sequence length: say
    which, instead of torch's list of mismatched keys, or of training on at another dropout rate unawares."""
    for key in ("model", "dataset", "dropout", "seq_len"):
        if saved.get(key) is not None and config.get(key) is not None and saved[key] != config[key]:
            flag = "--" + key.replace("_", "-")
            raise CheckpointError(f"the checkpoint in {path.parent} holds {key} {saved[key]}, this run builds "
                                  f"{config[key]}: use {flag} {saved[key]} to continue it, or another --out, or run "
                                  "without --resume")


def save_checkpoint(path: Path, state: dict) -> None:
    """Write ``state`` atomically: a crash mid-write leaves the previous checkpoint intact."""
    atomic_write(path, lambda f: torch.save(state, f), binary=True)


def load_checkpoint(path: Path) -> dict:
    """Load a checkpoint with ``weights_only=True``; a corrupt file raises :class:`CheckpointError`."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several types for truncated/garbled files
        raise CheckpointError(f"checkpoint {path} is corrupt or not a labkit checkpoint ({type(exc).__name__}); "
                              "delete it or run without --resume") from None
    if not isinstance(state, dict) or "model" not in state or "epoch" not in state:
        raise CheckpointError(f"checkpoint {path} is not a labkit checkpoint (no model/epoch); "
                              "delete it or run without --resume")
    return state
