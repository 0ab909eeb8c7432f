"""The supervisor of ``labkit train --ft-replicas R``: it hosts the job's store, runs each replica as its own process,
restarts a replica that dies, and writes the run's timeline (:mod:`labkit.strategies.ft` is one replica).

    from labkit.train.ft_supervise import supervise
    report = supervise(cfg)          # cfg.strategy == "ft"; returns what <out>/ft.json holds

Replicas are forked from this process (torch is imported once), each running :func:`labkit.train.run.run` with
``--ft-replica r --ft-store HOST:PORT`` and its own results folder ``<out>/replica<r>``; their per-step records go to
``<out>/ft_replica<r>.jsonl``. A replica that is a mesh (``--mesh``) is that many processes, ranks of a process
group of their own (``RANK``, ``WORLD_SIZE`` and a fresh store per start, as torchrun would set them:
:mod:`labkit.dist.store`).
A replica that exits for any reason but success (a mesh: any of its processes; the others are stopped) is started
again, whole (``--ft-restarts`` times); it then asks to join and heals from a peer. After ``--ft-kill`` the supervisor also trains the uninterrupted
reference (one process, the global batch R × b, the same order, seed and learning rate: what a full quorum trains at
every step) into ``<out>/reference`` and reports the loss gap.

``<out>/ft.json`` (schema ``labkit.ft/1``): ``timeline`` (per step: its quorum's ``members``, ``committed``, the
members' mean ``loss``), ``events`` (``lost`` with the exit status, ``restarted``, ``healed`` at a step),
``committed`` and ``discarded`` counts, ``shards_trained`` of ``shards`` (replicas × steps), the final test metrics of the run and of the reference and their ``gap``.

On a cluster each replica group is its own job step (one per node) started with the hidden flags, and the store is
held by a process that outlives them: ``python -m labkit.train.ft_supervise --serve PORT`` (jobs/README.md).
"""
from __future__ import annotations

import contextlib
import copy
import json
import multiprocessing
import os
import sys
import time
from pathlib import Path

from labkit.dist.store import hosted_store
from labkit.errors import ConfigError, LabkitError, report
from labkit.results import atomic_write_text, load_run, make_dirs

SCHEMA = "labkit.ft/1"
_PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "labkit.train.run", "labkit.strategies.ft")


