"""Multi-node jobs on two emulated nodes: two ``slurmd -N node1|node2`` on this host.

``node1`` and ``node2`` resolve to 127.0.0.1 through a line added to /etc/hosts for the session
and removed afterwards, so the job's rendezvous host (the first node of the allocation) is
reachable; the ranks talk over gloo. Every script whose ``#SBATCH`` asks for more than one node
runs here (one rank per node), and ``jobs/job_ddp_multinode.sh`` always does. The jobs run in the
session's batch (``tests/system/batch.py``), each on 8 of the 16 CPUs of both nodes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .batch import BATCH_TIMEOUT_S, Batch
from .jobs import check_finished_job, multinode_scripts, script_id
from .provision import unavailable
from .slurm_cluster import hosts_entry

pytestmark = pytest.mark.system


@pytest.mark.timeout(BATCH_TIMEOUT_S + 120)  # the first test may wait for the whole batch
@pytest.mark.parametrize("script", multinode_scripts(), ids=script_id)
def test_job_runs_on_two_nodes(script: Path, request: pytest.FixtureRequest) -> None:
    if not script.exists():
        unavailable(f"jobs/{script.name} does not exist (yet): the multi-node DDP job script")
    slurm_batch: Batch = request.getfixturevalue("slurm_batch")
    job, out_dir = slurm_batch[script_id(script)]
    assert job.info.get("NumNodes") == "2" and job.info.get("NodeList") == "node[1-2]", job.describe()
    for summary in check_finished_job(script, job, out_dir):
        world_size = summary.get("environment", {}).get("world_size", 0)
        assert world_size >= 2, f"a two-node job ran with world_size {world_size}: {summary}"


def test_hosts_entry_removes_only_its_own_line(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost\n")
    with hosts_entry(["node1", "node2"], hosts):
        assert any(line.split()[:3] == ["127.0.0.1", "node1", "node2"]
                   for line in hosts.read_text().splitlines())
        with hosts.open("a") as f:  # a concurrent run adds its own entry meanwhile
            f.write("127.0.0.1 other\n")
    assert hosts.read_text() == "127.0.0.1 localhost\n127.0.0.1 other\n"
