"""Metrics: the console line, ``<run_dir>/metrics.jsonl`` and wandb, fed the same numbers.

Only rank 0 writes. Each training record carries at least the contract keys:
step, loss, lr, grad_norm, tokens_per_s, tflops_per_device, mfu, peak_mem_bytes and
the step's communication ledger as ``comm``; validation records carry val_loss;
with ``zero.quant_error_interval`` set, sampled steps add a record with ``quant_error``
(``weights`` / ``gradients``: relative L2 error of ZeRO++'s quantized communication). A model with routed
experts adds ``moe`` to the training records (``training/moe.py``: the step's expert load max / mean, dropped
fraction, auxiliary and z losses and expert-bias range, per MoE layer), ``moe/...`` scalars in wandb.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import resource
from pathlib import Path
from typing import Any, Dict, Optional

import torch

from config import Config, to_dict

# Dense peak TFLOP/s by (GPU, precision), from the vendors' data sheets (SXM parts; fp32 uses TF32 cores).
PEAK_TFLOPS = {
    "H100": {"bf16": 989.0, "fp16": 989.0, "fp8": 1979.0, "fp32": 494.5},
    "H200": {"bf16": 989.0, "fp16": 989.0, "fp8": 1979.0, "fp32": 494.5},
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "fp8": 1513.0, "fp32": 378.0},
    "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 156.0},
    "V100": {"fp16": 125.0, "fp32": 15.7},
}


def peak_tflops(device: torch.device, precision: str) -> Optional[float]:
    """Peak of this device at this precision, or None when unknown (CPU, unlisted GPU, unsupported dtype)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key in sorted(PEAK_TFLOPS, key=len, reverse=True):  # most specific name first
        if all(part in name for part in key.split()):
            return PEAK_TFLOPS[key].get(precision)
    return None


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated GPU memory, or on CPU the process's peak resident set size."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


class MetricsLogger:
    """Appends to ``<run_dir>/metrics.jsonl``. A run starting at ``resume_step`` first drops the records of
    later steps (those of a run that went on after the checkpoint and died): this run logs them again, so
    each step appears once."""

    def __init__(self, cfg: Config, run_dir: Path, enabled: bool, resume_step: int = 0):
        self.enabled = enabled
        self.wandb = None
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        _drop_records_after(run_dir / "metrics.jsonl", resume_step)
        self.file = open(run_dir / "metrics.jsonl", "a", buffering=1)
        w = cfg.logging.wandb
        if w.mode != "disabled":
            import wandb  # imported only when used: it is slow to import and starts a service

            self.wandb = wandb.init(mode=w.mode, project=w.project, entity=w.entity, name=w.name or run_dir.name,
                                    dir=str(run_dir), config=to_dict(cfg), resume="allow", id=_wandb_id(run_dir))

    def log(self, record: Dict[str, Any]) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps(record) + "\n")
        print(format_line(record), flush=True)
        if self.wandb is not None:
            flat = {k: v for k, v in record.items()
                    if k not in ("step", "comm", "quant_error", "fp8", "moe") and v is not None}
            for k, v in record.get("fp8", {}).items():
                flat[f"fp8/{k}"] = v
            for what, err in record.get("quant_error", {}).items():
                if err is not None:
                    flat[f"quant_error/{what}"] = err
            flat.update(moe_scalars(record.get("moe")))
            for kind, n in record.get("comm", {}).get("by_kind", {}).items():
                flat[f"comm/{kind}_bytes"] = n
            for link, n in record.get("comm", {}).get("by_link", {}).items():
                flat[f"comm/{link}_bytes"] = n
            self.wandb.log(flat, step=record["step"])

    def close(self) -> None:
        if not self.enabled:
            return
        self.file.close()
        if self.wandb is not None:
            self.wandb.finish()


def moe_scalars(moe: Optional[Dict[str, Any]]) -> Dict[str, float]:
    """The MoE record (``training/moe.py``) as wandb scalars: ``moe/<key>`` for the whole model and
    ``moe/layer<i>/<key>`` per MoE layer (None values left out)."""
    if not moe:
        return {}
    out = {f"moe/{k}": v for k, v in moe.items() if k != "layers" and v is not None}
    for layer, row in moe.get("layers", {}).items():
        out.update({f"moe/layer{layer}/{k}": v for k, v in row.items() if v is not None})
    return out


def _drop_records_after(path: Path, step: int) -> None:
    """Rewrite ``path`` (atomically) without the records of steps after ``step`` and any torn last line."""
    if not path.is_file():
        return
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:  # a line cut short by a crash
            dropped += 1
            continue
        if isinstance(record, dict) and record.get("step", 0) > step:
            dropped += 1
        else:
            kept.append(line)
    if not dropped:
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)
    print(f"[metrics] {path}: dropped {dropped} record(s) after step {step}; this run logs those steps again",
          flush=True)


def _wandb_id(run_dir: Path) -> str:
    """A stable id per run directory, so a resumed run continues the same wandb run."""
    return hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:16]


def format_line(r: Dict[str, Any]) -> str:
    if "quant_error" in r:
        errs = [f"{k} {v:.2e}" for k, v in r["quant_error"].items() if v is not None]
        return f"step {r['step']:>6} | ZeRO++ relative quantization error: " + (", ".join(errs) or "none sampled")
    if "val_loss" in r:
        return f"step {r['step']:>6} | validation loss {r['val_loss']:.4f} | ppl {math.exp(min(r['val_loss'], 50)):.2f}"
    parts = [f"step {r['step']:>6}", f"loss {r['loss']:.4f}", f"lr {r['lr']:.2e}", f"grad_norm {r['grad_norm']:.3f}",
             f"{r['tokens_per_s']:,.0f} tok/s", f"{r['tflops_per_device']:.2f} TFLOP/s/dev"]
    parts.append(f"MFU {100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "MFU n/a")
    parts.append(f"mem {r['peak_mem_bytes'] / 2**30:.2f} GiB")
    comm = r.get("comm", {}).get("by_link", {})
    if comm.get("intra") or comm.get("inter"):
        parts.append(f"comm {comm.get('intra', 0) / 2**20:.1f}/{comm.get('inter', 0) / 2**20:.1f} MiB intra/inter")
    if r.get("skipped_steps"):
        parts.append(f"skipped {r['skipped_steps']}")
    if r.get("loss_scale", 1.0) != 1.0:
        parts.append(f"scale {r['loss_scale']:.0f}")
    if r.get("moe") and r["moe"].get("load_max_over_mean") is not None:
        parts.append(f"moe load max/mean {r['moe']['load_max_over_mean']:.2f}"
                     + (f", dropped {100 * r['moe']['dropped_frac']:.1f}%" if r["moe"].get("dropped_frac") else ""))
    if r.get("fp8"):
        f = r["fp8"]
        parts.append(f"fp8 mu {f['mu']:g} (overflow {100 * f['overflow_fraction']:.4f}%, {f['mu_changes']} changes)")
    return " | ".join(parts)
