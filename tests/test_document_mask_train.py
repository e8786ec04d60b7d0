"""Document masks in the trainer (data.document_mask): every layout trains the one-process masked model.

Data: tests/parallel_utils.py's learnable synthetic sequences with about one token in ten replaced by the EOD id
(2, the bundled tokenizer's), so documents of every length, one-token ones included, start anywhere in a sample and
cross CP chunks. The one-process run (cp 1: SDPA with the dense mask, itself checked against float64 in
tests/test_document_mask.py) is the reference; each layout must give the same losses, gradient norms, validation
loss and step-0 gradients within tests/test_context_train.py's tolerances, which are the dense layouts' (cp with its
log-sum-exp merge is the loosest). The masked reference must differ from the unmasked one, or equal curves would
prove nothing. Also: masking composes with train.compile without recompiling from micro-batch to micro-batch, and
the bad settings are one line.
"""
from __future__ import annotations

from typing import List

import numpy as np
import pytest
import torch

from tests.dist_harness import run_world
from tests.parallel_utils import assert_grads_match, synthetic_sample
from tests.test_context_train import NORM_RTOL, RTOL
from tests.test_moe_train import MOE

EOD = 2
STEPS = 4
BASE = ["model.seq_len=48", "data.document_mask=true"]  # cp 4: chunks of 6 tokens
GQA = ["model.n_kv_heads=2"]
LAYOUTS = {  # name: (world, overrides)
    "cp2_p2p_gqa_selective": (2, ["parallel.cp=2", *GQA, "model.activation_checkpointing=selective"]),
    "cp4_p2p": (4, ["parallel.cp=4"]),
    "cp4_all_gather_gqa": (4, ["parallel.cp=4", "parallel.cp_comm=all_gather", *GQA]),
    "cp2_all_gather_full_recompute": (2, ["parallel.cp=2", "parallel.cp_comm=all_gather",
                                          "model.activation_checkpointing=full"]),
    "cp4_a2a": (4, ["parallel.cp=4", "parallel.cp_comm=a2a"]),
    "cp2_a2a_gqa_reset": (2, ["parallel.cp=2", "parallel.cp_comm=a2a", *GQA, "data.reset_position_ids=true"]),
    "tp2_sp_gqa": (2, ["parallel.tp=2", "parallel.sequence_parallel=true", *GQA]),
    "pp2_vp2": (2, ["parallel.pp=2", "parallel.virtual_stages=2"]),
    "dp2_zero3": (2, ["zero.stage=3"]),
    "cp2_pp2_reset": (4, ["parallel.cp=2", "parallel.pp=2", "data.reset_position_ids=true"]),
    "tp2_reset": (2, ["parallel.tp=2", "data.reset_position_ids=true"]),
    "moe_dp2_ep2": (2, [*MOE, "parallel.ep=2"]),
    "moe_cp2_ep2_a2a": (4, [*MOE, "parallel.cp=2", "parallel.ep=2", "parallel.cp_comm=a2a"]),
}
MODEL_KEYS = ("model.", "precision", "data.", "train.seed")


class DocumentData:
    """A ``Sampleable`` of the synthetic sequences with EOD tokens: ~10% of positions, drawn per sample."""

    document_eod = EOD

    def __init__(self, seq_len: int, vocab: int):
        self.seq_len, self.vocab = seq_len, vocab

    def sample(self, index: int, lo: int = 0, hi=None) -> np.ndarray:
        t = synthetic_sample(index, self.seq_len, self.vocab)
        g = torch.Generator().manual_seed(20_000 + index)
        t[torch.rand(self.seq_len + 1, generator=g) < 0.1] = EOD
        return t.numpy()[lo:hi]


def _batches(engine, step: int):
    from training.trainer import batch_source

    cfg = engine.cfg
    return batch_source(DocumentData(cfg.model.seq_len, cfg.model.vocab_size), step * cfg.train.global_batch_size,
                        cfg, engine.mesh)


def worker(overrides: List[str], steps: int) -> dict:
    from tests.parallel_utils import build_engine, local_grads, tiny_config

    engine = build_engine(tiny_config(*overrides))
    losses, norms, grads = [], [], None
    for step in range(steps):
        stats = engine.train_step(_batches(engine, step))
        losses.append(stats["loss"])
        norms.append(stats["grad_norm"])
        if step == 0:
            grads = local_grads(engine)
    return {"losses": losses, "grad_norms": norms, "grads": grads, "val_loss": engine.eval_loss(_batches(engine, 1000))}


_references: dict = {}


