"""The GPU layer (``pytest -m gpu``): every test here is marked ``gpu`` and skipped, with the reason printed
(``-ra``), on a machine without CUDA. On a GPU node: ``pytest -m gpu tests/gpu``."""
import pytest
import torch

NO_CUDA = "needs a CUDA GPU: torch.cuda.is_available() is False here; run pytest -m gpu on a GPU node"


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/gpu/" in item.nodeid:
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(pytest.mark.skip(reason=NO_CUDA))
