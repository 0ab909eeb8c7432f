"""Test-run settings shared by tests/ and the notebooks nbval executes."""
import os

# Notebooks run in quick mode (offline data, CPU-minutes); kernels inherit this environment.
os.environ.setdefault("LABKIT_QUICK", "1")
os.environ.setdefault("MPLBACKEND", "Agg")
# Plain log lines instead of progress bars in captured output.
os.environ.setdefault("LABKIT_PLAIN", "1")
