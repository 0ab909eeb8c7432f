"""What the job-script tests share: finding the scripts, the environment they run with, and
what a finished job must show.

The conventions are written down for script authors in ``jobs/README.md``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from .provision import REPO, python_env
from .slurm_cluster import Job, requested_nodes

JOBS = REPO / "jobs"
JUPYTER_JOB = JOBS / "job_jupyter.sh"
MULTINODE_JOB = JOBS / "job_ddp_multinode.sh"

# A throughput line: the training meters' "... 692.340 samples/sec", or a bandwidth for
# communication benchmarks ("busbw 1.234 GB/s").
THROUGHPUT = re.compile(r"\d samples/sec|\d\s*[GM]B/s")
# A script whose header says "# results: none" writes no results file (the seed's plain scripts).
NO_RESULTS = re.compile(r"^#\s*results:\s*none\b", re.MULTILINE)
# A script with nothing to continue after a pre-emption (a benchmark, the seed's plain scripts) says so with a
# header line "# pre-emption: none (why)"; every other one checkpoints and requeues through run_ranks.
PREEMPTION_NONE = re.compile(r"^#\s*pre-emption:\s*none\b", re.MULTILINE)


# A script names no memory, which SLURM reads as the whole node's: tests ask for a share, so that jobs are
# placed by their CPUs (8, all that each test node advertises: one job per node at a time).
JOB_MEMORY = "--mem=8G"


def job_scripts() -> list[Path]:
    """Every ``job_*.sh`` under ``jobs/`` (sub-folders too), sorted."""
    return sorted(JOBS.rglob("job_*.sh"))


def script_id(script: Path) -> str:
    """``gpipe/job_gpipe_answer.sh`` -> ``gpipe-job_gpipe_answer``: a job and folder name."""
    return str(script.relative_to(JOBS).with_suffix("")).replace("/", "-")


def single_node_scripts() -> list[Path]:
    """Batch jobs for the one-node cluster: all but the Jupyter one and those asking >1 node."""
    return [s for s in job_scripts() if s != JUPYTER_JOB and requested_nodes(s) == 1]


def multinode_scripts() -> list[Path]:
    """Jobs that ask for several nodes, and always the multi-node DDP job (present or not)."""
    return sorted({s for s in job_scripts() if requested_nodes(s) > 1} | {MULTINODE_JOB})


def job_env(out_dir: Path) -> dict[str, str]:
    """The environment a job is submitted with (``sbatch --export=ALL``).

    ``LABKIT_QUICK=1``: tiny CPU sizes; ``SBATCH_GRES=none``: drop the GPU request;
    ``LABKIT_OUT``: where the job writes its results; this interpreter's bin dir first on PATH.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    return python_env(LABKIT_QUICK="1", SBATCH_GRES="none", LABKIT_OUT=str(out_dir))


def check_finished_job(script: Path, job: Job, out_dir: Path) -> list[dict]:
    """Assert the job succeeded, printed a throughput line and wrote its results.

    Returns the ``summary.json`` contents found under ``out_dir`` (sub-folders included).
    """
    assert job.state == "COMPLETED" and job.exit_code == 0, job.describe()
    log = job.log()
    assert THROUGHPUT.search(log), f"no throughput line ('N samples/sec' or 'N GB/s'):\n{job.describe()}"
    if NO_RESULTS.search(script.read_text()):
        return []
    summaries = [json.loads(p.read_text()) for p in sorted(out_dir.rglob("summary.json"))]
    assert summaries, f"no summary.json under LABKIT_OUT={out_dir}:\n{job.describe()}"
    for summary in summaries:
        assert str(summary.get("schema", "")).startswith("labkit.run/"), (
            f"summary.json is not in the labkit results schema: {summary}")
    return summaries
