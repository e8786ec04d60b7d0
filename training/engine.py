"""One optimizer step over any (pp, dp, tp) layout: the seam every later technique plugs into.

``train_step`` = zero grads -> pipeline schedule (forwards/backwards of all
micro-batches, gradients reducing over DP during the last backward) -> gradient
reductions that parallelism requires (sequence-parallel norm weights over TP,
tied embeddings over first+last stage) -> global norm, unscale, clip -> AdamW
step, or a skipped step when gradients are not finite.

Everything data-parallel is asked of one strategy object, ``self.dp``: plain DP
(``parallel/data_parallel.py``, ZeRO stage 0), ZeRO 1-3
(``parallel/zero/sharded.py``), or FP8-LM's (``fp8/zero.py``, stages 0-3). Both answer zero_grad, before_last_backward,
finish_grads, norm_terms, clip and step; the engine knows nothing of shards.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from config import Config, ConfigError, compute_precision, fp8_operands
from config.optimizer import adafactor_line
from fp8.device import resolve_gemm, startup_line, triton_has_e4m3
from fp8.scaling import Fp8Scaling
from fp8.zero import Fp8DataParallel
from model.compile import compile_chunks, enabled as compile_enabled
from model.gpt import build_chunks, named_parameters
from model.layers import TPContext
from parallel import comm
from parallel.context import ContextParallel
from parallel.data_parallel import DataParallel
from parallel.layout import kv_replicas
from parallel.mesh import Mesh
from parallel.optim_rules import COMPUTE_DTYPES
from parallel.pipeline import PipelineRunner
from parallel.random import RNGTracker
from parallel.zero.sharded import ZeroDataParallel
from training.moe import MoeTracker
from training.optim import LossScaler, LRSchedule

MAX_CONSECUTIVE_SKIPS = 50
BatchFn = Callable[[int], Tuple[torch.Tensor, torch.Tensor]]


class Engine:
    def __init__(self, cfg: Config, mesh: Mesh):
        fp8 = cfg.precision == "fp8"
        self.gemm_line: Optional[str] = None
        """precision=fp8: which GEMMs run and why (``fp8/device.py``), for the start-up line."""
        if fp8:  # fp8.gemm resolved by the device's capability; self.cfg holds the resolved value
            gemm, why = resolve_gemm(mesh.device, cfg.fp8)
            cfg = dataclasses.replace(cfg, fp8=dataclasses.replace(cfg.fp8, gemm=gemm))
            self.gemm_line = startup_line(cfg.fp8, why)
        self.cfg, self.mesh = cfg, mesh
        m, layout = cfg.model, mesh.layout
        self.rng = RNGTracker(mesh.device, cfg.train.seed, mesh.pp_rank, mesh.dp_rank, mesh.tp_rank)
        replicas = kv_replicas(m.kv_heads, layout.tp)
        # FP8 linears where their operands are cast to FP8; with 16-bit GEMMs the linears are the 16-bit ones
        quantized = fp8 and fp8_operands(cfg.fp8)
        ctx = TPContext(mesh.tp, mesh.sequence_parallel, self.rng, fp8=cfg.fp8 if quantized else None,
                        kv_group=mesh.tp_kv_group(replicas) if replicas > 1 else None, ep=mesh.ep,
                        cp=ContextParallel(mesh.cp, cfg.parallel.cp_comm) if layout.cp > 1 else None,
                        reset_position_ids=cfg.data.reset_position_ids)
        self.chunks = build_chunks(m, ctx, layout.pp, layout.virtual_stages, mesh.pp_rank, cfg.train.seed,
                                   mesh.device)
        self.params: Dict[str, torch.nn.Parameter] = dict(named_parameters(self.chunks))
        self.compiled = compile_enabled(cfg, mesh.device)
        if fp8 and self.compiled and not triton_has_e4m3(mesh.device):  # an A100 / V100 (fp8/device.py)
            if quantized:  # emulated FP8 casts inside the blocks: Triton cannot compile them there
                if cfg.train.compile:
                    raise ConfigError("train.compile=true with fp8.emulate=true needs compute capability >= 8.9 "
                                      "(Triton has no E4M3 type below it): set train.compile=false")
                self.compiled = False
                self.gemm_line += "; blocks not compiled (emulated E4M3 casts: Triton has none below 8.9)"
            else:
                self.gemm_line += "; FP8-LM's per-unit optimizer work runs eager (Triton has no E4M3 below 8.9)"
        self._compile_pending = self.compiled  # block forwards and the loss: see _compile_when_ready
        self.fp8_scaling: Optional[Fp8Scaling] = None
        if fp8:  # FP8-LM: scaling state of the FP8 GEMMs (none with 16-bit GEMMs), and the FP8 data-parallel strategy
            self.fp8_scaling = Fp8Scaling(cfg.fp8, mesh.tp, mesh.dp)
            self.fp8_scaling.attach(self.chunks)
            self.dp = Fp8DataParallel(cfg, mesh, self.chunks, {p: n for n, p in self.params.items()})
            self.fp8_scaling.make_copies = self.dp.make_weight_copies  # (stage 0: weights cast from the masters)
        elif cfg.zero.stage == 0:
            self.dp = DataParallel(cfg, mesh, self.chunks, self.params)
        else:
            self.dp = ZeroDataParallel(cfg, mesh, self.chunks, {p: n for n, p in self.params.items()})
        self.moe = MoeTracker(cfg, mesh, self.chunks)
        seq = m.seq_len // layout.cp  # a rank's two chunks of each sequence under context parallelism
        seq = seq // layout.tp if mesh.sequence_parallel else seq
        self.runner = PipelineRunner(mesh, self.chunks, (seq, cfg.train.micro_batch_size, m.d_model),
                                     documents=cfg.data.document_mask)
        self.lr_schedule = LRSchedule(cfg.train)
        if cfg.train.optimizer == "adafactor" and mesh.rank == 0:  # what its relative step is, and why
            print(adafactor_line(cfg), flush=True)
        self.compute_dtype = COMPUTE_DTYPES[compute_precision(cfg)]
        self.scaler = LossScaler(cfg.loss_scale, enabled=self.compute_dtype == torch.float16)
        self.step = 0
        self.skipped_steps = 0
        self._consecutive_skips = 0

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.mesh.device.type, dtype=self.compute_dtype)

    def _compile_when_ready(self) -> None:
        """``train.compile``: compile the blocks' forwards and the loss (``model/compile.py``; the module hooks the
        data-parallel strategies add stay eager) before the first forward, or, under delayed FP8 scaling, once every
        scale has been initialised: the just-in-time first scales of a fresh run (``fp8/scaling.py``) read a device
        flag and reduce over TP and DP, which is eager work, so the first step runs eagerly (a resumed run has its
        scales from the checkpoint and compiles at once)."""
        if not self._compile_pending or (self.fp8_scaling is not None and not self.fp8_scaling.ready()):
            return
        compile_chunks(self.chunks)
        self._compile_pending = False

    # -- the step -------------------------------------------------------------------------------
    def forward_backward(self, batch: BatchFn) -> List[torch.Tensor]:
        """Gradients of the global batch (DP mean, scaled by the loss scale); returns this rank's micro-batch
        losses (the last stage's; empty elsewhere)."""
        self._compile_when_ready()
        comm.mark("forward_backward")
        self.dp.zero_grad()
        num_mb = self.mesh.layout.num_microbatches
        # FP8: each weight cast once for the step's micro-batches (fp8/scaling.py step_copies), where every rank holds
        # the weights anyway (ZeRO-3 gathers them per module: a copy of all would undo its sharding)
        keep = self.fp8_scaling is not None and self.cfg.zero.stage < 3
        copies = self.fp8_scaling.step_copies() if keep else contextlib.nullcontext()
        self.moe.set_scale(self.scaler.scale / num_mb)
        with copies:
            losses = self.runner.run(batch, num_mb, grad_scale=self.scaler.scale / num_mb, compute=self.autocast,
                                     dtype=self.compute_dtype, before_last_backward=self.dp.before_last_backward)
        comm.mark("finish_grads")
        self.dp.finish_grads()
        if self.fp8_scaling is not None:
            self.fp8_scaling.update()  # delayed scaling: this step's amaxes into the histories, next scales
        return losses

    def _loss_term(self, losses: List[torch.Tensor]) -> torch.Tensor:
        """This rank's addend to the global loss (float64, shape (1,)): the mean over its micro-batches on the
        last stage's TP rank 0, zero elsewhere; summed over the world and divided by DP it is the global mean."""
        if self.mesh.is_last_stage and self.mesh.tp_rank == 0:
            return torch.stack(losses).float().mean().double().reshape(1)
        return torch.zeros(1, dtype=torch.float64, device=self.mesh.device)

    def _global_loss(self, losses: List[torch.Tensor]) -> float:
        """Mean over micro-batches and DP ranks, known on every rank (the last stage holds it)."""
        t = self._loss_term(losses)
        comm.all_reduce(t, self.mesh.world)
        return t.item() / self.mesh.layout.dp

    def train_step(self, batch: BatchFn, extra: Optional[Callable[[], torch.Tensor]] = None) -> Dict[str, Any]:
        """One optimizer step. The step's scalars cross the world in one all-reduce (a synchronisation every rank
        waits on, on the slowest link: one instead of one per scalar): the loss, the strategy's norm terms
        (``dp.norm_terms``) and ``extra()``'s values, if given (the trainer's stop flags, evaluated then), whose
        sums come back as ``stats["extra"]``."""
        lr = self.lr_schedule(self.step)
        if getattr(self.dp, "early", False):  # zero.early_step: what the step will use, known before backward
            self.dp.plan_step(lr, self.scaler.scale)
        losses = self.forward_backward(batch)
        terms = self.dp.norm_terms()
        moe = self.moe.terms()  # the MoE layers' step sums (training/moe.py; empty for a dense model)
        mine = [self._loss_term(losses), terms, moe]
        if extra is not None:
            mine.append(extra().to(device=self.mesh.device, dtype=torch.float64).reshape(-1))
        comm.mark("scalars")
        totals = torch.cat(mine)
        comm.all_reduce(totals, self.mesh.world)
        loss = totals[0].item() / self.mesh.layout.dp
        norm, finite = self.dp.clip(self.scaler.scale, self.cfg.train.grad_clip, totals[1:1 + terms.numel()])
        after = 1 + terms.numel() + moe.numel()
        comm.mark("step")
        if finite:
            self.dp.step(lr)
            self._consecutive_skips = 0
        else:
            self.skipped_steps += 1
            self._consecutive_skips += 1
            if self._consecutive_skips > MAX_CONSECUTIVE_SKIPS:
                raise FloatingPointError(f"{self._consecutive_skips} consecutive steps had non-finite gradients "
                                         f"(last loss {loss}); the run has diverged")
        comm.mark("loop")
        scale = self.scaler.scale
        self.scaler.update(found_inf=not finite)
        self.step += 1
        stats: Dict[str, Any] = {"loss": loss, "grad_norm": norm, "lr": lr, "skipped": not finite,
                                 "loss_scale": scale}
        if self.moe:  # after the optimizer step: the expert biases move by the step's global load
            stats["moe"] = self.moe.after_step(totals[1 + terms.numel():after], taken=finite)
        if extra is not None:
            stats["extra"] = totals[after:]
        return stats

    @torch.no_grad()
    def eval_loss(self, batch: BatchFn) -> float:
        self._compile_when_ready()
        for c in self.chunks:
            c.eval()
        # FP8-LM stage 0: the weights that keep no 16-bit copy are cast from the masters once for the whole evaluation
        fp8 = self.fp8_scaling
        copies = fp8.step_copies(training=False) if fp8 is not None else contextlib.nullcontext()
        try:
            with copies:
                losses = self.runner.run(batch, self.mesh.layout.num_microbatches, forward_only=True,
                                         compute=self.autocast, dtype=self.compute_dtype)
        finally:
            for c in self.chunks:
                c.train()
        return self._global_loss(losses)