def reference(overrides: List[str]) -> dict:
    model = tuple(o for o in BASE + overrides if o.startswith(MODEL_KEYS))
    if model not in _references:
        _references[model] = run_world(worker, 1, list(model), STEPS)[0]
    return _references[model]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_document_masked_layout_matches_one_process(name):
    world, overrides = LAYOUTS[name]
    ref = reference(overrides)
    out = run_world(worker, world, BASE + overrides, STEPS)
    for r in out:  # every rank reports the same losses
        assert r["losses"] == out[0]["losses"] and r["val_loss"] == out[0]["val_loss"]
    torch.testing.assert_close(torch.tensor(out[0]["losses"]), torch.tensor(ref["losses"]), rtol=RTOL, atol=0)
    torch.testing.assert_close(torch.tensor(out[0]["grad_norms"]), torch.tensor(ref["grad_norms"]),
                               rtol=NORM_RTOL, atol=0)
    assert abs(out[0]["val_loss"] - ref["val_loss"]) <= RTOL * ref["val_loss"]
    assert_grads_match([r["grads"] for r in out], ref["grads"])


def test_fp8_with_document_masks_tracks_one_process():
    """precision=fp8 (emulated FP8 linears, bf16 attention) at cp 2 with the ring's masked pairs: the one-process
    FP8 run's losses within tests/test_context_train.py's FP8 tolerance, 1e-3."""
    overrides = ["parallel.cp=2", "precision=fp8", "fp8.emulate=true"]
    ref = reference(overrides)
    out = run_world(worker, 2, BASE + overrides, STEPS)
    assert out[0]["losses"] == pytest.approx(ref["losses"], rel=1e-3)
    assert out[0]["val_loss"] == pytest.approx(ref["val_loss"], rel=1e-3)


def test_the_mask_changes_the_curve():
    """Masked and unmasked one-process runs differ (the data has documents), and both learn. Restarting the rotary
    positions changes rounding only: RoPE's scores depend on q - k, the same inside a document whatever its start
    (the positions themselves are checked in tests/test_document_mask.py)."""
    masked = reference([])
    unmasked = run_world(worker, 1, ["model.seq_len=48"], STEPS)[0]
    reset = reference(["data.reset_position_ids=true"])
    for run in (masked, unmasked):
        assert run["losses"][-1] < run["losses"][0] - 0.05
    assert abs(masked["losses"][1] - unmasked["losses"][1]) > 1e-3
    assert reset["losses"] == pytest.approx(masked["losses"], rel=1e-5)


def _compile_worker(compiled: bool) -> dict:
    from model.compile import recompiles
    from tests.parallel_utils import build_engine, tiny_config

    engine = build_engine(tiny_config(*BASE, "model.n_layers=1", f"train.compile={compiled}"))
    losses = [engine.train_step(_batches(engine, step))["loss"] for step in range(3)]
    return {"losses": losses, "recompiles": recompiles() if compiled else 0}


def test_compiled_blocks_take_the_mask_without_recompiling():
    """train.compile: each micro-batch's mask is an input of the compiled block (the same shape every time), so
    the second and third steps compile nothing new; the curve is eager's."""
    compiled = run_world(_compile_worker, 1, True, timeout=600, env={"GPT_COMPILE_BACKEND": "aot_eager"})[0]
    eager = run_world(_compile_worker, 1, False)[0]
    assert compiled["recompiles"] == 0
    assert compiled["losses"] == pytest.approx(eager["losses"], rel=1e-5)


def test_bad_settings_are_one_line(tmp_path):
    """train.py with data.document_mask=true on data whose documents do not end with the tokenizer's EOD (made
    with --no-eod), and with reset_position_ids alone: one error line each, exit 2, before any rank starts."""
    from data.indexed import IndexedDatasetWriter
    from tests.as_python import forked_python

    prefix = str(tmp_path / "noeod")
    with IndexedDatasetWriter(prefix, 4096) as writer:
        for i in range(40):
            writer.add_document([5 + i, 6, 7] * 20)
    common = ["train.py", f"logging.run_dir={tmp_path / 'run'}", "logging.wandb.mode=disabled"]
    cases = {"noeod.bin: document 0 ends with token 7, not the tokenizer's EOD id 2":
             [f"data.paths=[{prefix}]", "data.document_mask=true"],
             "data.reset_position_ids=true restarts positions at each document: it needs data.document_mask=true":
             ["data.reset_position_ids=true"]}
    for line, overrides in cases.items():
        proc = forked_python(*common, *overrides, timeout=120)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and line in lines[0], (proc.returncode, proc.stderr)
