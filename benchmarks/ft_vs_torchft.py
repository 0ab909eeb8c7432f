"""``--ft-replicas`` checked against torchft (when it is installed): the same replicas, shards, model and optimizer
trained under torchft's Manager (a lighthouse, a quorum per step, its gloo process group) and under labkit's
uninterrupted reference (one process, the full quorum's global batch), which ``labkit train --ft-replicas`` equals
step for step; then the largest weight difference. With ``--kill-at S`` replica 1 of torchft's run also dies in step
S and restarts (it heals from replica 0 over torchft's checkpoint transport): the quorum sizes per step are printed.

Measured (torch 2.14.1, torchft 0.2.0, 2 replicas, 12 steps, no kill): 3.7e-08, the float-rounding of the two
summation orders. With ``--init-sync`` 0.043: torchft's first quorum heals replica 1 from replica 0, and a healing
replica adds a zero gradient to the step it heals in (labkit's joiner loads the state before its step and adds its
own gradient). With ``--steps 30 --kill-at 4 --step-delay-s 1``: quorum 2 for steps 0-3, 1 for steps 4-13 (the
failed step is tried again on its batch here, as torchft's step count stays; labkit discards it and moves on),
replica 1 healed at step 14, 2 after.

    pip install torchft                                    # not a labkit dependency
    python benchmarks/ft_vs_torchft.py --replicas 2 --steps 12
    python benchmarks/ft_vs_torchft.py --replicas 2 --steps 30 --kill-at 4 --step-delay-s 1
"""
from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

ARGS = ["--model", "mlp", "--dataset", "synthetic-mnist", "--train-size", "400", "--test-size", "100",
        "--batch-size", "16", "--base-lr", "0.2"]


