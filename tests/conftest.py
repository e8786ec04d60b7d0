import os

import pytest
import torch


LONGEST_FIRST = (
    "tests/test_slurm.py::test_train_sbatch_on_a_local_slurm",  # ~75 s, most of it waiting on SLURM
    "tests/test_reliability.py::test_a_rank_frozen_in_a_zeropp_hop_ends_the_job_naming_a_rank",  # timeouts expire
    "tests/test_train_e2e.py::test_default_job_learns_and_writes_metrics_wandb_and_checkpoint",
    "tests/test_train_e2e.py::test_a_dying_rank_ends_the_job",
    "tests/test_subgroup_timeouts.py",
    "tests/test_slurm.py::test_local_slurm_cleans_up_when_start_fails",
)
"""Started first, so that under ``-n 2`` the other worker runs the short tests beside them instead of one
worker finishing the suite alone with one of them (measured with tests/suite_clock.py)."""


def pytest_collection_modifyitems(config, items):
    def rank(item):
        return next((i for i, prefix in enumerate(LONGEST_FIRST) if item.nodeid.startswith(prefix)),
                    len(LONGEST_FIRST))

    items.sort(key=rank)  # stable: the rest keep their order


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
