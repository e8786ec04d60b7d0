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

import json
import operator
import os
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

from config import Config, gemm_precision, to_yaml, validate_config
from data.gpt_dataset import DATA_ORDER, Sampleable, build_datasets, get_batch
from data.indexed import DataError, fingerprint
from data.tokenizer import load_tokenizer
from model.compile import recompiles
from model.flops import flops_per_token, parameter_count
from parallel import comm
from parallel.launch import LaunchError, init_distributed, pick_device, read_launch_env
from parallel.layout import cp_spans, make_layout
from parallel.mesh import Mesh
from training.async_checkpoint import Saver
from training.checkpoint import Checkpointer, CheckpointError, checkpoint_root
from training.checkpoint_rules import check_init_from_path, check_start_checkpoint
from training.engine import Engine
from training.goodput import Goodput
from training.metrics import MetricsLogger, peak_memory_bytes, peak_tflops
from training.run_lock import RunLock, RunLockError
from training.stop import StopFlag


class DivergedError(RuntimeError):
    """Training cannot go on: non-finite gradients for too many steps, the fp16 loss-scale floor reached, or a run
    that reached train.max_steps without taking one step (all skipped: non-finite weights, a scale that overflows)."""


def check_data(cfg: Config, seed_names: Optional[List[str]] = None) -> Tuple[Sampleable, Optional[Sampleable]]:
    """Train and valid streams of the run's data, in data order 2, or 1 seeded by ``seed_names`` (see
    data/gpt_dataset.py: a checkpoint written in order 1 goes on in it). ``data.tokenizer`` is any tokenizer
    data/tokenizer.py reads (sentencepiece .model, tokenizer.json or a directory); data whose .idx records another
    tokenizer is refused (data/gpt_dataset.py check_tokenizer)."""
    tok = load_tokenizer(cfg.data.tokenizer)
    if tok.vocab_size > cfg.model.vocab_size:
        raise DataError(f"tokenizer {cfg.data.tokenizer} has {tok.vocab_size} tokens but model.vocab_size is "
                        f"{cfg.model.vocab_size}")
    return build_datasets(list(cfg.data.paths), list(cfg.data.weights) if cfg.data.weights else None,
                          list(cfg.data.split), cfg.model.seq_len, cfg.train.seed, vocab_size=tok.vocab_size,
                          seed_names=seed_names, tokenizer=tok,
                          document_eod=tok.eod_id if cfg.data.document_mask else None)


