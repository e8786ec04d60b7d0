"""The training run: config -> launch -> mesh -> engine -> loop, with checkpoints and metrics.

Everything that can be checked before processes talk to each other is checked
first (config, layout, data files, tokenizer), identically on every rank, so a
bad input stops the job with one clear message and never a hang.

Data position: the run keeps ``consumed_samples``, the number of samples of the
train stream used so far; step k reads samples [k*G, (k+1)*G) of it (G = global
batch), DP rank d takes its contiguous slice, split into micro-batches. A resumed
run restores the number and so sees exactly the tokens it would have seen.
"""
from __future__ import annotations

import os
import signal
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from data.gpt_dataset import Sampleable, build_datasets, get_batch
from data.indexed import DataError
from data.tokenizer import Tokenizer
from model.flops import flops_per_token, parameter_count
from parallel import comm
from parallel.launch import init_distributed, pick_device, read_launch_env
from parallel.layout import make_layout
from parallel.mesh import Mesh
from training.checkpoint import Checkpointer
from training.config import Config, to_yaml, validate_config
from training.engine import Engine
from training.metrics import MetricsLogger, peak_memory_bytes, peak_tflops


class StopFlag:
    """Set by SIGTERM / SIGUSR1 (what SLURM sends before the end of an allocation)."""

    def __init__(self):
        self.signal: Optional[str] = None
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.signal = signal.Signals(signum).name


def check_data(cfg: Config) -> Tuple[Sampleable, Optional[Sampleable]]:
    tok = Tokenizer(cfg.data.tokenizer)
    if tok.vocab_size > cfg.model.vocab_size:
        raise DataError(f"tokenizer {cfg.data.tokenizer} has {tok.vocab_size} tokens but model.vocab_size is "
                        f"{cfg.model.vocab_size}")
    return build_datasets(list(cfg.data.paths), list(cfg.data.weights) if cfg.data.weights else None,
                          list(cfg.data.split), cfg.model.seq_len, cfg.train.seed)