def supervise(cfg, poll_s: float = 0.05) -> dict:
    """Run ``cfg`` (strategy ``ft``) as its replicas, to the end; return (and write) the ``ft.json`` report."""
    import importlib

    from labkit.dist.mesh import MeshShape
    from labkit.strategies.ft import parse_kill, refuse_inside

    cfg.validate()
    options = cfg.strategy_options
    replicas = options.get("ft_replicas", 2)
    kill = parse_kill(options.get("ft_kill"), replicas)  # a bad --ft-kill: one line before any work
    width = 1  # processes per replica
    if options.get("mesh"):
        refuse_inside(options)
        width = MeshShape.parse(options["mesh"]).ranks
    if cfg.resume:
        raise ConfigError("--resume does not apply to --ft-replicas: a lost replica heals from its live peers, and a "
                          "run whose replicas all stopped starts again without --resume")
    for module in _PRELOAD:  # once here, not in every replica and restart (torch._dynamo: the optimizers' import)
        importlib.import_module(module)
    timeout = float(options.get("ft_timeout_s", 10.0))
    out = make_dirs(cfg.out_dir)
    for old in out.glob("ft_replica*.jsonl"):
        old.unlink()  # a fresh run's records
    # the stores live in processes of their own (labkit.dist.store): this one forks the replicas
    context = multiprocessing.get_context("fork")
    stores = contextlib.ExitStack()  # the job's, and one per start of a replica that is a mesh, till the end
    job = stores.enter_context(hosted_store(context))
    address = f"{job['MASTER_ADDR']}:{job['MASTER_PORT']}"
    each = f" | each a mesh {options['mesh']} of {width} processes" if width > 1 else ""
    print(f"labkit train --ft-replicas {replicas}{each} | store {address} | replicas' results in {out}/replica<r>",
          flush=True)
    started = time.monotonic()
    events: list[dict] = []
    procs = {r: _start(cfg, r, address, out, width, stores) for r in range(replicas)}
    restarts = dict.fromkeys(procs, 0)
    finished_at = None
    due: dict[int, float] = {}  # replica -> when it restarts
    while procs or due:
        time.sleep(poll_s)
        for r, group in list(procs.items()):
            codes = [p.exitcode for p in group]
            failed = next((c for c in codes if c not in (None, 0)), None)
            if failed is None and None in codes:
                continue  # running (a mesh: all its processes, or those not yet done)
            del procs[r]
            seconds = round(time.monotonic() - started, 2)
            if failed is None:
                finished_at = finished_at or time.monotonic()
                continue
            for p in group:  # a replica lives or dies whole: its other processes wait in collectives with the lost one
                if p.exitcode is None:
                    p.kill()
                    p.join()
            if failed == 2:  # a configuration error is everyone's: stop
                for other in (p for g in procs.values() for p in g):
                    other.kill()
                stores.close()
                raise SystemExit(2)
            events.append({"event": "lost", "replica": r, "exit": failed, "s": seconds})
            how = f"signal {-failed}" if failed < 0 else f"exit {failed}"
            print(f"ft: replica {r} lost ({how}) at {seconds:.1f} s; the others go on", flush=True)
            if finished_at is None and restarts[r] < options.get("ft_restarts", 3):
                restarts[r] += 1
                due[r] = time.monotonic() + options.get("ft_restart_delay_s", 0.0)
        for r, when in list(due.items()):
            if time.monotonic() >= when:
                del due[r]
                if finished_at is None:
                    procs[r] = _start(cfg, r, address, out, width, stores)
                    events.append({"event": "restarted", "replica": r, "s": round(time.monotonic() - started, 2)})
                    print(f"ft: replica {r} restarted; it heals from a peer at the next step", flush=True)
        if finished_at is not None and procs and time.monotonic() - finished_at > 2 * timeout:
            for r, group in procs.items():  # e.g. a replica restarted too late to join before the end
                for proc in group:
                    proc.kill()
                    proc.join()
                events.append({"event": "stopped at the end", "replica": r})
            procs.clear()
    stores.close()
    if finished_at is None:
        raise LabkitError(f"every replica of {out} failed; see their lines above")
    report_ = timeline(out, replicas)
    report_["events"] = events + report_.pop("healed")
    report_["final"] = _final(next(p for p in sorted(out.glob("replica*")) if (p / "summary.json").exists()))
    if kill is not None:
        shape = MeshShape.parse(options["mesh"]) if width > 1 else MeshShape()
        shards = replicas * shape["dp"] * shape["ep"]  # the data-parallel shards of a full quorum's step (ep: as dp)
        report_["reference"] = _final(_reference(cfg, shards, report_["epoch_steps"], out / "reference"))
        report_["gap"] = {k: report_["final"][k] - report_["reference"][k] for k in report_["final"]}
    report_.update(schema=SCHEMA, replicas=replicas, kill=options.get("ft_kill"),
                   seconds=round(time.monotonic() - started, 2))
    atomic_write_text(out / "ft.json", json.dumps(report_, indent=2) + "\n")
    print(summary_line(report_), flush=True)
    return report_


def _start(cfg, replica: int, address: str, out: Path, width: int,
           stores: contextlib.ExitStack) -> list[multiprocessing.Process]:
    """Replica ``replica``'s processes: one, or the ``width`` ranks of its mesh with a fresh store (entered into
    ``stores``, which the supervisor closes at the end)."""
    mine = copy.deepcopy(cfg)
    mine.out = str(out / f"replica{replica}")
    mine.strategy_options = {**cfg.strategy_options, "ft_replica": replica, "ft_store": address,
                             "ft_log": str(out / f"ft_replica{replica}.jsonl")}
    context = multiprocessing.get_context("fork")
    rendezvous = stores.enter_context(hosted_store(context)) if width > 1 else {}
    group = []
    for rank in range(width):
        ranks = ({"RANK": str(rank), "WORLD_SIZE": str(width), "LOCAL_RANK": str(rank),
                  "LOCAL_WORLD_SIZE": str(width), **rendezvous} if width > 1 else {})
        proc = context.Process(target=_replica, args=(mine, ranks), daemon=True)
        proc.start()
        group.append(proc)
    return group


def _replica(cfg, ranks: dict) -> None:
    from labkit.train.run import run

    os.environ.update(ranks)
    code = 0
    sys.stdout = open(os.devnull, "w")  # the replicas' banners and epoch lines: their run folders hold them
    sys.stderr = sys.__stderr__ or sys.stderr  # the process's own stream (a notebook kernel's would not reach it)
    try:
        run(cfg)
    except LabkitError as exc:
        code = report(exc)
    except Exception as exc:  # e.g. the store gone with its supervisor: one line, not a traceback per replica
        line = str(exc).strip().splitlines()
        print(f"labkit: replica {cfg.strategy_options['ft_replica']}: {type(exc).__name__}: "
              f"{line[0] if line else ''}", file=sys.stderr)
        code = 1
    sys.stderr.flush()
    os._exit(code)


