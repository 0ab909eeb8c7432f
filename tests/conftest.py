"""Fixtures shared by the unit tests."""
import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: a second intra-op thread only adds synchronisation, badly so on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
