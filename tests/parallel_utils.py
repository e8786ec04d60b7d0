"""Shared pieces of the multi-process tests: a tiny config, synthetic batches, gradient gathering."""
from __future__ import annotations

from typing import Dict, List

import torch
import torch.distributed as dist

from config import Config, load_config
from parallel.layout import make_layout
from parallel.mesh import Mesh
from training.engine import Engine

BASE = ["model.n_layers=4", "model.d_model=64", "model.n_heads=4", "model.seq_len=32", "model.vocab_size=128",
        "model.ffn_hidden=128", "train.micro_batch_size=2", "train.global_batch_size=8", "train.grad_clip=0",
        "train.warmup_steps=2", "train.max_steps=10", "train.lr=3e-3", "logging.wandb.mode=disabled"]


def tiny_config(*overrides: str) -> Config:
    return load_config(None, BASE + list(overrides))


def synthetic_sample(index: int, seq_len: int, vocab: int) -> torch.Tensor:
    """seq_len + 1 tokens of global sample ``index``, the same on every rank and layout.

    Learnable: each sequence follows t[i+1] = (a * t[i] + c) mod vocab with (a, c) drawn from a few
    patterns, plus 10% random tokens, so losses fall quickly and any layout error shows in the curve.
    """
    g = torch.Generator().manual_seed(10_000 + index)
    a, c = [(1, 1), (3, 7), (5, 2), (7, 11)][int(torch.randint(0, 4, (1,), generator=g))]
    t = torch.empty(seq_len + 1, dtype=torch.long)
    t[0] = torch.randint(0, vocab, (1,), generator=g)
    for i in range(seq_len):
        t[i + 1] = (a * t[i] + c) % vocab
    noise = torch.rand(seq_len + 1, generator=g) < 0.1
    return torch.where(noise, torch.randint(0, vocab, (seq_len + 1,), generator=g), t)


class SyntheticData:
    """A ``Sampleable`` of learnable synthetic sequences (numpy, like the real datasets)."""

    def __init__(self, seq_len: int, vocab: int):
        self.seq_len, self.vocab = seq_len, vocab

    def sample(self, index: int, lo: int = 0, hi=None):
        return synthetic_sample(index, self.seq_len, self.vocab).numpy()[lo:hi]


def batch_fn(engine: Engine, step: int):
    """Micro-batches of this DP rank at a given step, sliced from the global batch by the trainer's own code."""
    from training.trainer import batch_source

    cfg = engine.cfg
    data = SyntheticData(cfg.model.seq_len, cfg.model.vocab_size)
    return batch_source(data, step * cfg.train.global_batch_size, cfg, engine.mesh)


def build_engine(cfg: Config) -> Engine:
    layout = make_layout(cfg, dist.get_world_size(), cfg.parallel.ranks_per_node or dist.get_world_size())
    return Engine(cfg, Mesh(layout, torch.device("cpu")))


def local_grads(engine: Engine) -> Dict[str, tuple]:
    """Each rank's gradient shards of DP replica 0: name -> (tp_dim, TP piece, grad) (several TP ranks may hold
    the same piece: grouped-query attention's replicated KV heads); routed experts split over expert parallelism
    come from the EP group of DP rank 0, as (0, EP rank, grad)."""
    if hasattr(engine.dp, "unsharded_grads"):  # ZeRO: gather the shards (a collective over DP)
        grads = engine.dp.unsharded_grads()
    else:
        grads = {n: p.grad.detach().clone() for n, p in engine.params.items()}
    mesh = engine.mesh
    if mesh.edp_rank != 0:
        return {}
    # routed experts under expert parallelism: EP rank r holds piece r of dim 0 (the first DP replica of each)
    return {n: (0, mesh.ep_rank, grads[n]) if p.spec.expert else
            (p.spec.tp_dim, p.spec.tp_piece(mesh.tp_rank), grads[n]) for n, p in engine.params.items()
            if p.spec.shared_with is None and (mesh.dp_rank == 0 or p.spec.expert)}


def assemble(per_rank: List[Dict[str, tuple]]) -> Dict[str, torch.Tensor]:
    """Global tensors from TP shards gathered from every rank."""
    shards: Dict[str, list] = {}
    for d in per_rank:
        for name, (dim, tp_rank, t) in d.items():
            shards.setdefault(name, []).append((dim, tp_rank, t))
    out = {}
    for name, parts in shards.items():
        dim = parts[0][0]
        if dim is None:
            out[name] = parts[0][2]
        else:
            uniq = {r: t for _, r, t in parts}
            out[name] = torch.cat([uniq[r] for r in sorted(uniq)], dim=dim)
    return out


def train_worker(overrides: List[str], steps: int):
    """Train ``steps`` steps on synthetic data; return losses and step-0 gradient shards."""
    cfg = tiny_config(*overrides)
    engine = build_engine(cfg)
    losses, norms, grads = [], [], None
    for step in range(steps):
        engine.mesh.ledger.reset()
        early = getattr(engine.dp, "last_early", False)  # the last step's forward uses early gathers (volume.py)
        stats = engine.train_step(batch_fn(engine, step))
        comm = engine.mesh.ledger.snapshot()  # the last step's traffic, before any test-only gathering
        losses.append(stats["loss"])
        norms.append(stats["grad_norm"])
        if step == 0:
            grads = local_grads(engine)
    released = engine.runner.released_bytes
    val_loss = engine.eval_loss(batch_fn(engine, 1000))  # forward-only schedule on held-out samples
    return {"losses": losses, "grad_norms": norms, "grads": grads, "max_in_flight": engine.runner.max_in_flight,
            "comm": comm, "early": early, "val_loss": val_loss,
            "released_bytes": released}


def checkpoint_worker(overrides: List[str], start_from: str, steps: int, ckpt_dir: str, validate_after=()):
    """Train to ``steps`` (resuming from ckpt_dir when start_from == 'resume'); save at the end if 'fresh'. Losses by
    the step index (0 = the first step); a validation pass after the steps that reach ``validate_after`` (its loss
    as ``val<step reached>``)."""
    from training.checkpoint import Checkpointer

    cfg = tiny_config(*overrides)
    engine = build_engine(cfg)
    ckpt = Checkpointer(cfg, ckpt_dir, engine)
    if start_from == "resume":
        ckpt.load(ckpt.find_resumable())
    losses = {}
    while engine.step < steps:
        step = engine.step
        losses[step] = engine.train_step(batch_fn(engine, step))["loss"]
        if engine.step in validate_after:
            losses[f"val{engine.step}"] = engine.eval_loss(batch_fn(engine, 1000 + engine.step))
    if start_from == "fresh":
        ckpt.save(engine.step, engine.step * cfg.train.global_batch_size)
    return losses


def assert_grads_match(per_rank: List[Dict[str, tuple]], reference: Dict[str, tuple], rtol: float = 1e-5) -> None:
    """Gradients assembled from every rank's TP shards equal the single-process ones (relative to their max)."""
    grads, ref_grads = assemble(per_rank), assemble([reference])
    assert grads.keys() == ref_grads.keys()
    for key in grads:
        scale = ref_grads[key].abs().max().clamp_min(1e-12)
        err = (grads[key] - ref_grads[key]).abs().max() / scale
        assert err < rtol, f"{key}: gradient differs from single process by {err:.2e} (relative to max)"
