"""Regional compilation: each transformer block and the loss through ``torch.compile`` (``train.compile``).

What torchtitan does, for the same reasons (SPEC §8): a block is the unit that repeats, so one compiled
graph serves every block of the model (its parameters are graph inputs, not constants: no recompilation
from block to block), and the compile time is that of one block, not of the model. Inductor fuses a
block's norms, rotary embedding, residual adds, activation functions and, under ``precision=fp8``, every
operand's amax, scale and saturating cast (``fp8/linear.py``) into a few kernels around the GEMMs and
the attention kernel. The loss (final norm, output projection, the fp32 upcast of the logits and the
cross entropy) is compiled too, so the fp32 logits are never written out whole at tp = 1: the norm's and the
cross entropy's functions, not the module calls around them, for the same reason as the blocks.

What stays outside the compiled graphs, by construction:

* module hooks: only ``block.forward`` is compiled, not the module call, so the ZeRO gather / release
  hooks (``parallel/zero/sharded.py``) run eagerly around each compiled block, as they do without compile;
* collectives: the comm door (``parallel/comm.py``, with its byte ledger) is Python; under TP each
  collective splits a block into compiled regions between them (a resumable graph break), and custom
  autograd functions whose backward communicates run eagerly;
* the dropout stream swap of tensor parallelism (``model.layers.forked``), only where dropout is on;
* FP8 step state: amax histories, scales and the per-step weight copies are tensors updated outside the
  graphs (``fp8/scaling.py``); a graph reads them.

Activation checkpointing composes: ``full`` wraps the (compiled) block call in ``torch.utils.checkpoint``,
``selective`` checkpoints the attention core inside the compiled block (a checkpoint region in the graph).

Recompiles are logged by torch (``torch._logging`` ``recompiles``, turned on here); ``recompiles()`` counts
them for tests and the trainer's first-steps check.
"""
from __future__ import annotations

import logging
import os
from typing import Sequence

import torch
from torch import nn

from config import Config


def enabled(cfg: Config, device: torch.device) -> bool:
    """``train.compile``: null means on for CUDA, off elsewhere."""
    return cfg.train.compile if cfg.train.compile is not None else device.type == "cuda"


class _Recompiles(logging.Handler):
    """Counts the records of dynamo's ``recompiles`` log: one per recompilation, with its reason."""

    count = 0

    def emit(self, record: logging.LogRecord) -> None:
        _Recompiles.count += 1


_RECOMPILES_LOG = "torch._dynamo.guards.__recompiles"


def log_recompiles() -> None:
    """Turn on torch's recompilation log (each recompilation printed with the guard that failed) and count it."""
    torch._logging.set_logs(recompiles=True)
    log = logging.getLogger(_RECOMPILES_LOG)
    if not any(isinstance(h, _Recompiles) for h in log.handlers):
        log.addHandler(_Recompiles())


def recompiles() -> int:
    """Recompilations logged since ``log_recompiles`` (the first compilation of a function is not one)."""
    return _Recompiles.count


BACKENDS = ("inductor", "aot_eager", "eager")


def backend() -> str:
    """``GPT_COMPILE_BACKEND``: inductor (the default: generated kernels), or aot_eager / eager, which trace the
    same graphs and run them with torch's own kernels (the tests use aot_eager: it checks what is traced without
    inductor's C++ build, ~20 s a graph on a 2-core CPU)."""
    name = os.environ.get("GPT_COMPILE_BACKEND", "inductor")
    if name not in BACKENDS:
        raise ValueError(f"GPT_COMPILE_BACKEND must be one of {', '.join(BACKENDS)}, got {name!r}")
    return name


def compile_chunks(chunks: Sequence[nn.Module]) -> None:
    """Compile, in place, every transformer block's forward and the last chunk's loss (see the module docstring)."""
    log_recompiles()
    # one graph per distinct block code path (training, evaluation, checkpointed) is normal; the limit only
    # stops a pathological case from recompiling forever
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 16)
    kwargs = {"backend": backend()}
    for chunk in chunks:
        for block in chunk.layers.values():
            block.forward = torch.compile(block.forward, **kwargs)
        if getattr(chunk, "last", False):
            # the norm and the head are modules with the strategies' hooks: they run as modules, the fp32
            # upcast of the logits and the cross entropy compiled (at tp = 1: above it the vocabulary-parallel
            # cross entropy is an autograd function with three all-reduces)
            chunk.final_norm.forward = torch.compile(chunk.final_norm.forward, **kwargs)
            if chunk.ctx.tp.size == 1:
                chunk.cross_entropy = torch.compile(chunk.cross_entropy, **kwargs)