def batch_source(ds: Sampleable, first_sample: int, cfg: Config, mesh: Mesh) -> Callable[[int], tuple]:
    """Micro-batch m of this DP rank, for the global batch starting at ``first_sample``."""
    micro = cfg.train.micro_batch_size
    base = first_sample + mesh.dp_rank * (cfg.train.global_batch_size // mesh.layout.dp)

    def get(mb: int):
        tokens, labels = get_batch(ds, range(base + mb * micro, base + (mb + 1) * micro))
        return tokens.to(mesh.device, non_blocking=True), labels.to(mesh.device, non_blocking=True)

    return get


def _run_dir(cfg: Config, config_name: str, mesh: Mesh) -> Path:
    name = cfg.logging.run_dir
    if name is None and mesh.rank == 0:
        name = os.path.join("runs", f"{config_name}-{datetime.now().strftime('%Y%m%d-%H%M%S')}")
    return Path(comm.broadcast_object(name, 0, mesh.world))


def run(cfg: Config, config_name: str = "default") -> Dict[str, Any]:
    validate_config(cfg)
    env = read_launch_env()
    layout = make_layout(cfg, env.world_size, env.local_world_size)
    train_ds, valid_ds = check_data(cfg)
    device = pick_device(cfg.device, env)
    if device.type == "cpu" and env.local_world_size > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // env.local_world_size))
    init_distributed(env, device, cfg.parallel.timeout_s)
    try:
        return _train(cfg, config_name, layout, device, train_ds, valid_ds)
    finally:
        dist.destroy_process_group()


def _train(cfg, config_name, layout, device, train_ds, valid_ds) -> Dict[str, Any]:
    mesh = Mesh(layout, device)
    main = mesh.rank == 0
    run_dir = _run_dir(cfg, config_name, mesh)
    engine = Engine(cfg, mesh)
    ckpt = Checkpointer(cfg, cfg.checkpoint.dir or str(run_dir / "checkpoints"), engine)
    consumed, start = 0, None
    if cfg.checkpoint.load:
        start = Path(cfg.checkpoint.load)
    elif cfg.checkpoint.resume:
        start = ckpt.find_resumable()
    if start is not None:
        consumed = ckpt.load(start)["consumed_samples"]
    logger = MetricsLogger(cfg, run_dir, enabled=main)
    if main:
        (run_dir / "config.yaml").write_text(to_yaml(cfg))
        params = parameter_count(cfg.model)
        print(f"[train] {layout.describe()}\n[train] model: {params['total'] / 1e6:.2f}M parameters "
              f"({params['non_embedding'] / 1e6:.2f}M non-embedding), run dir {run_dir}"
              + (f", resumed from {start} at step {engine.step}" if start else ""), flush=True)

    stop = StopFlag()
    t, g = cfg.train, cfg.train.global_batch_size
    tokens_per_step = g * cfg.model.seq_len
    flops_token = flops_per_token(cfg.model)
    peak = peak_tflops(device, cfg.precision)
    began = time.monotonic()
    window_time, window_steps, last_saved, reason = 0.0, 0, engine.step if start else -1, "max_steps"
    state_bytes = None
    while engine.step < t.max_steps:
        mesh.ledger.reset()
        t0 = time.perf_counter()
        stats = engine.train_step(batch_source(train_ds, consumed, cfg, mesh))
        if device.type == "cuda":
            torch.cuda.synchronize()
        window_time += time.perf_counter() - t0
        window_steps += 1
        if state_bytes is None:  # measured once, after the first step (optimizer state exists, gathers happened)
            state_bytes = engine.dp.memory()
            if main:
                print(f"[train] model states per rank (rank 0, zero.stage={cfg.zero.stage}): "
                      + ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in state_bytes.items()), flush=True)
        consumed += g
        step = engine.step
        if stats["skipped"] and main:
            print(f"[train] step {step}: non-finite gradients (norm {stats['grad_norm']}), step skipped; "
                  f"loss scale {stats['loss_scale']:g} -> {engine.scaler.scale:g}", flush=True)
        if step % cfg.logging.interval == 0 or step == t.max_steps:
            tps = window_steps * tokens_per_step / window_time
            tflops = tps * flops_token / layout.world_size / 1e12
            logger.log({"step": step, "loss": stats["loss"], "lr": stats["lr"], "grad_norm": stats["grad_norm"],
                        "tokens_per_s": tps, "tflops_per_device": tflops,
                        "mfu": tflops / peak if peak else None, "peak_mem_bytes": peak_memory_bytes(device),
                        "comm": mesh.ledger.snapshot(), "step_time_s": window_time / window_steps,
                        "loss_scale": stats["loss_scale"], "skipped_steps": engine.skipped_steps,
                        "consumed_samples": consumed, "model_state_bytes": state_bytes, "time": time.time()})
            window_time, window_steps = 0.0, 0
        if valid_ds is not None and t.eval_interval and (step % t.eval_interval == 0 or step == t.max_steps):
            logger.log({"step": step, "val_loss": evaluate(engine, valid_ds, cfg, mesh)})
        if cfg.checkpoint.interval and step % cfg.checkpoint.interval == 0:
            ckpt.save(step, consumed)
            last_saved = step
        reason = _should_stop(stop, began, t.time_limit_minutes, mesh)
        if reason:
            break
    if cfg.checkpoint.save_at_exit and last_saved != engine.step and engine.step > 0:
        ckpt.save(engine.step, consumed)
    if main:
        print(f"[train] stopped at step {engine.step} ({reason or 'max_steps'})", flush=True)
    logger.close()
    return {"step": engine.step, "reason": reason or "max_steps", "run_dir": str(run_dir)}


def _should_stop(stop: StopFlag, began: float, limit_minutes: Optional[float], mesh: Mesh) -> Optional[str]:
    """Every rank stops at the same step: a signal or the time limit on any rank stops all."""
    code = 0.0
    if stop.signal:
        code = 2.0
    elif limit_minutes is not None and time.monotonic() - began >= limit_minutes * 60:
        code = 1.0
    flag = torch.tensor([code], device=mesh.device)
    comm.all_reduce(flag, mesh.world, op="max")
    return {0: None, 1: "time_limit", 2: "signal"}[int(flag.item())]


def evaluate(engine: Engine, valid_ds: Sampleable, cfg: Config, mesh: Mesh) -> float:
    """Mean loss over the first eval_iters global batches of the validation stream (the same every time)."""
    g = cfg.train.global_batch_size
    losses = [engine.eval_loss(batch_source(valid_ds, i * g, cfg, mesh)) for i in range(cfg.train.eval_iters)]
    return sum(losses) / len(losses)