def _replica(replica: int, replicas: int, steps: int, lighthouse: str, kill_at: int | None, out: str, barrier,
             delay: float) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.utils.data import DistributedSampler
    from torchft import Manager, ProcessGroupGloo
    from torchft.optim import OptimizerWrapper

    from labkit.data import loader as loaders
    from labkit.data.tensor import load_split
    from labkit.dist.group import seed_everything
    from labkit.models import cnn
    from labkit.train.cli import config_from_argv

    cfg = config_from_argv([*ARGS, "--steps", str(steps)])
    seed_everything(cfg.seed)  # what labkit's run does before it builds the data and the model
    data = load_split(loader="tensor", name=cfg.dataset, root=None, download=False, device=torch.device("cpu"),
                      seq_len=None, train=True, augment=False, limit=cfg.train_size)
    load_split(loader="tensor", name=cfg.dataset, root=None, download=False, device=torch.device("cpu"),
               seq_len=None, train=False, limit=cfg.test_size)  # as run does: the same random state after it
    model = cnn.get_model(cfg.model, num_classes=10, in_channels=1, image_size=28)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.base_lr, momentum=cfg.momentum)
    sampler = DistributedSampler(data, num_replicas=replicas, rank=replica, shuffle=True, seed=cfg.seed,
                                 drop_last=True)
    batches = loaders.make_loader(data, cfg.batch_size, shuffle=True, sampler=sampler, seed=cfg.seed, drop_last=True)
    store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=30), False)
    manager = Manager(pg=ProcessGroupGloo(timeout=datetime.timedelta(seconds=10)),
                      load_state_dict=lambda s: (model.load_state_dict(s["model"]), optimizer.load_state_dict(s["opt"])),
                      state_dict=lambda: {"model": model.state_dict(), "opt": optimizer.state_dict()},
                      min_replica_size=1 if kill_at is not None else replicas, rank=0, world_size=1, store_addr="127.0.0.1", store_port=store.port,
                      lighthouse_addr=lighthouse, replica_id=f"replica{replica}", timeout=datetime.timedelta(seconds=10),
                      init_sync=os.environ.get("LABKIT_TORCHFT_INIT_SYNC") == "1")
    wrapped = OptimizerWrapper(manager, optimizer)
    if barrier is not None:
        barrier.wait(120)  # every replica heartbeating before the first quorum (a restart does not wait)
    quorums = []
    epoch, listed = -1, []
    while manager.current_step() < steps:
        step = manager.current_step()  # a discarded step is tried again on the same batch
        if step // len(batches) != epoch:
            epoch = step // len(batches)
            loaders.set_loader_epoch(batches, epoch, cfg.seed)
            listed = list(batches)
        x, y = listed[step % len(batches)]
        wrapped.zero_grad()
        F.cross_entropy(model(x), y).backward()
        if kill_at is not None and replica == 1 and step == kill_at and not os.environ.get("RESTARTED"):
            os.kill(os.getpid(), signal.SIGKILL)
        for p in model.parameters():  # the mean over the participants, as labkit's quorum takes it
            manager.allreduce(p.grad, reduce_op=dist.ReduceOp.SUM).wait()
            p.grad /= manager.num_participants()
        wrapped.step()
        quorums.append((step, manager.num_participants()))
        time.sleep(delay)
    torch.save(model.state_dict(), Path(out) / f"torchft{replica}.pt")
    (Path(out) / f"torchft{replica}.json").write_text(json.dumps(quorums))
    manager.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=2, help="replica groups (one process each)")
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps")
    parser.add_argument("--kill-at", type=int, default=None, help="replica 1 dies in this step and restarts")
    parser.add_argument("--step-delay-s", type=float, default=0.0,
                        help="sleep after each step (with --kill-at: long enough for the restart to heal in time)")
    parser.add_argument("--init-sync", action="store_true",
                        help="torchft's first quorum heals the other replicas from one, which then add a zero gradient "
                             "to step 0 (its healing step): the runs part there")
    args = parser.parse_args()
    if args.replicas < 2 or args.steps < 1 or (args.kill_at is not None and not 0 < args.kill_at < args.steps):
        parser.error("--replicas must be >= 2, --steps >= 1 and --kill-at within the steps")
    os.environ["LABKIT_TORCHFT_INIT_SYNC"] = "1" if args.init_sync else "0"
    try:
        from torchft.coordination import LighthouseServer
    except ImportError:
        print("torchft is not installed (pip install torchft): nothing to compare")
        return 0
    import torch

    from labkit.train.cli import config_from_argv
    from labkit.train.ft_supervise import _reference

    out = tempfile.mkdtemp(prefix="labkit-torchft-")
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1 if args.kill_at is not None else args.replicas, join_timeout_ms=1000, quorum_tick_ms=50,
                                  heartbeat_timeout_ms=2000)
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(args.replicas)
    procs = {r: ctx.Process(target=_replica, args=(r, args.replicas, args.steps, lighthouse.address(), args.kill_at,
                                                   out, barrier, args.step_delay_s)) for r in range(args.replicas)}
    for proc in procs.values():
        proc.start()
    while any(p.is_alive() for p in procs.values()):
        time.sleep(0.2)
        if procs[1].exitcode == -signal.SIGKILL:
            os.environ["RESTARTED"] = "1"
            procs[1] = ctx.Process(target=_replica, args=(1, args.replicas, args.steps, lighthouse.address(),
                                                          args.kill_at, out, None, args.step_delay_s))
            procs[1].start()
    lighthouse.shutdown()
    cfg = config_from_argv(["--ft-replicas", str(args.replicas), *ARGS, "--steps", str(args.steps),
                            "--out", str(Path(out) / "labkit")])
    steps_per_epoch = (400 // args.replicas) // 16
    reference = torch.load(_reference(cfg, args.replicas, steps_per_epoch, Path(out) / "reference") / "checkpoint.pt",
                           weights_only=True)["model"]
    for r in range(args.replicas):
        mine = torch.load(Path(out) / f"torchft{r}.pt", weights_only=True)
        diff = max((mine[k] - reference[k]).abs().max().item() for k in mine)
        quorums = json.loads((Path(out) / f"torchft{r}.json").read_text())
        print(f"torchft replica {r}: largest weight difference to labkit's uninterrupted run {diff:.3g}; "
              f"quorum per step {[q for _, q in quorums]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
