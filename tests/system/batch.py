"""Every SLURM job of the system tests in one batch on the two-node test cluster.

The single-node scripts (``test_slurm_jobs``), the multi-node ones (``test_slurm_multinode``) and the pre-empted
``job_ddp.sh`` (``test_slurm_preempt``) are submitted together and waited for with one timeout; the tests then read
what their jobs left. A job is mostly process start-up and waiting, so jobs that run side by side (each asks for
8 of a node's 16 advertised CPUs: up to four at once, a multi-node job counting on both nodes) overlap well on two
cores. Only the jobs of selected tests are submitted (``-k`` honoured); the pre-emption test also needs
``job_ddp``, its uninterrupted twin.

Scripts that run the same training several times (one per strategy or schedule) run a lean subset that still
takes every path of the script (``LEAN``); what the other runs train is tested elsewhere.
``LABKIT_SYSTEM_JOBS_TIMEOUT`` (seconds, default 900) bounds the batch; ``--time`` bounds each job.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from .jobs import JOB_MEMORY, JOBS, job_env, script_id
from .provision import REPO, free_port
from .slurm_cluster import TERMINAL, Job, SlurmCluster

BATCH_TIMEOUT_S = float(os.environ.get("LABKIT_SYSTEM_JOBS_TIMEOUT", "900"))
# Per job (sbatch --time, minutes): a hung job ends as TIMEOUT and the queue moves on.
JOB_TIME_LIMIT_MIN = 8

# the lean subsets: ZeRO stage 3 (tests/test_zero.py compares every stage and FSDP with DDP), one pipeline
# schedule (both in tests/test_pipelining.py), the hybrid run without its DDP twin (job_ddp), the K-FAC run without
# its SGD baseline (the same command with --kfac-update-freq 0; job_ddp trains with SGD); the seed's ResNet-50
# hands-on scripts at the smallest batch their micro-batches allow; the parameter server for 4 of its 16 steps
# (tests/test_ps.py compares its modes with one process)
LEAN = {"job_zero": {"RUNS": "zero-3"}, "job_kfac": {"RUNS": "kfac"}, "job_pipeline": {"SCHEDULES": "1f1b"},
        "job_hybrid": {"COMPARE_DDP": "0"},
        "gpipe-job_gpipe_answer": {"BATCHSIZE": "4", "NUM_MICROBATCHES": "2"},
        "gpipe-job_gpipe_exercise": {"BATCHSIZE": "4"}, "gpipe-job_pytorch": {"BATCHSIZE": "4"},
        "job_ps": {"EXTRA_ARGS": "--max-steps 4"}}

# The pre-emption test: job_ddp.sh on 2 CPU ranks × 16 samples, 12 steps per epoch, 2 epochs, run twice: "job_ddp"
# uninterrupted (the batch's job_ddp) and "warned", slowed down (which changes no result) so that SLURM's warning
# lands mid-epoch: it is sent at epoch 1's first line and must reach the ranks (scancel, slurmd, the script's trap,
# srun) 0.2 s plus two steps before the epoch's last step; the steps left of 0.6 s leave it seconds even on a busy
# machine. The resumed run finishes epoch 1 from that step and then trains all of epoch 2.
PREEMPT_ARGS = ("--model mlp --dataset synthetic-mnist --train-size 384 --test-size 32 --batch-size 16 --epochs 2 "
                "--log-every 1 --seed 4")
WARNED = "warned"
WARN_AT = "train | epoch 1/2"  # epoch 1 under way
# what a requeued job passes through is not an end; these are
WARNED_END = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"})
DDP = JOBS / "job_ddp.sh"

# Submitted first (SLURM starts jobs in submission order): the warned job, which sleeps through its slowed steps
# and its requeue while the others compute; the longest ones (two launches of ranks, or ranks and then a summary);
# the multi-node ones, which wait for room on both nodes; so that the batch does not end with one long job alone.
FIRST = ("job_allreduce", "job_kfac", "job_zero")


@dataclass
class Batch:
    """The finished jobs by name (``script_id``, or ``WARNED``), each with its ``LABKIT_OUT``."""

    jobs: dict[str, tuple[Job, Path]]
    warned_signalled: bool

    def __getitem__(self, name: str) -> tuple[Job, Path]:
        return self.jobs[name]


def selected_scripts(items: list[pytest.Item]) -> tuple[list[Path], list[Path], bool]:
    """(single-node scripts, multi-node scripts, pre-emption test selected) among the session's selected tests."""
    single, multi, preempt = [], [], False
    for item in items:
        name = getattr(item, "originalname", None)
        if name == "test_job_runs_under_sbatch":
            single.append(item.callspec.params["script"])
        elif name == "test_job_runs_on_two_nodes" and item.callspec.params["script"].exists():
            multi.append(item.callspec.params["script"])
        elif name == "test_warned_job_checkpoints_requeues_and_ends_bit_identical":
            preempt = True
    if preempt and DDP not in single:
        single.append(DDP)
    single.sort(key=lambda script: FIRST.index(script_id(script)) if script_id(script) in FIRST else len(FIRST))
    return single, multi, preempt


