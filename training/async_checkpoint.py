"""Checkpoint saves as the training loop sees them: when (``checkpoint.interval``: every N steps, or ``auto`` from
the failure rate, ``training/ckpt_interval.py``) and how (synchronous, or ``checkpoint.async_save``).

Asynchronous saves. The step that saves copies the state to CPU (``stage``: pinned memory where CUDA is present;
the buffers are kept for the next save, so each rank holds one more copy of the state it writes, which
``training/memory.py`` counts) and training goes on while a background thread of each rank writes that copy with the
synchronous path's own code (``Checkpointer.write``: DCP files, the RNG file, this rank's sha256 digests, then on
rank 0 meta.json, the manifest, the rename and ``latest``, ``training/checkpoint_publish.py``). So a checkpoint
counts only once its manifest is written and it is renamed: a crash (kill -9 of the process, which holds the writer
thread) at any point of the write leaves the previous checkpoints as they were and ``latest`` naming a complete one;
the next save removes the dead temporary directory. The digests are computed by the writer thread, off the training
thread; the writer runs at a lower CPU priority (nice +10), so that on a CPU the training keeps its cores.

The writers talk over a process group of their own (gloo, all ranks, made here once), never the training's groups:
collectives of two threads on one group could interleave. While a write is in flight, every step the ranks agree (one
all-reduce of one number on ``world``) whether every rank's writer has finished; so a save that failed is raised on
every rank at the same step, the step after the writer knew (one line, the synchronous save's: the partial save
removed, the previous checkpoint kept, exit code 2). At most one save is in flight: the next one waits for it first;
so does the end of the run (the final save at max steps, time limit or SIGTERM returns once it is published).
"""
from __future__ import annotations

import os
import statistics
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from config import Config
from parallel import comm
from parallel.mesh import Mesh
from parallel.zero.dcp_view import ChunkedTensor
from training import checkpoint_publish
from training.checkpoint import Checkpointer, SaveJob
from training.ckpt_interval import AutoInterval
from training.safe_load import CheckpointError

WRITER_NICE = 10
"""How much lower the writer thread's CPU priority is than the training's (Linux: per thread)."""


def writer_group(mesh: Mesh) -> comm.Group:
    """A gloo process group of all ranks for the writer threads (collective: every rank calls it, once)."""
    ranks = list(range(mesh.layout.world_size))
    pg = dist.new_group(ranks, timeout=mesh.timeout, backend="gloo")
    nodes = {mesh.layout.node_of(r) for r in ranks}
    return comm.Group(name="checkpoint_writer", pg=pg, ranks=ranks, rank=mesh.rank,
                      link="intra" if len(nodes) == 1 else "inter", ledger=comm.Ledger())


