"""Helpers of the GPU tier (tests/gpu/)."""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch


@contextlib.contextmanager
def world_of_one(device: torch.device) -> Iterator[None]:
    """A default process group of one rank, the way the trainer makes it (NCCL on CUDA, gloo on CPU)."""
    import torch.distributed as dist

    from parallel.launch import init_distributed, read_launch_env

    env = read_launch_env()
    assert env.launcher == "single" and env.world_size == 1, env
    init_distributed(env, device, 300.0)
    try:
        yield
    finally:
        dist.destroy_process_group()


def cpu_scaled_mm_works() -> bool:
    """Whether this torch runs ``torch._scaled_mm`` on CPU (torch 2.13 does; older builds may not)."""
    a = torch.ones(16, 16).to(torch.float8_e4m3fn)
    one = torch.tensor(1.0)
    try:
        torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError):
        return False
    return True
