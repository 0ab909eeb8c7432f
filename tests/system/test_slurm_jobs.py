"""Every ``jobs/**/job_*.sh`` submitted with ``sbatch`` to a real one-node SLURM cluster.

All jobs are submitted at once in CPU mode with tiny sizes, then polled with one global timeout.
Each asks for 8 of the node's 16 advertised CPUs, so SLURM runs two at a time: most of a tiny job is
process start-up and waiting, and two overlap well on two cores. Each must end COMPLETED with exit
code 0, print a throughput line and write ``summary.json`` under the ``LABKIT_OUT`` it was given.
Scripts that run the same training several times (one per strategy or schedule) run a lean subset
here that still takes every path of the script; what the other runs train is tested elsewhere. Scripts added later are picked up by the glob; ``-k NAME`` submits
only the selected ones. ``LABKIT_SYSTEM_JOBS_TIMEOUT`` (seconds, default 600) bounds the batch.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from .jobs import JOB_MEMORY, check_finished_job, job_env, script_id, single_node_scripts
from .provision import REPO
from .slurm_cluster import TERMINAL, Job, SlurmCluster

pytestmark = pytest.mark.system

SCRIPTS = single_node_scripts()
# For the whole batch; the jobs run two at a time, so this bounds half their sum.
BATCH_TIMEOUT_S = float(os.environ.get("LABKIT_SYSTEM_JOBS_TIMEOUT", "600"))
# Per job (sbatch --time, minutes): a hung job ends as TIMEOUT and the queue moves on.
JOB_TIME_LIMIT_MIN = 8


# the lean subsets: ZeRO stage 3 and FSDP (tests/test_zero.py compares every stage with DDP), one
# pipeline schedule (both in tests/test_pipelining.py), the hybrid run without its DDP twin (job_ddp), the K-FAC
# run without its SGD baseline (the same command with --kfac-update-freq 0; job_ddp trains with SGD);
# the seed's ResNet-50 hands-on scripts at the smallest batch their micro-batches allow
LEAN = {"job_zero": {"RUNS": "zero-3 fsdp"}, "job_kfac": {"RUNS": "kfac"}, "job_pipeline": {"SCHEDULES": "1f1b"},
        "job_hybrid": {"COMPARE_DDP": "0"},
        "gpipe-job_gpipe_answer": {"BATCHSIZE": "4", "NUM_MICROBATCHES": "2"},
        "gpipe-job_gpipe_exercise": {"BATCHSIZE": "4"}, "gpipe-job_pytorch": {"BATCHSIZE": "4"}}


# Submitted first (SLURM starts jobs in submission order): the jobs that launch their ranks twice (one run per
# sharding; a check, then a benchmark), so that the batch does not end with one long job running alone.
FIRST = ("job_zero", "job_allreduce")


@pytest.fixture(scope="module")
def finished_jobs(slurm: SlurmCluster, tmp_path_factory: pytest.TempPathFactory,
                  request: pytest.FixtureRequest) -> dict[Path, tuple[Job, Path]]:
    """Submit the selected scripts, wait for all, cancel what still runs at the timeout."""
    selected = [item.callspec.params["script"] for item in request.session.items
                if getattr(item, "originalname", None) == "test_job_runs_under_sbatch"]  # honours -k
    selected.sort(key=lambda script: script_id(script) not in FIRST)  # stable: the rest keep their order
    root = tmp_path_factory.mktemp("jobs")
    jobs: dict[Path, tuple[Job, Path]] = {}
    for script in selected:
        name = script_id(script)
        out_dir = root / name
        job = slurm.submit(script, name=name, output=root / f"{name}.log",
                           env=job_env(out_dir) | LEAN.get(name, {}),
                           args=(JOB_MEMORY, f"--time={JOB_TIME_LIMIT_MIN}"), cwd=REPO)
        jobs[script] = (job, out_dir)
    start = time.monotonic()
    if not slurm.wait([job for job, _ in jobs.values()], BATCH_TIMEOUT_S):
        for job, _ in jobs.values():
            if job.state not in TERMINAL:
                slurm.cancel(job)
        slurm.wait([job for job, _ in jobs.values()], 30)
    print(f"\n{len(jobs)} SLURM jobs in {time.monotonic() - start:.0f} s:")
    for job, _ in jobs.values():
        print(f"  {job.name:<28} {job.state:<10} exit {job.info.get('ExitCode')} "
              f"run time {job.info.get('RunTime')}")
    return jobs


def test_job_scripts_exist() -> None:
    assert SCRIPTS, "no jobs/job_*.sh batch scripts found"


@pytest.mark.timeout(BATCH_TIMEOUT_S + 120)  # the first test waits for the whole batch
@pytest.mark.parametrize("script", SCRIPTS, ids=script_id)
def test_job_runs_under_sbatch(script: Path, finished_jobs: dict[Path, tuple[Job, Path]]) -> None:
    job, out_dir = finished_jobs[script]
    check_finished_job(script, job, out_dir)
