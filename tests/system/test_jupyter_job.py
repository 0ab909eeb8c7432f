"""``jobs/job_jupyter.sh``: JupyterLab on a compute node, token-only, gone when the job ends.

Under the local SLURM cluster: the job prints the ssh tunnel command and URL, the server answers
on that port with the token and refuses without it (403 for the API, a redirect to the login
page for the UI), and ``scancel`` stops it cleanly. With plain ``bash`` (no SLURM) the same
script serves and exits 0 on SIGTERM.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import re
import signal
import socket
import subprocess
from pathlib import Path

import pytest

from .jobs import JOB_MEMORY, JUPYTER_JOB
from .provision import REPO, python_env, wait_for
from .slurm_cluster import TERMINAL, SlurmCluster

pytestmark = pytest.mark.system

URL = re.compile(r"http://localhost:(\d+)/lab\?token=(\S+)")
START_TIMEOUT_S = 120


def http_get(port: int, path: str, token: str | None = None) -> tuple[int, str]:
    """(status, Location header) of one GET to 127.0.0.1:port, redirects not followed."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path, headers={"Authorization": f"token {token}"} if token else {})
        resp = conn.getresponse()
        return resp.status, resp.getheader("Location") or ""
    except OSError:
        return 0, ""
    finally:
        conn.close()


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


def check_token_only(port: int, token: str) -> None:
    """The server answers with the job's token and refuses every request without it."""
    wait_for(lambda: http_get(port, "/api/status", token)[0] == 200, START_TIMEOUT_S,
             f"JupyterLab to answer on port {port} with its token")
    assert http_get(port, "/api/status")[0] == 403
    assert http_get(port, "/api/status", "wrong-" + token)[0] == 403
    status, location = http_get(port, "/lab")
    assert status == 302 and "/login" in location, (status, location)
    assert http_get(port, f"/lab?token={token}")[0] == 200


def test_jupyter_job_under_slurm(slurm: SlurmCluster, tmp_path: Path) -> None:
    env = python_env(LABKIT_QUICK="1", SBATCH_GRES="none")
    job = slurm.submit(JUPYTER_JOB, name="jupyter", output=tmp_path / "jupyter.log", env=env,
                       args=(JOB_MEMORY,), cwd=REPO)
    try:
        def url_printed() -> re.Match[str] | None:
            assert slurm.refresh(job).state not in TERMINAL, job.describe()
            return URL.search(job.log())
        port, token = wait_for(url_printed, START_TIMEOUT_S, "the job to print its URL").groups()
        port_n = int(port)
        assert job.output.stat().st_mode & 0o777 == 0o600, "the log holding the token is readable by others"
        node = job.info.get("NodeList")
        assert re.search(rf"ssh -N -L {port}:localhost:{port} -J \S+@\S+ \S+@{node}\b", job.log()), (
            f"no ssh tunnel command through the login node to {node}:\n{job.log()}")
        check_token_only(port_n, token)
    finally:
        slurm.cancel(job)
    assert slurm.wait([job], 30), job.describe()
    wait_for(lambda: not port_open(port_n), 30, f"port {port} to close after scancel")
    # the script writes its last line once JupyterLab has exited, a moment after the port closed (long on a busy
    # machine; the cluster's KillWait leaves it 30 s before a SIGKILL)
    with contextlib.suppress(TimeoutError):
        wait_for(lambda: "JupyterLab stopped." in job.log(), 30, "the job's last line")
    assert "JupyterLab stopped." in job.log(), job.describe()


def test_jupyter_job_with_plain_bash(tmp_path: Path) -> None:
    log = tmp_path / "jupyter.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(["bash", str(JUPYTER_JOB)], cwd=REPO, stdout=out,
                                stderr=subprocess.STDOUT, env=python_env(), start_new_session=True)
    try:
        def url_printed() -> re.Match[str] | None:
            assert proc.poll() is None, f"exited {proc.returncode}:\n{log.read_text()}"
            return URL.search(log.read_text())
        match = wait_for(url_printed, START_TIMEOUT_S, "the script to print its URL")
        port, token = int(match[1]), match[2]
        check_token_only(port, token)
        os.kill(proc.pid, signal.SIGTERM)  # what SLURM sends at the time limit
        assert proc.wait(timeout=30) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert not port_open(port), f"JupyterLab still listens on {port} after the script ended"
    assert "JupyterLab stopped." in log.read_text()
