"""The suite's budget: ``python -m pytest -n 2`` (what CI runs) within 20 minutes on 2 cores, on every CPU kind.

Measured after issue 33 on a 2-core AVX-512 AMD EPYC: 7 min 6 s (it was 16 min 6 s there, 35-41 min on an
AVX2-only EPYC and 27.6 min on an AVX-512/AMX Xeon). To see where the time goes, per test its wall time, the
machine's CPU time, the cores left idle and the ranks and subprocesses it started::

    GPT_SUITE_CLOCK=/tmp/clock python -m pytest -n 0 && python tests/suite_clock.py /tmp/clock

(``-n 0``: one test at a time, so the machine's CPU time is the test's own.) What costs most is starting
processes: a fresh interpreter imports torch, torch._dynamo and the project (~3 CPU-s), so multi-process
tests fork ranks from tests/dist_harness.py's preloaded forkserver (``run_world``; ``train_main`` runs
train.py's main there), and only tests of the launch itself start torchrun or ``python train.py``.
"""
import os

import pytest
import torch


LONGEST_FIRST = (
    "tests/test_slurm.py::test_train_sbatch_on_a_local_slurm",  # ~110 s with its kill+restart, mostly waiting
    "tests/test_reliability.py::test_a_rank_frozen_in_a_zeropp_hop_ends_the_job_naming_a_rank",  # timeouts expire
    "tests/test_restart.py::test_a_killed_rank_restarts_the_group_and_ends_on_the_uninterrupted_curve",  # ~35 s
    "tests/test_restart.py::test_restarts_used_up_end_the_job_with_one_line",  # 4 interpreters
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