def batch_source(ds: Sampleable, first_sample: int, cfg: Config, mesh: Mesh) -> Callable[[int], tuple]:
    """Micro-batch m of this DP rank, for the global batch starting at ``first_sample``; under context parallelism
    only this rank's two chunks of each sequence (``parallel/context.py``), read as such."""
    micro, layout = cfg.train.micro_batch_size, mesh.layout
    base = first_sample + mesh.batch_rank * (cfg.train.global_batch_size // layout.batch_shards)
    spans = cp_spans(cfg.model.seq_len, layout.cp, mesh.cp_rank) if layout.cp > 1 else None
    eod = ds.document_eod if cfg.data.document_mask else None  # with document masks, their ids come third

    def get(mb: int):
        batch = get_batch(ds, range(base + mb * micro, base + (mb + 1) * micro), spans, eod)
        return tuple(t.to(mesh.device, non_blocking=True) for t in batch)

    return get


def check_switches() -> None:
    """Every environment switch a run reads later, read now: a bad value is one LaunchError naming it (exit 2)
    before a run directory or lock exists, not a traceback at the first step that uses it. GPT_COMPILE_BACKEND,
    GPT_CPU_GEMM, GPT_CPU_FP8_GEMM and FP8_PACKED through the functions that read them; ZEROPP_TRITON and
    ZEROPP_REFERENCE take 0 or 1 (another value was read as 0)."""
    from fp8.linear import cpu_fp32
    from fp8.zero_unit import packed_updates
    from model.compile import backend
    from parallel.cpu_gemm import upcasts

    for name in ("ZEROPP_TRITON", "ZEROPP_REFERENCE"):
        value = os.environ.get(name)
        if value not in (None, "", "0", "1"):
            raise LaunchError(f"{name} must be 0 or 1, got {value!r}")
    for read in (backend, cpu_fp32, lambda: packed_updates(torch.device("cpu")), lambda: upcasts(torch.bfloat16)):
        try:
            read()
        except ValueError as e:
            raise LaunchError(str(e)) from None


def _run_dir(cfg: Config, config_name: str, mesh: Mesh) -> Path:
    name = cfg.logging.run_dir
    if name is None and mesh.rank == 0:
        name = os.path.join("runs", f"{config_name}-{datetime.now().strftime('%Y%m%d-%H%M%S')}")
    return Path(comm.broadcast_object(name, 0, mesh.world))


def run(cfg: Config, config_name: str = "default", stop: Optional[StopFlag] = None) -> Dict[str, Any]:
    """Train; ``stop`` is the signal flag (train.py installs it before anything else)."""
    stop = stop or StopFlag()
    validate_config(cfg)
    env = read_launch_env()
    comm.check_trace()  # GPT_COMM_TRACE: a file or an unwritable place is found now, not at the first step
    check_switches()
    layout = make_layout(cfg, env.world_size, env.local_world_size)
    train_ds, valid_ds = check_data(cfg)
    device = pick_device(cfg.device, env)
    if device.type == "cpu" and env.local_world_size > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // env.local_world_size))
    init_distributed(env, device, cfg.parallel.timeout_s)
    try:
        mesh = Mesh(layout, device)
        run_dir = _run_dir(cfg, config_name, mesh)
        ckpt_dir = Path(cfg.checkpoint.dir or run_dir / "checkpoints")
        check_start(cfg, ckpt_dir, mesh)  # before anything is created: a refused checkpoint leaves nothing behind
        lock = _lock([run_dir, ckpt_dir], mesh)
        try:
            return _train(cfg, mesh, run_dir, ckpt_dir, train_ds, valid_ds, stop)
        finally:
            if lock is not None:
                lock.release()
    finally:
        dist.destroy_process_group()


def _lock(dirs, mesh: Mesh) -> Optional[RunLock]:
    """Rank 0 locks the run and checkpoint directories before anything is read or written there."""
    lock, error = None, None
    if mesh.rank == 0:
        try:
            lock = RunLock(dirs).acquire()
        except RunLockError as e:
            error = str(e)
    error = comm.broadcast_object(error, 0, mesh.world)
    if error is not None:
        raise RunLockError(error)
    return lock


def check_start(cfg: Config, ckpt_dir: Path, mesh: Mesh) -> None:
    """The checkpoint the run will start from, checked by its meta.json against the run's model and optimizer
    (training/checkpoint_rules.py check_start_checkpoint: the rules loading applies) before a run directory, lock or
    checkpoints/ exists, so a refusal leaves nothing behind: rank 0 reads, every rank raises its one line."""
    error = None
    if mesh.rank == 0:
        try:
            check_start_checkpoint(cfg, ckpt_dir)
        except CheckpointError as e:
            error = str(e)
        except Exception:  # noqa: BLE001 - unreadable here (the other ranks must not wait): the load names it
            pass
    error = comm.broadcast_object(error, 0, mesh.world)
    if error is not None:
        raise CheckpointError(error)


def _resume(cfg: Config, ckpt: Checkpointer, mesh: Mesh) -> Tuple[Optional[Path], int, Optional[List[str]]]:
    """Load the checkpoint to start from, if any; returns it, the samples consumed and, when it reads its data in
    data order 1, the names that seed that order (None: order 2)."""
    start = None
    if cfg.checkpoint.load:
        start = Path(cfg.checkpoint.load)
        if _weights_only(start):  # e.g. scripts/import_hf.py's output: nothing to resume but its weights
            _init_from(cfg, ckpt, mesh, start, "checkpoint.load")
            return None, 0, None
    elif cfg.checkpoint.resume:
        start = ckpt.find_resumable()
    if start is None:
        if cfg.checkpoint.init_from:
            _init_from(cfg, ckpt, mesh, Path(cfg.checkpoint.init_from), "checkpoint.init_from")
        return None, 0, None
    meta = ckpt.load(start)
    seed_names = _check_same_data(meta, ckpt.data_fingerprint, cfg, start, mesh)
    return start, meta["consumed_samples"], seed_names


def _weights_only(path: Path) -> bool:
    """Whether a checkpoint holds model weights and nothing to resume (its meta.json says ``weights_only``)."""
    try:
        return bool(json.loads((path / "meta.json").read_text()).get("weights_only"))
    except (OSError, ValueError, AttributeError):
        return False  # not readable here: Checkpointer.load names what is wrong with it


def _init_from(cfg: Config, ckpt: Checkpointer, mesh: Mesh, given: Path, key: str) -> None:
    """A fresh run starts from the weights of a checkpoint (``key`` is the setting that names it), or of the newest
    valid one under a checkpoint root or run directory."""
    path: Optional[Path] = given
    check_init_from_path(given, key)
    if not (given / "meta.json").is_file():
        path = Checkpointer(cfg, str(checkpoint_root(given)), ckpt.engine).find_resumable(quarantine=False)
        if path is None:
            raise CheckpointError(f"{key}={given} holds no checkpoint (expected meta.json, step_*/ or "
                                  "checkpoints/step_*/ there)")
    meta = ckpt.load_weights(path, key)
    if mesh.rank == 0:
        source = f", imported from {meta['imported_from']}" if meta.get("imported_from") else ""
        print(f"[train] model weights from {path} ({key}{source}; step {meta.get('step')} there); "
              "fresh optimizer, step 0", flush=True)
        if meta["rope_changes"]:
            print(f"[train] rotary embedding changed from the checkpoint's: {'; '.join(meta['rope_changes'])}",
                  flush=True)
        if meta["router_changes"]:
            print(f"[train] MoE router changed from the checkpoint's: {'; '.join(meta['router_changes'])}",
                  flush=True)


def _same_content(then: Dict[str, Any], now: Dict[str, Any]) -> bool:
    """Whether two data files' fingerprints (data.indexed.fingerprint) name the same data: by content where both
    record it, else (checkpoints from before content_sha256) by index hash and size."""
    if "content_sha256" in then and "content_sha256" in now:
        return then["content_sha256"] == now["content_sha256"]
    return (then.get("idx_sha256"), then.get("bin_bytes")) == (now.get("idx_sha256"), now.get("bin_bytes"))


def _blend(weights: Optional[List[float]], files: int) -> Optional[List[float]]:
    """What blend weights mean to the sample stream: nothing for one file, else their normalised values (as
    data.gpt_dataset.BlendedDataset computes them)."""
    if weights is None or files == 1:
        return None
    w = np.asarray(weights, dtype=np.float64)
    return (w / w.sum()).tolist()


def _check_same_data(meta: Dict[str, Any], now: Dict[str, Any], cfg: Config, path: Path,
                     mesh: Mesh) -> Optional[List[str]]:
    """A resumed run must read what the checkpoint's run read, or its data position means nothing.

    Refused (unless checkpoint.on_data_change=warn): other data files (by content: the same files moved or renamed
    are the same data), train.seed, data.split, data.weights or model.seq_len (the samples themselves), or a data
    order this version does not know. A changed train.global_batch_size is only reported: the run goes on reading
    the same sample stream from the same sample, so nothing is skipped or read twice (batch-size ramps need it).
    Returns the names seeding data order 1 when the checkpoint reads its data in that order (written before
    content-seeded shuffling, or resumed from such a one), so the run goes on in it; None for order 2."""
    then = meta.get("data")
    config = meta.get("config") or {}
    if then is None:
        problems = ["the checkpoint records no data fingerprint (written by an older version)"]
        order = 1
    else:
        order = then.get("order", 1)
        # Checkpoints from before seq_len entered the fingerprint have it in their config.
        then_seq = then.get("seq_len", (config.get("model") or {}).get("seq_len"))
        settings = [("train.seed", then.get("seed"), now["seed"]), ("data.split", then.get("split"), now["split"]),
                    ("data.weights", then.get("weights"), now["weights"]),
                    ("model.seq_len", then_seq, now["seq_len"])]
        same = {"data.weights": lambda old, new: _blend(old, len(now["files"])) == _blend(new, len(now["files"])),
                "model.seq_len": lambda old, new: old is None or old == new}  # None: not recorded
        problems = [f"{key}: checkpoint {old!r} vs now {new!r}" for key, old, new in settings
                    if not same.get(key, operator.eq)(old, new)]
        old_files, new_files = then.get("files", []), now["files"]
        if len(old_files) != len(new_files) or not all(
                _same_content(a["content"], b["content"]) for a, b in zip(old_files, new_files)):
            problems.append(f"data files: checkpoint read {[f['path'] for f in old_files]}, this run reads "
                            f"{[f['path'] for f in new_files]} and their contents differ")
        if not 1 <= order <= DATA_ORDER:
            problems.append(f"data order: checkpoint {order!r}, this version reads orders 1 to {DATA_ORDER} "
                            "(written by a newer version?)")
            order = DATA_ORDER
    if problems:
        msg = (f"checkpoint {path} was trained on other data ({'; '.join(problems)})" if then is not None else
               f"checkpoint {path} records no data fingerprint (older version): its data cannot be checked")
        if cfg.checkpoint.on_data_change == "error" and then is not None:
            raise CheckpointError(msg + ": its data position would not mean the same samples. Use the checkpoint's "
                                  "settings, or set checkpoint.on_data_change=warn to continue anyway")
        if mesh.rank == 0:
            print(f"[checkpoint] WARNING: {msg}; continuing (checkpoint.on_data_change="
                  f"{cfg.checkpoint.on_data_change})", flush=True)
    gbs_then = (then or {}).get("global_batch_size", (config.get("train") or {}).get("global_batch_size"))
    if mesh.rank == 0 and gbs_then is not None and gbs_then != cfg.train.global_batch_size:
        print(f"[checkpoint] train.global_batch_size: checkpoint {gbs_then} vs now {cfg.train.global_batch_size}; "
              f"the run reads on from sample {meta['consumed_samples']} of the same sample stream (nothing skipped "
              f"or read twice), {cfg.train.global_batch_size} a step", flush=True)
    if order != 1:
        return None
    # Data order 1: seeded by the basenames the checkpoint's run used, wherever the files are now.
    recorded = (then or {}).get("seed_names") or [os.path.basename(f["path"]) for f in (then or {}).get("files", [])]
    names = recorded if len(recorded) == len(now["files"]) else [os.path.basename(f["path"]) for f in now["files"]]
    if mesh.rank == 0:
        print(f"[checkpoint] {path} reads its data in data order 1 (each file shuffled by its name {names}, as "
              "before shuffling by content): the run goes on in that order, so its data position means the same "
              "samples", flush=True)
    return names


def _train(cfg, mesh, run_dir, ckpt_dir, train_ds, valid_ds, stop) -> Dict[str, Any]:
    layout, main = mesh.layout, mesh.rank == 0
    engine = Engine(cfg, mesh)
    cfg = engine.cfg  # precision=fp8: fp8.gemm resolved by the device (what config.yaml and checkpoints record)
    if main and engine.gemm_line:
        print(engine.gemm_line, flush=True)
    ckpt = Checkpointer(cfg, str(ckpt_dir), engine)
    ckpt.data_fingerprint = comm.broadcast_object(data_fingerprint(cfg) if main else None, 0, mesh.world)
    start, consumed, seed_names = _resume(cfg, ckpt, mesh)
    if seed_names is not None:  # the checkpoint's data order 1 goes on, and the run's checkpoints say so
        train_ds, valid_ds = check_data(cfg, seed_names)
        ckpt.data_fingerprint = {**ckpt.data_fingerprint, "order": 1, "seed_names": seed_names}
    logger = MetricsLogger(cfg, run_dir, enabled=main, resume_step=engine.step)
    if main:
        (run_dir / "config.yaml").write_text(to_yaml(cfg))
        params = parameter_count(cfg.model)
        print(f"[train] {layout.describe()}\n[train] model: {params['total'] / 1e6:.2f}M parameters "
              f"({params['non_embedding'] / 1e6:.2f}M non-embedding), run dir {run_dir}"
              + (f", resumed from {start} at step {engine.step}" if start else ""), flush=True)
    saver = Saver(cfg, ckpt, mesh)  # when and how saves happen: interval or auto, synchronous or async_save
    goodput = Goodput(cfg, mesh, run_dir, engine.step, stop)  # restarts counted, stragglers and hangs named
    failed: Optional[BaseException] = None
    try:
        return _loop(cfg, mesh, engine, saver, logger, train_ds, valid_ds, stop, start, consumed, run_dir, goodput)
    except BaseException as e:
        failed = e
        raise
    finally:
        goodput.close()
        # after an error an asynchronous write in flight finishes first, unless a peer is lost (it cannot)
        saver.close(peer_lost=isinstance(failed, comm.CommError))
        logger.close()


def _loop(cfg, mesh, engine, ckpt, logger, train_ds, valid_ds, stop, start, consumed, run_dir,
          goodput) -> Dict[str, Any]:
    layout, device, main = mesh.layout, mesh.device, mesh.rank == 0
    t, g = cfg.train, cfg.train.global_batch_size
    tokens_per_step = g * cfg.model.seq_len
    flops_token = flops_per_token(cfg.model)
    peak = peak_tflops(device, gemm_precision(cfg))
    began = time.monotonic()
    window_time, window_steps, last_saved = 0.0, 0, engine.step if start else -1
    state_bytes = None
    good, streak = start, 0  # last checkpoint saved outside a streak of skipped steps; the streak's length
    progressed, first_step = False, engine.step + 1  # whether a step of this process was taken (not skipped)
    reason = _should_stop(stop, began, t.time_limit_minutes, mesh)  # a signal during start-up stops here
    while not reason and engine.step < t.max_steps:
        mesh.ledger.reset()
        sample = bool(cfg.zero.quant_error_interval) and (engine.step + 1) % cfg.zero.quant_error_interval == 0
        if sample:
            engine.dp.sampling = True
        t0 = time.perf_counter()
        goodput.step_began(engine.step + 1)  # (the faults tests inject act here, inside the step's time)
        try:
            stats = engine.train_step(batch_source(train_ds, consumed, cfg, mesh),
                                      extra=lambda: _stop_flags(stop, began, t.time_limit_minutes))
        except FloatingPointError as e:
            raise DivergedError(f"training diverged at step {engine.step + 1}: {e}; "
                                + _last_good(good, start, progressed)) from None
        if device.type == "cuda":
            torch.cuda.synchronize()
        window_time += time.perf_counter() - t0
        window_steps += 1
        goodput.step_ended()
        if state_bytes is None:  # measured once, after the first step (optimizer state exists, gathers happened)
            state_bytes = engine.dp.memory()
            if main:
                phi = sum(p.numel() for p in engine.params.values())  # rank 0's parameters
                state = sum(v for k, v in state_bytes.items() if k != "working_peak")
                print(f"[train] model states per rank (rank 0, precision={cfg.precision}, zero.stage={cfg.zero.stage},"
                      f" {phi / 1e6:.2f}M parameters): "
                      + ", ".join(f"{k} {v / 2**20:.2f} MiB ({v / phi:.2f} B/param)" for k, v in state_bytes.items())
                      + f"; model state {state / phi:.2f} B/param (bf16 AdamW: 16)", flush=True)
        consumed += g
        step = engine.step
        streak = streak + 1 if stats["skipped"] else 0
        progressed = progressed or not stats["skipped"]
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
                        "consumed_samples": consumed, "model_state_bytes": state_bytes, "time": time.time(),
                        **goodput.record(step),  # restarts; the slowest rank's time vs the median
                        **({"fp8": engine.dp.fp8_record()} if engine.fp8_scaling is not None else {}),
                        **({"moe": stats["moe"]} if "moe" in stats else {}),
                        **({"recompiles": recompiles()} if engine.compiled else {}),
                        # zero.early_step: this step kept its early gathers (the next step's forward uses them); a
                        # skipped step keeps nothing (the strategy's flag is the last step taken's)
                        **({"early_step": engine.dp.last_early and not stats["skipped"]}
                           if getattr(engine.dp, "early", False) else {})})
            window_time, window_steps = 0.0, 0
        if sample:
            logger.log({"step": step, "quant_error": engine.dp.quant_error()})
        flags = stats["extra"]  # the stop flags as every rank had them during the step (its one all-reduce)
        if valid_ds is not None and t.eval_interval and (step % t.eval_interval == 0 or step == t.max_steps):
            logger.log({"step": step, "val_loss": evaluate(engine, valid_ds, cfg, mesh)})
            flags = None  # that took a while: ask again
        if ckpt.due(step) and progressed:  # (ckpt: the Saver; a failed asynchronous write is raised in due)
            good = _save(ckpt, step, consumed, good, streak)
            last_saved = step
            flags = None
        reason = _should_stop(stop, began, t.time_limit_minutes, mesh, flags)
    if engine.step >= first_step and not progressed:  # steps ran, all skipped: nothing to save, nothing learnt
        what = (f"every step since {'resuming from ' + str(start) if start else 'the start'} (steps {first_step}-"
                f"{engine.step}) had non-finite gradients (last loss {stats['loss']:g})")
        if reason is None:  # the run is over and never took a step: a failure, not a result
            raise DivergedError(f"training diverged: {what}; " + _last_good(good, start, progressed))
        if main:
            print(f"[train] {what}: nothing saved", flush=True)
    elif cfg.checkpoint.save_at_exit and last_saved != engine.step and engine.step > 0:
        _save(ckpt, engine.step, consumed, good, streak)
    ckpt.finish()  # an asynchronous save in flight is published (or its failure raised) before the run ends
    if main:
        print(f"[train] stopped at step {engine.step} ({reason or 'max_steps'})", flush=True)
    return {"step": engine.step, "reason": reason or "max_steps", "run_dir": str(run_dir)}


