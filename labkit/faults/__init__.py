"""Broken distributed programs to diagnose and fix: ``labkit faults list``, ``labkit faults run NAME``.

Each fault is a short plain-PyTorch training script in ``labkit/faults/programs/`` with one realistic
mistake. Its fix is a few replaced lines (:attr:`Fault.fix`), so the correct version is the broken file
with that patch applied (:func:`fixed_source`). Nothing here imports torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from labkit.errors import ConfigError

PROGRAMS = Path(__file__).resolve().parent / "programs"


@dataclass(frozen=True)
class Fault:
    """One broken program of the lab: its name and whether it hangs (the others fail silently)."""

    name: str
    hangs: bool
    summary: str
    symptom: str
    fix: tuple[tuple[str, str], ...]  # (old text, new text) pairs, each old text once in the broken file
    remedy: str = ""  # what the fixed version does (the checker compares a fix with it)
    launcher: str = "torchrun"  # "srun": the ranks get SLURM's variables only
    even_ranks: bool = False
    lost: int | None = None  # the rank the program loses on purpose (exit code faults.common.LOST): not a failure

    @property
    def path(self) -> Path:
        return PROGRAMS / f"{self.name.replace('-', '_')}.py"


_LOG_ALL = "        dist.all_reduce(correct)  # a collective: every rank joins it\n        if rank == 0:\n"
_EVAL_ALL = ("        accuracy = evaluate(model, test)  # evaluate() all-reduces: every rank joins\n"
             "        if rank == 0:\n            print(f\"epoch {epoch}: test accuracy {accuracy:.3f}\")\n")
_PAIRED = ("    if dist.get_rank() % 2 == 0:  # one of each pair sends first, the other receives first\n"
           "        dist.send(mine, peer)\n        dist.recv(theirs, peer)\n    else:\n"
           "        dist.recv(theirs, peer)\n        dist.send(mine, peer)\n")
_SYNC = "            if device.type == \"cuda\":  # wait for the GPU's queued kernels before reading the clock\n" \
        "                torch.cuda.synchronize()\n"

FAULTS: dict[str, Fault] = {f.name: f for f in (
    Fault("mismatched-collective", True, "rank 0 all-reduces a tensor the other ranks do not",
          "hang: rank 0 waits in all_reduce while the others wait in barrier",
          (("        if rank == 0:  # only rank 0 prints, so only rank 0 sums the counts\n"
            "            dist.all_reduce(correct)\n", _LOG_ALL),),
          remedy="every rank all-reduces the counts; only the printing stays under if rank == 0"),
    Fault("rank0-evaluates", True, "a rank-dependent branch: rank 0 alone evaluates, and evaluate() all-reduces",
          "hang: rank 0 waits in evaluate()'s all_reduce, the others in barrier",
          (("        if rank == 0:\n            print(f\"epoch {epoch}: test accuracy {evaluate(model, test):.3f}\")\n",
            _EVAL_ALL),),
          remedy="every rank calls evaluate(); only the printing stays under if rank == 0"),
    Fault("uneven-inputs", True, "uneven inputs: rank 0 has one batch more than the others",
          "hang at the last step: rank 0 all-reduces gradients that no other rank sends",
          (("DataLoader(Subset(data, mine), batch_size=BATCH)",
            "DataLoader(Subset(data, mine), batch_size=BATCH, drop_last=True)"),),
          remedy="drop_last=True on the DataLoader (DistributedSampler or join() end the hang too, on other "
                 "samples)"),
    Fault("no-set-epoch", False, "a forgotten sampler.set_epoch: every epoch sees the same order",
          "no hang: each rank sees its samples in the same order every epoch",
          (("    for epoch in range(EPOCHS):\n",
            "    for epoch in range(EPOCHS):\n        loader.sampler.set_epoch(epoch)\n"),),
          remedy="loader.sampler.set_epoch(epoch) at the start of each epoch"),
    Fault("unsynced-init", False, "each rank initialises its own random weights and nothing broadcasts them",
          "no hang: the replicas hold different weights from the first step on",
          (("    model = toy_model()\n", "    model = toy_model()\n    for p in model.parameters():  # start every "
            "replica from rank 0's weights\n        dist.broadcast(p.data, src=0)\n"),),
          remedy="after building the model, broadcast every parameter from rank 0"),
    Fault("local-rank", False, "the GPU is chosen from LOCAL_RANK, which srun does not set",
          "two ranks on one GPU (or an invalid device index on a bigger node)",
          (("int(os.environ.get(\"LOCAL_RANK\", 0))",
            "int(os.environ.get(\"LOCAL_RANK\", os.environ.get(\"SLURM_LOCALID\", 0)))"),), launcher="srun",
          remedy="the GPU index falls back to SLURM_LOCALID when LOCAL_RANK is not set"),
    Fault("unsynced-timing", False, "GPU steps timed without synchronising",
          "a too-good throughput on a GPU (on a CPU each operation finishes before it returns)",
          (("            seconds += time.perf_counter() - start\n",
            _SYNC + "            seconds += time.perf_counter() - start\n"),
           ("            start = time.perf_counter()\n", _SYNC + "            start = time.perf_counter()\n")),
          remedy="torch.cuda.synchronize() before each clock read when on a GPU"),
    Fault("nan-spreads", False, "a NaN on one rank spreads through the all-reduce to every replica",
          "no hang: every rank's loss and weights become NaN",
          (("torch.log(x_all[:, 0])", "torch.log1p(x_all[:, 0])"),),
          remedy="torch.log1p instead of torch.log for the count feature"),
    Fault("send-recv-deadlock", True, "both ranks of a pair send first", "hang: both ranks wait in send",
          (("    dist.send(mine, peer)\n    dist.recv(theirs, peer)\n", _PAIRED),), even_ranks=True,
          remedy="even ranks send first, odd ranks receive first"),
    Fault("lr-not-scaled", False, "the learning rate is not scaled with the world size",
          "no hang: slower convergence than the scaled recipe",
          (("lr=LR, momentum=0.9)", "lr=LR * dist.get_world_size(), momentum=0.9)  # the global batch grew"),),
          remedy="lr = LR * world size (linear scaling)"),
    Fault("replica-lost", False, "a replica's node dies mid-run, and plain data parallelism dies with it",
          "the survivor's next all-reduce fails (the peer's connection is closed or reset) and the job ends",
          (("    losses, step = [], 0\n", "    losses, step, peers = [], 0, True\n"),
           ("            average_gradients(model)\n            optimizer.step()\n",
            "            try:\n                if peers:\n                    average_gradients(model)\n"
            "            except RuntimeError:  # a peer is gone: discard this step, go on alone\n"
            "                peers = False\n                step += 1\n                continue\n"
            "            optimizer.step()\n"),
           ("    dist.barrier()\n", "    if peers:\n        dist.barrier()\n")),
          remedy="the failed all-reduce's step is discarded (no optimizer step) and the survivor trains on alone, "
                 "its own shard only; at the end it skips the barrier its lost peer cannot join",
          lost=1),
)}


def get(name: str) -> Fault:
    if name not in FAULTS:
        raise ConfigError(f"unknown fault {name!r}; choose one of: {', '.join(FAULTS)} (labkit faults list)")
    return FAULTS[name]


def broken_source(name: str) -> str:
    return get(name).path.read_text()


def fixed_source(name: str) -> str:
    """The broken program with its fix applied."""
    text = broken_source(name)
    for old, new in get(name).fix:
        if text.count(old) != 1:
            raise RuntimeError(f"the fix of {name} expects {old!r} once in {get(name).path.name}")
        text = text.replace(old, new)
    return text
