"""The GPU tier: every test under tests/gpu/ is marked ``gpu`` and skipped cleanly where CUDA is absent.

Run it on a GPU machine with ``bash scripts/gpu_check.sh OUTDIR`` (or ``python -m pytest tests/gpu``).
The tier runs in one process on one device: NCCL at world size 1 (multi-rank paths are covered on CPU
with gloo by the rest of the suite). Its references are CPU runs of the same code, the plain-torch
kernel references of ``kernels/quant.py`` and float64 math, never the CUDA code under test.
"""
from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(__file__)
    skip = pytest.mark.skip(reason="needs a CUDA device (the GPU tier: bash scripts/gpu_check.sh OUTDIR)")
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.gpu)
            if not HAS_CUDA:
                item.add_marker(skip)


@pytest.fixture(autouse=True)
def _one_thread():
    """Overrides tests/conftest.py's one-thread rule: the CPU references here run at realistic sizes."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, min(8, os.cpu_count() or 1)))
    yield
    torch.set_num_threads(before)


@pytest.fixture
def cuda() -> torch.device:
    torch.cuda.reset_peak_memory_stats()
    return torch.device("cuda", torch.cuda.current_device())