def _last_good(good: Optional[Path], start: Optional[Path], progressed: bool) -> str:
    """The end of a divergence message: the checkpoint to go back to, if any."""
    if start is not None and not progressed:  # resuming from it gave nothing but non-finite gradients
        return (f"no step since resuming from {start} was finite, so nothing was saved (its weights or optimizer "
                "state may not be finite: resume from an earlier checkpoint with checkpoint.load=...)")
    return f"last good checkpoint: {good or 'none'}" + (
        f" (resume from it with checkpoint.load={good})" if good else "; nothing was saved" if not progressed else "")


def _save(ckpt: Saver, step: int, consumed: int, good: Optional[Path], streak: int) -> Optional[Path]:
    """Save; during a streak of skipped steps the last checkpoint from before it is never pruned.
    Returns the last good checkpoint afterwards."""
    path = ckpt.save(step, consumed, protect=good if streak else None)
    return good if streak else path


def data_fingerprint(cfg: Config) -> Dict[str, Any]:
    """What decides the samples a data position stands for: data order version, file contents, split, weights,
    seed and sequence length; and the global batch (a change is reported, not refused)."""
    return {"order": DATA_ORDER, "seed": cfg.train.seed, "split": list(cfg.data.split),
            "weights": list(cfg.data.weights) if cfg.data.weights else None, "seq_len": cfg.model.seq_len,
            "global_batch_size": cfg.train.global_batch_size,
            "files": [{"path": p, "content": fingerprint(p)} for p in cfg.data.paths]}


