"""Test-run settings shared by tests/ and the notebooks nbval executes."""
import os

# Notebooks run in quick mode (offline data, CPU-minutes); kernels inherit this environment.
os.environ.setdefault("LABKIT_QUICK", "1")
os.environ.setdefault("MPLBACKEND", "Agg")
# Plain log lines instead of progress bars in captured output.
os.environ.setdefault("LABKIT_PLAIN", "1")


def pytest_collection_modifyitems(config, items):
    """Under ``pytest -n N --dist loadgroup`` (pytest-xdist): keep each file on one worker (a notebook's cells
    share one kernel; a module's fixtures are built once) and every system test on the same worker (one SLURM
    cluster, one JupyterLab, one apt at a time)."""
    import pytest

    for item in items:
        path = item.nodeid.split("::", 1)[0]
        group = "system" if path.startswith("tests/system/") else path
        item.add_marker(pytest.mark.xdist_group(group))
