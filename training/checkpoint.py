"""Checkpoints: layout-independent, atomic, verified.

On disk, under ``checkpoint.dir``::

    step_00000100/       one checkpoint (torch.distributed.checkpoint files + ours)
        .metadata, __*_*.distcp   model and optimizer tensors under global names and shapes
        meta.json                 step, data position, loss scaler, config, layout
        rng_rank00000.pt ...      per-rank RNG streams (restored when the layout is unchanged)
        manifest.json             size and sha256 of every file above; written last
    latest                       name of the newest published checkpoint; moved last

Tensors are saved as DTensors on each stage's (dp, tp) sub-mesh: TP-split
parameters as ``Shard(dim)``, the rest replicated; so a checkpoint written at one
(tp, pp, dp) loads at any other, optimizer state included (DCP reshards).

Saving writes into a hidden temporary directory, publishes it with one rename
once every rank has finished and the manifest is written, then moves ``latest``
and prunes old checkpoints (``training/checkpoint_publish.py``): a crash at any point leaves the previous
checkpoints intact. Loading verifies the manifest (sizes and hashes, spread over the ranks);
a corrupted checkpoint is renamed aside (``*.corrupt-<time>``) and the previous one
used, with a warning naming the file; if none is valid the run stops with a message
and changes nothing (``checkpoint.allow_fresh_start=true`` starts over instead). A
save that fails (e.g. a full disk) removes its partial files and keeps the previous
checkpoints. One trainer at a time writes a directory (``training/run_lock.py``).

What loading trusts: nothing in a checkpoint runs (training/safe_load.py reads every file as data: JSON,
``weights_only`` tensors, DCP metadata through an allow-list unpickler; every DCP load goes through its
``load_dcp``). Values are checked too: FP8 scales must be finite and positive, amax histories finite and
non-negative, mu within its bounds. What a checkpoint must share with the run that loads it (model, optimizer):
``training/checkpoint_rules.py``.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from config import Config, compute_precision, to_dict
from parallel import comm
from training.checkpoint_files import (STEP_DIR, checkpoint_root, file_digest, file_problem,  # noqa: F401 (also
                                       find_checkpoint, read_manifest, verify)  # imported from here by the scripts)
from training.checkpoint_rules import (MODEL_KEYS, MOE_KEYS, ROPE_KEYS, ROPE_SCALING_KEYS,  # noqa: F401 (model_record
                                       check_resume, check_weights, model_record,  # also imported from here by
                                       resumable)  # the scripts)
from training import checkpoint_publish
from training.checkpoint_publish import publish
from training.checkpoint_publish import save_error as _save_error  # noqa: F401 (tests reach it from here)
from training.checkpoint_publish import write_json as _write_json  # (tests replace it here: a full disk)
from training.engine import Engine
from training.safe_load import CheckpointError, check_rng_files, load_dcp, read_rng_file

FORMAT_VERSION = 1
_QUARANTINED = re.compile(r"^step_\d{8}\.corrupt-\d+$")
@dataclass
class SaveJob:
    """One save between ``Checkpointer.stage`` and ``Checkpointer.write``."""

    step: int
    final: Path
    tmp: Path
    protect: Optional[Path]
    error: Optional[str] = None
    """Why it failed already (the temporary directory could not be made, the state not taken)."""
    tensors: Optional[Dict[str, torch.Tensor]] = None
    rng: Optional[Dict[str, Any]] = None
    meta: Optional[Dict[str, Any]] = None
    """meta.json's contents (rank 0)."""
    release: Callable[[], None] = lambda: None
    """Drops the strategies' staging views once the tensors are written (synchronous save)."""


