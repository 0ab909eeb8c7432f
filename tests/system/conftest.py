"""Session fixtures for the system tests: a real SLURM cluster, JupyterLab and headless Chromium.

Each fixture installs what it needs when missing (Debian's ``slurm-wlm``, ``munge``, ``chromium``;
pip's ``playwright``), starts its daemons in a temp dir and stops exactly the processes it
started. Where the machine cannot do it the test fails with the reason, unless the user opted out with
``LABKIT_SKIP_SYSTEM=1`` (ignored under ``CI=true``; see ``provision.unavailable``).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from .batch import Batch, run_batch
from .jupyter_browser import JupyterLab
from .provision import REPO, apt_install, pip_install, python_env, unavailable
from .slurm_cluster import SlurmCluster, hosts_entry

ARTIFACTS = REPO / "test-artifacts"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "system: end-to-end test on real daemons (SLURM, JupyterLab, Chromium); installs missing "
        "Debian/pip packages; fails where impossible unless LABKIT_SKIP_SYSTEM=1")


@pytest.fixture(scope="session")
def artifacts() -> Path:
    """``test-artifacts/`` (git-ignored): screenshots and logs a person can look at."""
    ARTIFACTS.mkdir(exist_ok=True)
    return ARTIFACTS


@contextlib.contextmanager
def _slurm_cluster(nodes: list[str]) -> Iterator[SlurmCluster]:
    if os.geteuid() != 0:
        unavailable("starting slurmd/munged needs root")
    apt_install(["slurm-wlm", "munge"], ["slurmctld", "slurmd", "sbatch", "munged"])
    # Not under pytest's tmp dir: munged refuses a socket below a directory others cannot search.
    root = Path(tempfile.mkdtemp(prefix="labkit-slurm-"))
    # 8 CPUs a node: every job asks for 8, so one job runs on each node at a time (two at once in all); four
    # at once oversubscribe two cores and slow the rest of the test run
    cluster = SlurmCluster(root, nodes, node_cpus=8)
    try:
        cluster.start()
    except RuntimeError as err:
        shutil.rmtree(root, ignore_errors=True)
        unavailable(f"could not start a local SLURM cluster: {err}")
    try:
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def slurm() -> Iterator[SlurmCluster]:
    """The test cluster: two emulated nodes, ``node1`` and ``node2`` (two slurmd on this host, named in
    /etc/hosts). A one-node job runs on either, a multi-node job on both."""
    hosts = Path("/etc/hosts")
    if not os.access(hosts, os.W_OK):
        unavailable("/etc/hosts is not writable, so node1/node2 cannot be made to resolve")
    with hosts_entry(["node1", "node2"], hosts), _slurm_cluster(["node1", "node2"]) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def slurm_batch(slurm: SlurmCluster, tmp_path_factory: pytest.TempPathFactory,
                request: pytest.FixtureRequest) -> Batch:
    """Every selected test's SLURM job, submitted at once and finished (``tests/system/batch.py``)."""
    return run_batch(slurm, tmp_path_factory.mktemp("jobs"), request.session.items)


@pytest.fixture(scope="session")
def jupyter_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[JupyterLab]:
    """JupyterLab on 127.0.0.1 with a token, serving a copy of the repository's notebooks.

    Kernels get ``LABKIT_QUICK=1`` and this interpreter's environment.
    """
    pip_install("jupyterlab", "jupyterlab")
    env = python_env(LABKIT_QUICK="1")
    env.pop("MPLBACKEND", None)  # the test session's headless Agg would hide every inline plot
    server = JupyterLab(tmp_path_factory.mktemp("jupyter"), token=secrets.token_urlsafe(24), env=env)
    try:
        server.start()
    except (RuntimeError, TimeoutError) as err:
        server.stop()
        unavailable(f"JupyterLab did not start: {err}")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def browser() -> Iterator[object]:
    """Headless Debian Chromium driven by Playwright (never ``playwright install``)."""
    apt_install(["chromium"], ["chromium"])
    pip_install("playwright", "playwright")
    from playwright.sync_api import Error, sync_playwright

    with sync_playwright() as pw:
        try:
            chromium = pw.chromium.launch(executable_path="/usr/bin/chromium", headless=True,
                                          args=["--no-sandbox"])
        except Error as err:
            unavailable(f"Chromium does not start: {err}")
        yield chromium
        chromium.close()


@pytest.fixture(scope="module")
def module_tab(browser: object) -> Iterator[object]:
    """One browser tab for a test module, large enough that JupyterLab shows a notebook and its outputs:
    the module's tests look at one notebook run once (a JupyterLab page load costs seconds of CPU)."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000})  # type: ignore[attr-defined]
    tab = context.new_page()
    tab.set_default_timeout(30_000)
    yield tab
    context.close()


@pytest.fixture
def page(module_tab: object, artifacts: Path, request: pytest.FixtureRequest) -> Iterator[object]:
    """The module's browser tab; leaves a screenshot of the window as the test left it in
    ``test-artifacts/<test>.png``."""
    yield module_tab
    with contextlib.suppress(Exception):
        module_tab.screenshot(path=str(artifacts / f"{request.node.name}.png"))  # type: ignore[attr-defined]
