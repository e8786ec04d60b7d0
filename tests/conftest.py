import os

import pytest
import torch


def pytest_configure(config):
    if os.environ.get("GPT_SUITE_CLOCK"):  # where the suite's time goes: see tests/suite_clock.py
        from tests.suite_clock import Clock

        config.pluginmanager.register(Clock(os.environ["GPT_SUITE_CLOCK"]), "suite_clock")



@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models run far faster on one intra-op thread (the multi-process workers use one as well)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
