import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models run far faster on one intra-op thread (the multi-process workers use one as well)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
