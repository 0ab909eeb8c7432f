"""Multi-node jobs on two emulated nodes: two ``slurmd -N node1|node2`` on this host.

``node1`` and ``node2`` resolve to 127.0.0.1 through a line added to /etc/hosts for the module
and removed afterwards, so the job's rendezvous host (the first node of the allocation) is
reachable; the ranks talk over gloo. Every script whose ``#SBATCH`` asks for more than one node
runs here, and ``jobs/job_ddp_multinode.sh`` always does.

All of them are submitted at once. Each asks for 8 of the 16 CPUs of both nodes and a share of the
memory (not ``--exclusive``), so SLURM runs two of them side by side on the same two nodes, each on
its own rendezvous port: the jobs are mostly process start-up, and two overlap well on two cores.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from .jobs import JOB_MEMORY, check_finished_job, job_env, multinode_scripts, script_id
from .provision import REPO, unavailable
from .slurm_cluster import TERMINAL, Job, SlurmCluster, hosts_entry

pytestmark = pytest.mark.system

SCRIPTS = multinode_scripts()
BATCH_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def finished_multinode_jobs(request: pytest.FixtureRequest,
                            tmp_path_factory: pytest.TempPathFactory) -> dict[Path, tuple[Job, Path]]:
    """Submit the selected scripts that exist to the two-node cluster, wait for all, cancel what still runs at
    the timeout."""
    selected = [item.callspec.params["script"] for item in request.session.items
                if getattr(item, "originalname", None) == "test_job_runs_on_two_nodes"]  # honours -k
    selected = [script for script in selected if script.exists()]
    if not selected:
        return {}
    slurm: SlurmCluster = request.getfixturevalue("slurm_two_nodes")
    root = tmp_path_factory.mktemp("multinode")
    jobs: dict[Path, tuple[Job, Path]] = {}
    for script in selected:
        name = script_id(script)
        out_dir = root / name
        job = slurm.submit(script, name=name, output=root / f"{name}.log", env=job_env(out_dir),
                           args=(JOB_MEMORY, "--nodes=2"), cwd=REPO)
        jobs[script] = (job, out_dir)
    start = time.monotonic()
    if not slurm.wait([job for job, _ in jobs.values()], BATCH_TIMEOUT_S):
        for job, _ in jobs.values():
            if job.state not in TERMINAL:
                slurm.cancel(job)
        slurm.wait([job for job, _ in jobs.values()], 30)
    print(f"\n{len(jobs)} two-node SLURM jobs in {time.monotonic() - start:.0f} s:")
    for job, _ in jobs.values():
        print(f"  {job.name:<28} {job.state:<10} exit {job.info.get('ExitCode')} "
              f"run time {job.info.get('RunTime')}")
    return jobs


@pytest.mark.timeout(BATCH_TIMEOUT_S + 180)  # the first test starts the cluster and waits for the whole batch
@pytest.mark.parametrize("script", SCRIPTS, ids=script_id)
def test_job_runs_on_two_nodes(script: Path, finished_multinode_jobs: dict[Path, tuple[Job, Path]]) -> None:
    if not script.exists():
        unavailable(f"jobs/{script.name} does not exist (yet): the multi-node DDP job script")
    job, out_dir = finished_multinode_jobs[script]
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