def _stop_flags(stop: StopFlag, began: float, limit_minutes: Optional[float]) -> torch.Tensor:
    """This rank's reasons to stop now: [a signal arrived, the time limit is reached] as 0/1 (``parallel.volume``
    counts them as ``STOP_FLAGS`` values of the step's scalar all-reduce)."""
    late = limit_minutes is not None and time.monotonic() - began >= limit_minutes * 60
    return torch.tensor([float(bool(stop.signal)), float(late)], dtype=torch.float64)


def _should_stop(stop: StopFlag, began: float, limit_minutes: Optional[float], mesh: Mesh,
                 flags: Optional[torch.Tensor] = None) -> Optional[str]:
    """Every rank stops at the same step: a signal or the time limit on any rank stops all. ``flags``: the
    world's sum of ``_stop_flags`` already taken (in the step's all-reduce); else one all-reduce now."""
    if flags is None:
        flags = _stop_flags(stop, began, limit_minutes).to(mesh.device)
        comm.all_reduce(flags, mesh.world)
    signal, late = flags.tolist()
    return "signal" if signal > 0 else "time_limit" if late > 0 else None


def evaluate(engine: Engine, valid_ds: Sampleable, cfg: Config, mesh: Mesh) -> float:
    """Mean loss over the first eval_iters global batches of the validation stream (the same every time)."""
    g = cfg.train.global_batch_size
    losses = [engine.eval_loss(batch_source(valid_ds, i * g, cfg, mesh)) for i in range(cfg.train.eval_iters)]
    return sum(losses) / len(losses)