class Staging:
    """CPU copies of the state a save writes, in buffers kept from one save to the next (pinned under CUDA)."""

    def __init__(self, device: torch.device):
        self.pin = device.type == "cuda"
        self.buffers: Dict[str, torch.Tensor] = {}

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

    def _copy(self, key: str, t: torch.Tensor) -> torch.Tensor:
        buf = self.buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = self.buffers[key] = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self.pin)
        buf.copy_(t.detach(), non_blocking=self.pin)
        return buf

    def __call__(self, tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """The same state dict over copies: DTensors keep their mesh and placements, ZeRO's box views their boxes."""
        out: Dict[str, torch.Tensor] = {}
        for name, t in tensors.items():
            if isinstance(t, ChunkedTensor):
                boxes = [(off, self._copy(f"{name}#{i}", b)) for i, (off, b) in enumerate(t._boxes)]
                out[name] = ChunkedTensor(t.shape, boxes, t.dtype, torch.device("cpu"))
            elif isinstance(t, DTensor):
                out[name] = DTensor.from_local(self._copy(name, t.to_local()), t.device_mesh, t.placements,
                                               run_check=False, shape=t.shape, stride=t.stride())
            else:
                out[name] = self._copy(name, t)
        if self.pin:
            torch.cuda.synchronize()
        return out


CLEAN_STEPS = 32
"""Steps with no write in flight kept as the baseline of a write's overhead (``Saver.write_overhead_s``)."""


class Saver:
    """The loop's checkpoint calls: ``due(step)`` once a step, ``save`` when due and at exit, ``finish`` at the end
    (waits for a write in flight, raising its failure), ``close`` on the way out after an error."""

    def __init__(self, cfg: Config, ckpt: Checkpointer, mesh: Mesh):
        c = cfg.checkpoint
        self.ckpt, self.mesh, self.async_save = ckpt, mesh, c.async_save
        self.every = c.interval if isinstance(c.interval, int) else 0
        self.auto = AutoInterval(c.mtbf_hours) if c.interval == "auto" else None
        self.next_save: Optional[int] = None
        """interval=auto: the step of the next save (the same on every rank; None: at the second step)."""
        self.group = writer_group(mesh) if self.async_save else None
        self.staging = Staging(mesh.device) if self.async_save else None
        self.stall_s: Optional[float] = None
        """How long the last save held the training loop (staging, or waiting for the previous write, or all)."""
        self._thread: Optional[threading.Thread] = None
        self._done = threading.Event()
        self._outcome: Optional[str] = None
        self._last: Optional[float] = None
        self._step_times: List[float] = []
        """Since the last save: the times of the steps with no write in flight (interval=auto's step time)."""
        self._writing = False
        """Whether a write was in flight when the step now running began."""
        self._clean: List[float] = []
        """The last ``CLEAN_STEPS`` step times with no write in flight: the baseline a write's overhead is taken on."""
        self.write_overhead_s = 0.0
        """What the writes since the last save cost the steps they ran beside (their time above the clean median):
        with the stall, a checkpoint's whole cost to the training (interval=auto's C)."""

    # -- the loop's calls -----------------------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        """Once a step, on every rank: raises the failure of a write that finished (every rank at the same step);
        whether to save now."""
        now = time.perf_counter()
        if self._last is not None:
            took = now - self._last
            if not self._writing:
                self._step_times.append(took)
                self._clean = (self._clean + [took])[-CLEAN_STEPS:]
            elif self._clean:  # a step beside a write: what it took above a clean one is the write's cost
                self.write_overhead_s += max(took - statistics.median(self._clean), 0.0)
        self._last = now
        self.poll()
        self._writing = self._thread is not None
        if self.auto is not None:  # the first save once a step time is known
            return self._last is not None and (self._clean != [] or self._step_times != []) and (
                self.next_save is None or step >= self.next_save)
        return bool(self.every) and step % self.every == 0

    def save(self, step: int, consumed_samples: int, protect: Optional[Path] = None) -> Path:
        """Save ``step`` (as ``Checkpointer.save``); asynchronously: stage it and return the path it will be published
        at, after waiting for the previous write. Records the stall; under interval=auto, chooses the next save."""
        t0 = time.perf_counter()
        if not self.async_save:
            path = self.ckpt.save(step, consumed_samples, protect)
        else:
            self.wait()
            job = self.ckpt.stage(step, consumed_samples, protect, copy=self.staging)
            self._start(job)
            self._writing = True  # the rest of this step runs beside the write
            path = job.final
        self.stall_s = time.perf_counter() - t0
        if self.auto is not None:
            self._choose(step)
        self._last = time.perf_counter()  # the next step's time starts now, without the stall
        return path

    def poll(self) -> Optional[bool]:
        """With a write in flight: whether every rank's writer has finished (collective on ``world``); a failed
        write is raised here on every rank. None when none is in flight."""
        if self._thread is None:
            return None
        flag = torch.tensor([1.0 if self._done.is_set() else 0.0], dtype=torch.float64, device=self.mesh.device)
        comm.all_reduce(flag, self.mesh.world)
        if int(flag.item()) < self.mesh.world.size:
            return False
        self._collect()
        return True

    def wait(self) -> None:
        """Wait for the write in flight, if any; raises its failure (every rank: the writers end together)."""
        if self._thread is not None:
            self._collect()

    def finish(self) -> None:
        """The run's end: its last save is published (or its failure raised) before the run says it stopped."""
        self.wait()

    def close(self, peer_lost: bool = False) -> None:
        """Leaving after an error: a write in flight is let finish (or fail) first, its outcome dropped; not when a
        peer was lost (``peer_lost``: the error was a failed collective), since the writers' own collectives wait
        for the same dead rank: the write is abandoned (its temporary directory is removed by the next run, the
        previous checkpoints and ``latest`` stay as they were) and the process leaves at once, for the restart."""
        if self._thread is not None and not peer_lost:
            self._thread.join()
        self._thread = None

    # -- inside ---------------------------------------------------------------------------------------------------
    def _start(self, job: SaveJob) -> None:
        self._done.clear()
        self._outcome = None

        def write() -> None:
            try:
                try:  # Linux: a thread's nice value is its own
                    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(),
                                   min(19, os.getpriority(os.PRIO_PROCESS, 0) + WRITER_NICE))
                except (AttributeError, OSError):
                    pass
                checkpoint_publish.reached("staged")
                self.ckpt.write(job, self.group)
            except CheckpointError as e:
                self._outcome = str(e)
            except BaseException as e:  # noqa: BLE001 - a collective timeout, a bug: reported at the next step
                self._outcome = (f"the checkpoint writer failed while saving {job.final.name} ({e.__class__.__name__}:"
                                 f" {str(e).splitlines()[0] if str(e) else ''}); the previous checkpoints are kept")
            finally:
                self._done.set()

        self._thread = threading.Thread(target=write, name=f"checkpoint-writer-{job.step}", daemon=True)
        self._thread.start()

    def _collect(self) -> None:
        assert self._thread is not None
        self._thread.join()
        self._thread = None
        if self._outcome is not None:
            raise CheckpointError(self._outcome)

    def _choose(self, step: int) -> None:
        """interval=auto: rank 0 chooses from the stall just measured and the median step time since the last save
        (a step with evaluation or a write in flight counts as it was); every rank saves at the step it names."""
        line = None
        if self.mesh.rank == 0:
            step_times = self._step_times or self._clean
            step_time = statistics.median(step_times) if step_times else 0.0
            line = self.auto.update(self.stall_s or 0.0, step_time, self.write_overhead_s)
        self.write_overhead_s = 0.0
        steps, line = comm.broadcast_object((self.auto.steps, line), 0, self.mesh.world)
        self.auto.steps = steps
        self.next_save = step + steps
        self._step_times = []
        if line is not None and self.mesh.rank == 0:
            print(line, flush=True)