def run_batch(slurm: SlurmCluster, root: Path, items: list[pytest.Item]) -> Batch:
    """Submit the selected tests' jobs, wait for all (warning the pre-empted one mid-epoch), cancel what still
    runs at the timeout."""
    single, multi, preempt = selected_scripts(items)
    jobs: dict[str, tuple[Job, Path]] = {}

    def submit(script: Path, name: str, env: dict[str, str], *args: str) -> None:
        out_dir = root / name
        job = slurm.submit(script, name=name, output=root / f"{name}.log", env=job_env(out_dir) | env,
                           args=(JOB_MEMORY, f"--time={JOB_TIME_LIMIT_MIN}", *args), cwd=REPO)
        jobs[name] = (job, out_dir)

    ddp_env = {"NPROC": "2", "EXTRA_ARGS": PREEMPT_ARGS}
    if preempt:
        submit(DDP, WARNED, ddp_env | {"EXTRA_ARGS": f"{PREEMPT_ARGS} --step-delay-s 0.6"})  # the script appends
    first = sum(script_id(script) in FIRST for script in single)
    for script in single[:first]:
        submit(script, script_id(script), LEAN.get(script_id(script), {}))
    for script in multi:  # a port of its own for the rendezvous (the default derives from the job id)
        submit(script, script_id(script), {"RDZV_PORT": str(free_port())}, "--nodes=2")
    for script in single[first:]:
        submit(script, script_id(script), ddp_env if script == DDP else LEAN.get(script_id(script), {}))

    warned = jobs[WARNED][0] if preempt else None
    start = time.monotonic()
    signalled = _wait(slurm, [job for job, _ in jobs.values()], warned, BATCH_TIMEOUT_S)
    if not _done(jobs.values(), warned):
        for job, _ in jobs.values():
            if job.state not in TERMINAL:
                slurm.cancel(job)
        _wait(slurm, [job for job, _ in jobs.values()], None, 30)
    print(f"\n{len(jobs)} SLURM jobs in {time.monotonic() - start:.0f} s:")
    for job, _ in jobs.values():
        print(f"  {job.name:<28} {job.state:<10} exit {job.info.get('ExitCode')} "
              f"run time {job.info.get('RunTime')} restarts {job.info.get('Restarts')}")
    return Batch(jobs, signalled)


def _done(jobs, warned: Job | None) -> bool:
    return all(job.state in (WARNED_END if job is warned else TERMINAL) for job, _ in jobs)


def _wait(slurm: SlurmCluster, jobs: list[Job], warned: Job | None, timeout: float) -> bool:
    """Poll until every job has ended (``scontrol`` once a second; the warned job's log more often until it has
    been warned); True once the warning was sent."""
    deadline = time.monotonic() + timeout
    signalled = warned is None
    next_refresh = 0.0
    while True:
        if not signalled and WARN_AT in warned.log():
            slurm.command("scancel", "--signal=USR1", "--batch", warned.job_id)
            signalled = True
        now = time.monotonic()
        if now >= next_refresh:
            slurm.refresh_all(jobs)
            next_refresh = now + 1.0
            if _done(((job, None) for job in jobs), warned) or now > deadline:
                return signalled and warned is not None
        time.sleep(0.2 if not signalled else 1.0)