class Checkpointer:
    def __init__(self, cfg: Config, directory: str, engine: Engine):
        # the engine's config: ``cfg`` with what the engine resolved (precision=fp8: fp8.gemm by the device)
        self.cfg, self.engine, self.mesh = engine.cfg, engine, engine.mesh
        self.dir = Path(directory)
        self.world = self.mesh.world
        self.data_fingerprint: Optional[Dict[str, Any]] = None
        """What the run reads (data files, split, weights, seed), recorded in meta.json; set by the trainer."""

    # -- state ------------------------------------------------------------------------------------
    def _tensors(self, for_load: bool, with_optimizer: bool, fp8: bool = True,
                 reference: bool = True) -> Dict[str, torch.Tensor]:
        """Global-name -> this rank's part of each parameter (and AdamW moment), as the DP strategy holds it:
        DTensors for plain DP, shard views for ZeRO; both under global names and shapes. Under precision=fp8
        also the FP8 scaling state (amax histories and scales, ``fp8.<tensor role>.*``: identical on every
        TP and DP rank of a stage, so saved once) unless ``fp8`` is false (loading a checkpoint without it).
        With ZeRO's qWD, the reconstructed weights (``optim.<name>.weight_reference``) unless ``reference`` is
        false (loading a checkpoint without them)."""
        state: Dict[str, torch.Tensor] = {}
        scaling = self.engine.fp8_scaling
        if scaling is not None and fp8:
            state.update({f"fp8.{k}": v for k, v in scaling.state_dict().items()})
        # the MoE layers' expert biases (buffers, identical on every rank that holds the layer: saved once)
        state.update({f"model.{name}": t for name, t in self.engine.moe.buffers.items()})
        for name, entry in self.engine.dp.checkpoint_state(with_optimizer).items():
            p = self.engine.params[name]
            key = p.spec.shared_with or name
            if p.spec.shared_with is not None and not for_load:
                continue  # a tied copy is saved once, by its original
            state[f"model.{key}"] = entry["model"]
            if with_optimizer:  # AdamW's moments, or another train.optimizer's states (optimizers/tensor_rules.py)
                for moment, t in entry.items():
                    if moment not in ("model", "weight_reference"):
                        state[f"optim.{key}.{moment}"] = t
                if reference and "weight_reference" in entry:
                    state[f"optim.{key}.weight_reference"] = entry["weight_reference"]
        return state

    def _has_scaling(self) -> bool:
        """Whether this run has FP8 scaling states (its linears cast their operands to FP8: not with 16-bit GEMMs)."""
        return self.engine.fp8_scaling is not None and bool(self.engine.fp8_scaling.states)

    def _layout(self) -> Dict[str, int]:
        layout = self.mesh.layout
        return {"world_size": layout.world_size, "tp": layout.tp, "pp": layout.pp, "dp": layout.batch_shards,
                "cp": layout.cp, "virtual_stages": layout.virtual_stages}

    def _meta(self, step: int, consumed_samples: int) -> Dict[str, Any]:
        return {"format": FORMAT_VERSION, "step": step, "consumed_samples": consumed_samples,
                "skipped_steps": self.engine.skipped_steps, "loss_scaler": self.engine.scaler.state_dict(),
                "lr_schedule": self.engine.lr_schedule.state_dict(), "config": to_dict(self.cfg),
                "model": model_record(self.cfg.model),
                "layout": self._layout(), "data": self.data_fingerprint,
                "fp8": self.engine.dp.fp8_state() if self.engine.fp8_scaling is not None else None,
                "fp8_scaling": self._has_scaling(),
                "qwd_reference": getattr(self.engine.dp, "reference_kind", lambda: None)(),
                "time": time.time(), "torch": torch.__version__}

    # -- save -------------------------------------------------------------------------------------
    def save(self, step: int, consumed_samples: int, protect: Optional[Path] = None) -> Path:
        """Write, verify-hash and publish checkpoint ``step``; prune old ones except ``protect``.

        A failure on any rank (full disk, I/O error) removes the partial save, keeps every published
        checkpoint and raises CheckpointError naming the cause and the path on every rank.
        """
        return self.write(self.stage(step, consumed_samples, protect), self.world)

    def stage(self, step: int, consumed_samples: int, protect: Optional[Path] = None,
              copy: Optional[Callable[[Dict[str, torch.Tensor]], Dict[str, torch.Tensor]]] = None) -> SaveJob:
        """What saving ``step`` will write, taken now (collective): rank 0 makes the temporary directory (every rank
        learns whether it could), the state to write, the RNG streams and (rank 0) meta.json's contents. ``copy``
        (the asynchronous writer's) returns a copy of the state the training can go on beside; the strategies'
        staging views are then dropped at once, else after the write."""
        name = f"step_{step:08d}"
        job = SaveJob(step, self.dir / name, self.dir / f".{name}.tmp", protect)
        if self.mesh.rank == 0:
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
                for stale in self.dir.glob(".step_*.tmp"):  # a dead save of this run: the run lock excludes others
                    shutil.rmtree(stale, ignore_errors=True)
                job.tmp.mkdir()
            except OSError as e:
                job.error = _save_error(e, job.tmp)
        job.error = comm.broadcast_object(job.error, 0, self.world)
        job.release = self._release_staged
        if job.error is None:
            try:
                job.tensors = self._tensors(for_load=False, with_optimizer=True)
                if copy is not None:
                    job.tensors = copy(job.tensors)
            except (Exception, CheckpointException) as e:  # noqa: BLE001 - reported by write, on every rank
                job.error = _save_error(e, job.tmp)
            finally:
                if copy is not None or job.error is not None:  # (write releases them only after writing)
                    self._release_staged()
                    job.release = lambda: None
            job.rng = {"rng": self.engine.rng.state_dict(), "coords": self.mesh.layout.coords(self.mesh.rank)}
        if self.mesh.rank == 0:  # (a JSON copy: nothing in it changes while it waits to be written)
            job.meta = json.loads(json.dumps(self._meta(step, consumed_samples)))
        return job

    def _release_staged(self) -> None:
        getattr(self.engine.dp, "forget_staged", lambda: None)()  # 8-bit AdamW's fp32 views of its moments
        getattr(self.engine.dp, "after_save", lambda: None)()  # drop staging copies (fp8)

    def write(self, job: SaveJob, group: comm.Group) -> Path:
        """Write a staged save, hash this rank's files, and (rank 0) write meta.json and the manifest, then publish
        (``training/checkpoint_publish.py``). Collective over ``group`` (the world, or the asynchronous writer's
        group of the same ranks); raises CheckpointError on every rank if any failed, the partial save removed."""
        tmp, error = job.tmp, job.error
        hashes: Dict[str, Any] = {}
        if error is None:
            try:  # dcp.save gathers every rank's failure, so all ranks fail here together
                dcp.save(job.tensors, checkpoint_id=str(tmp),
                         process_group=None if group is self.world else group.pg)
                rng_file = tmp / f"rng_rank{self.mesh.rank:05d}.pt"
                torch.save(job.rng, rng_file)
                mine = [p for p in tmp.iterdir() if p.name.startswith(f"__{self.mesh.rank}_") or p == rng_file]
                hashes = {p.name: file_digest(p) for p in mine}
                checkpoint_publish.reached("written")
            except (Exception, CheckpointException) as e:  # noqa: BLE001 - reported below, on every rank
                error = _save_error(e, tmp)
            finally:
                job.tensors = None
                job.release()
        gathered = comm.all_gather_object((hashes, error), group)
        errors = [e for _, e in gathered if e]
        if self.mesh.rank == 0 and not errors:
            try:
                _write_json(tmp / "meta.json", job.meta)
                manifest = {k: v for h, _ in gathered for k, v in h.items()}
                for p in tmp.iterdir():
                    if p.name not in manifest:
                        manifest[p.name] = file_digest(p)
                _write_json(tmp / "manifest.json", {"format": FORMAT_VERSION, "files": manifest})
                checkpoint_publish.reached("manifest")
                self._publish(tmp, job.final, job.protect)
            except OSError as e:
                errors = [_save_error(e, tmp)]
        errors = comm.broadcast_object(errors, 0, group)
        if errors:
            if self.mesh.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            comm.barrier(group)
            latest = self.dir / "latest"
            kept = latest.read_text().strip() if latest.is_file() else None
            raise CheckpointError(f"{errors[0]}; the partial save was removed"
                                  + (f", the previous checkpoint {self.dir / kept} is kept" if kept else ""))
        return job.final

    def _publish(self, tmp: Path, final: Path, protect: Optional[Path] = None) -> None:
        publish(self.dir, tmp, final, self.cfg.checkpoint.keep_last, protect)

    # -- find and verify ----------------------------------------------------------------------------
    def _verify(self, path: Path) -> Optional[str]:
        """None if the checkpoint is complete and intact, else what is wrong (hashing spread over ranks)."""
        problem, files = read_manifest(path) if self.mesh.rank == 0 else (None, [])
        problem, files = comm.broadcast_object((problem, files), 0, self.world)
        if problem is not None:
            return problem
        for fname, entry in files[self.mesh.rank::self.world.size]:
            problem = file_problem(path / fname, entry)
            if problem:
                break
        problems = [p for p in comm.all_gather_object(problem, self.world) if p]
        return problems[0] if problems else None

    def find_resumable(self, quarantine: bool = True) -> Optional[Path]:
        """The newest valid checkpoint in the directory, or None for a directory that never held one.

        Corrupted checkpoints newer than the valid one are renamed aside (``quarantine``: so that the
        resumed run cannot later prune the good ones) or just skipped. With no valid checkpoint but
        unusable ones (corrupted, quarantined earlier, or a ``latest`` naming a missing one) the run
        stops and changes nothing, unless checkpoint.allow_fresh_start lets it train from step 0
        (then the corrupted ones are renamed aside, never deleted)."""
        names, quarantined, latest = [], [], None
        if self.mesh.rank == 0 and self.dir.is_dir():
            entries = [p.name for p in self.dir.iterdir()]
            names = sorted((n for n in entries if STEP_DIR.match(n)), reverse=True)
            quarantined = sorted(n for n in entries if _QUARANTINED.match(n))
            if (self.dir / "latest").is_file():
                latest = (self.dir / "latest").read_text().strip()
        names, quarantined, latest = comm.broadcast_object((names, quarantined, latest), 0, self.world)
        rejected = []
        for name in names:
            problem = self._verify(self.dir / name)
            if problem is None:
                for bad_name, bad_problem in rejected:
                    print(f"[checkpoint] WARNING: {bad_name} is not usable ({bad_problem}); "
                          f"resuming from {name} instead", flush=True)
                if quarantine:
                    self._quarantine([n for n, _ in rejected])
                return self.dir / name
            rejected.append((name, problem))
        unusable = [f"{n}: {p}" for n, p in rejected] + [f"{n} (quarantined earlier)" for n in quarantined]
        if latest and latest not in names:
            unusable.append(f"'latest' names {latest}, which is missing")
        if not unusable:
            return None
        details = "; ".join(unusable)
        if not self.cfg.checkpoint.allow_fresh_start:
            raise CheckpointError(f"no valid checkpoint in {self.dir}, nothing changed there: {details}. Refusing "
                                  "to train from step 0 over them: fix or move them (or checkpoint.load=<a good "
                                  "one>), or set checkpoint.allow_fresh_start=true to start over (unusable ones are "
                                  "then renamed aside as *.corrupt-*, never deleted)")
        if self.mesh.rank == 0:
            print(f"[checkpoint] WARNING: no valid checkpoint in {self.dir} ({details}); starting from step 0 "
                  "because checkpoint.allow_fresh_start=true", flush=True)
        if quarantine:
            self._quarantine([n for n, _ in rejected])
        return None

    def _quarantine(self, names: List[str]) -> None:
        if self.mesh.rank == 0:
            for name in names:
                os.rename(self.dir / name, self.dir / f"{name}.corrupt-{int(time.time())}")
        comm.barrier(self.world)

    # -- load -------------------------------------------------------------------------------------
    def load(self, path: Path, with_optimizer: bool = True) -> Dict[str, Any]:
        """Load a checkpoint into the engine (any layout); returns its meta (step, consumed_samples, ...).

        Nothing in it runs (see the module docstring). Impossible FP8 scaling values (a scale NaN, inf or <= 0,
        an amax history entry NaN, inf or < 0, mu outside its bounds) and RNG files that are not RNG states are
        refused with one line naming the tensor or file, on every rank. A resume (``with_optimizer``) into another
        precision says so on rank 0: FP8 scaling state is dropped (fp8 -> other) or starts fresh (other -> fp8), and
        the fp16 loss scale starts fresh (into fp16 compute: loss_scale.initial) or is dropped (out of it: 1)."""
        meta = self._read_meta(path, f"checkpoint {path}")
        check_resume(meta, self.cfg, path, resumable(self.cfg, self.dir), with_optimizer)  # model, optimizer
        saved_fp8 = meta.get("fp8") is not None  # a bf16 checkpoint has no FP8 scaling state: start it fresh
        run_fp8 = self.engine.fp8_scaling is not None
        # scales and amax histories exist where the linears cast to FP8 (not with 16-bit GEMMs: fp8.gemm); each
        # side's own, so a GEMM path change keeps mu and the optimizer state and starts or drops the scales
        saved_scaling = bool(meta.get("fp8_scaling", saved_fp8))  # (older checkpoints: every fp8 one had them)
        run_scaling = self._has_scaling()
        # qWD's reconstructed weights, where the checkpoint has them (a qWD run's); otherwise the next gather is exact
        zero = (meta.get("config") or {}).get("zero") or {}
        saved_reference = bool(zero.get("weight_delta")) and with_optimizer
        tensors = self._tensors(for_load=True, with_optimizer=with_optimizer, fp8=saved_scaling,
                                reference=saved_reference)
        loaded_reference = any(k.endswith(".weight_reference") for k in tensors)
        load_dcp(tensors, path)
        problem, rng = None, None
        try:  # every check before anything is applied, then all ranks agree (a lone failure would hang the rest)
            if saved_scaling and run_scaling:
                self.engine.fp8_scaling.load_state_dict(
                    {k[len("fp8."):]: v for k, v in tensors.items() if k.startswith("fp8.")})
            if saved_fp8 and run_fp8 and with_optimizer:
                self.engine.dp.load_fp8_state(meta["fp8"])  # mu, its clean-step count and change count
            check_rng_files(path, self.mesh.rank, self.world.size)
            rng_file = path / f"rng_rank{self.mesh.rank:05d}.pt"
            if with_optimizer and meta["layout"] == self._layout() and rng_file.is_file():
                rng = read_rng_file(rng_file)
        except ValueError as e:  # fp8/scaling.py, fp8/zero.py: names the tensor or value
            problem = f"checkpoint {path}: {e}"
        except CheckpointError as e:
            problem = str(e)
        problems = [p for p in comm.all_gather_object(problem, self.world) if p]
        if problems:
            raise CheckpointError(problems[0])
        # what the references mean (parallel/zero/sharded.py reference_kind); checkpoints from before the key: stage 3
        # saved them with the last step's differences pending (right after a step), stages 1-2 applied
        kind = meta.get("qwd_reference") or ("pending" if zero.get("stage") == 3 else "applied")
        self.engine.dp.after_load(**({"reference_loaded": True, "reference_kind": kind} if loaded_reference else {}))
        if with_optimizer:
            scaler = self._restore_counters(meta, rng)
            self._say_precision_change(meta, path, scaler)
        return meta

    def _say_precision_change(self, meta: Dict[str, Any], path: Path, scaler: Optional[str]) -> None:
        """One line on rank 0 when a resume changes the precision or the GEMM path: what happens to the FP8 scaling
        state, and to the fp16 loss scale (``scaler``) where fp16 compute starts or ends."""
        then = _saved_precision(meta)
        now, what = self.cfg.precision, []
        if self.mesh.rank != 0 or then is None:
            return
        if then == now == "fp8":
            saved = bool(meta.get("fp8_scaling", True))
            gemm_then = ((meta.get("config") or {}).get("fp8") or {}).get("gemm", "fp8")
            if saved != self._has_scaling():
                what.append("its FP8 scales and amax histories are dropped" if saved else
                            "FP8 scales and amax histories start fresh")
            if what or scaler:
                print(f"[checkpoint] resuming a precision=fp8 checkpoint with fp8.gemm={gemm_then} as fp8.gemm="
                      f"{self.cfg.fp8.gemm}: {'; '.join(what + [scaler] if scaler else what)}; mu and the FP8 "
                      f"optimizer state carry on ({path.name})", flush=True)
            return
        if then == now:
            return
        if then == "fp8":
            what.append("its FP8 scaling state (scales, amax histories, mu) is dropped")
        elif now == "fp8":
            what.append("FP8 scales, amax histories and mu start fresh")
        what += [scaler] if scaler else []
        print(f"[checkpoint] resuming a precision={then} checkpoint as precision={now}"
              f"{': ' + '; '.join(what) if what else ''} ({path.name})", flush=True)

    def _read_meta(self, path: Path, what: str) -> Dict[str, Any]:
        """The meta.json of a checkpoint whose files pass verification (sizes and hashes) and whose format we read."""
        problem = self._verify(path)
        if problem is not None:
            raise CheckpointError(f"{what} is not usable: {problem}")
        meta = json.loads((path / "meta.json").read_text())
        if meta.get("format") != FORMAT_VERSION:
            raise CheckpointError(f"{path}/meta.json: format {meta.get('format')} is not {FORMAT_VERSION}")
        return meta

    def load_weights(self, path: Path, key: str = "checkpoint.init_from") -> Dict[str, Any]:
        """``checkpoint.init_from``: only the model weights of a verified checkpoint (any layout, e.g. an imported
        Hugging Face model), into this engine (any layout); optimizer, step, loss scale, FP8 scaling state and
        RNG stay fresh. The model settings the checkpoint records must equal the run's: those every checkpoint
        has, plus the normalisation epsilon and key/value heads where it records them (imports do). The rotary
        settings may differ (a long-context phase extends the context by RoPE scaling or a new base: they shape no
        weight), and so may the router's (model.moe top_k, score, norm_topk, routed_scale); those that do are
        returned as ``meta["rope_changes"]`` and ``meta["router_changes"]``, one phrase each
        (training/checkpoint_rules.py). Returns its meta."""
        meta = self._read_meta(path, f"{key}={path}")
        changes = check_weights(meta, self.cfg.model, path, key)
        meta["rope_changes"], meta["router_changes"] = changes["rope"], changes["router"]
        tensors = self._tensors(for_load=True, with_optimizer=False, fp8=False)
        load_dcp(tensors, path)
        try:
            check_rng_files(path, self.mesh.rank, self.world.size)
            problem = None
        except CheckpointError as e:
            problem = str(e)
        problems = [p for p in comm.all_gather_object(problem, self.world) if p]
        if problems:
            raise CheckpointError(problems[0])
        self.engine.dp.after_load()
        return meta

    def _restore_counters(self, meta: Dict[str, Any], rng: Optional[Dict[str, torch.Tensor]]) -> Optional[str]:
        """Step counters and loss scale from meta.json; this rank's RNG streams when the layout is unchanged.
        Returns what happened to the loss scale when the checkpoint's scaler is not this precision's (fp16 compute
        on one side only: it starts fresh, or is dropped), else None."""
        engine = self.engine
        engine.step = meta["step"]
        engine.skipped_steps = meta["skipped_steps"]
        compute = _compute_precision(meta)  # states from before the scaler saved ``enabled``: on for fp16 compute
        restored = engine.scaler.load_state_dict({"enabled": compute == "fp16" if compute else engine.scaler.enabled,
                                                  **meta["loss_scaler"]})
        engine.dp.set_optimizer_steps(engine.step - engine.skipped_steps)
        if rng is not None and not engine.rng.load_state_dict(rng) and self.mesh.rank == 0:
            print("[checkpoint] the dropout RNG streams were saved on another kind of device (CUDA <-> CPU): "
                  "they restart from this run's seeding; everything else resumes exactly", flush=True)
        if restored:
            return None
        if engine.scaler.enabled:
            return f"the fp16 loss scale starts fresh at loss_scale.initial={engine.scaler.scale:g}"
        return (f"its fp16 loss scale {float(meta['loss_scaler']['scale']):g} is dropped "
                f"({compute_precision(self.cfg)} computes unscaled)")


def _saved_precision(meta: Dict[str, Any]) -> Optional[str]:
    """The ``precision`` of the run that wrote the checkpoint (older checkpoints: fp8 where they hold FP8 state), or
    None where it does not say."""
    return (meta.get("config") or {}).get("precision") or ("fp8" if meta.get("fp8") is not None else None)


def _compute_precision(meta: Dict[str, Any]) -> Optional[str]:
    """The compute precision of the run that wrote the checkpoint (config.compute_precision of its config), or None
    where its config does not say."""
    precision = _saved_precision(meta)
    if precision is None:
        return None
    gemm = ((meta.get("config") or {}).get("fp8") or {}).get("gemm", "fp8")
    return compute_precision(SimpleNamespace(precision=precision, fp8=SimpleNamespace(gemm=gemm)))