def timeline(out: Path, replicas: int) -> dict:
    """The steps of the run from the replicas' records: per step its members, whether it was committed, their mean
    loss; the ``healed`` events; the committed and discarded counts. A replica that is a mesh has one record per
    rank (``ft_replica<r>.rank<c>.jsonl``): its loss is the mean over the ranks that hold one (a pipeline: the last
    stage; dp inside: each rank's shard), and it heals once."""
    steps: dict[int, dict] = {}
    healed, epoch_steps = {}, None
    for r in range(replicas):
        for path in sorted(out.glob(f"ft_replica{r}.jsonl")) + sorted(out.glob(f"ft_replica{r}.rank*.jsonl")):
            for line in path.read_text().splitlines():
                rec = json.loads(line)
                if rec.get("event") == "healed":
                    healed.setdefault((rec["replica"], rec["step"]), rec)
                    continue
                step = steps.setdefault(rec["step"], {"step": rec["step"], "members": rec["members"],
                                                      "committed": rec["committed"], "losses": {}})
                epoch_steps = rec["epoch_steps"]
                if step["members"] != rec["members"] or step["committed"] != rec["committed"]:
                    raise LabkitError(f"replicas disagree on step {rec['step']}: {step} vs {rec}")
                if rec["loss"] is not None:
                    step["losses"].setdefault(rec["replica"], []).append(rec["loss"])
    healed = list(healed.values())
    rows = []
    for k in sorted(steps):
        step = steps.pop(k)
        losses = [sum(ranks) / len(ranks) for ranks in step.pop("losses").values()]  # each replica's, then theirs
        rows.append({**step, "quorum": len(step["members"]), "loss": sum(losses) / len(losses)})
    committed = sum(r["committed"] for r in rows)
    trained = sum(r["quorum"] for r in rows if r["committed"])  # shards trained on, of replicas × steps
    return {"timeline": rows, "committed": committed, "discarded": len(rows) - committed,
            "shards_trained": trained, "shards": replicas * len(rows), "epoch_steps": epoch_steps,
            "healed": [{"event": "healed", "replica": h["replica"], "step": h["step"]} for h in healed]}


def _final(path: Path) -> dict:
    last = load_run(path).records_of("epoch")[-1]
    return {k: last[k] for k in ("test_loss", "test_acc", "test_ppl") if k in last}


def _reference(cfg, replicas: int, epoch_steps: int, out: Path) -> Path:
    """The uninterrupted run: one process, the global batch of a full quorum (``replicas``: its data-parallel
    shards, the replicas' meshes' own included), the same learning rate, and the replicas' ``epoch_steps`` full
    global batches per epoch (``--max-steps``: the data-parallel shards drop the last partial one), so its step k
    trains the samples of a full quorum's step k."""
    from labkit.train.run import run

    ref = copy.deepcopy(cfg)
    ref.strategy, ref.strategy_options, ref.out, ref.resume = "single", {}, str(out), False
    ref.batch_size = cfg.batch_size * replicas
    ref.max_steps = min(epoch_steps, cfg.max_steps or epoch_steps)
    if ref.scale_lr:
        ref.base_lr, ref.scale_lr = ref.base_lr * replicas, False
    with open(os.devnull, "w") as quiet:
        stdout, sys.stdout = sys.stdout, quiet
        try:
            run(ref)
        finally:
            sys.stdout = stdout
    return out


def summary_line(rep: dict) -> str:
    """``ft: 24 steps, 23 committed, 1 discarded | quorum 3 → 2 → 3 | test loss 0.41 vs 0.40 uninterrupted``."""
    sizes = []
    for row in rep["timeline"]:
        if not sizes or sizes[-1] != row["quorum"]:
            sizes.append(row["quorum"])
    line = (f"ft: {len(rep['timeline'])} steps, {rep['committed']} committed, {rep['discarded']} discarded | "
            f"quorum {' → '.join(map(str, sizes))} | {rep['shards_trained']} of {rep['shards']} shards trained")
    for e in rep["events"]:
        if e["event"] == "healed":
            line += f" | replica {e['replica']} healed at step {e['step']}"
    if "gap" in rep:
        line += (f" | test loss {rep['final']['test_loss']:.4f} vs {rep['reference']['test_loss']:.4f} "
                 f"uninterrupted (gap {rep['gap']['test_loss']:+.4f})")
    return line


def serve(port: int) -> None:
    """Hold the job's store on ``port`` until killed (a cluster's replica groups connect to it)."""
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore("0.0.0.0", port, None, True, datetime.timedelta(seconds=60), False)
    print(f"labkit ft store on port {store.port}", flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    if sys.argv[1:2] != ["--serve"] or len(sys.argv) != 3 or not sys.argv[2].isdigit():
        raise SystemExit(report(ConfigError("usage: python -m labkit.train.ft_supervise --serve PORT")))
    serve(int(sys.argv[2]))

