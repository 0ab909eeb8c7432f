"""Every ``jobs/**/job_*.sh`` submitted with ``sbatch`` to a real SLURM cluster, one node per job.

The jobs run in CPU mode with tiny sizes, in one batch with the multi-node and pre-emption tests' jobs
(``tests/system/batch.py``: submitted at once, polled with one global timeout, lean subsets for the scripts that
repeat one training). Each must end COMPLETED with exit code 0, print a throughput line and write ``summary.json``
under the ``LABKIT_OUT`` it was given. Scripts added later are picked up by the glob; ``-k NAME`` submits only the
selected ones.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .batch import BATCH_TIMEOUT_S, Batch
from .jobs import check_finished_job, script_id, single_node_scripts

pytestmark = pytest.mark.system

SCRIPTS = single_node_scripts()


def test_job_scripts_exist() -> None:
    assert SCRIPTS, "no jobs/job_*.sh batch scripts found"


@pytest.mark.timeout(BATCH_TIMEOUT_S + 120)  # the first test waits for the whole batch
@pytest.mark.parametrize("script", SCRIPTS, ids=script_id)
def test_job_runs_under_sbatch(script: Path, slurm_batch: Batch) -> None:
    job, out_dir = slurm_batch[script_id(script)]
    assert job.info.get("NumNodes") == "1", job.describe()
    check_finished_job(script, job, out_dir)
