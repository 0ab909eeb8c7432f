"""Test-run settings shared by tests/ and the notebooks nbval executes."""
import os

import pytest

# Notebooks run in quick mode (offline data, CPU-minutes); kernels inherit this environment.
os.environ.setdefault("LABKIT_QUICK", "1")
os.environ.setdefault("MPLBACKEND", "Agg")
# Plain log lines instead of progress bars in captured output.
os.environ.setdefault("LABKIT_PLAIN", "1")
# One compute thread per process (workers, notebook kernels, launched ranks): the two pytest workers already fill
# the cores, and a second OpenMP thread per process only spins against the other worker's processes.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under ``pytest -n N`` (pytest-xdist): each file runs on one worker (a notebook's cells share one kernel; a
    module's fixtures are built once), and the whole system layer on one worker (one SLURM cluster, one
    JupyterLab, one apt at a time)."""
    from xdist.scheduler import LoadScopeScheduling

    class ByFile(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "tests/system" if path.startswith("tests/system/") else path

    return ByFile(config, log)


def pytest_collection_modifyitems(config, items):
    """Longest work first, so that two workers end together: the system layer (one unit of several minutes),
    then the notebooks (a unit each), then the test files (many short units that fill the gaps)."""
    def rank(item) -> int:
        path = item.nodeid.split("::", 1)[0]
        return 0 if path.startswith("tests/system/") else 1 if path.startswith("notebooks/") else 2

    items.sort(key=rank)  # stable: each file's own order is kept
