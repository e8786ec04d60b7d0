"""The trainer on CUDA against the same trainer on CPU, the ZeRO-3 hooks on a GPU, CUDA memory against the
estimator, and checkpoints moving between GPU and CPU.

Runs go through ``training.trainer.run`` in this process (the path ``python train.py`` takes: NCCL at world
size 1 on CUDA, gloo on CPU) on the bundled sample corpus with the tiny preset, and are compared by their
per-step records (``metrics.jsonl``: loss and gradient norm). The CPU run of the same seed is the reference.

Tolerances (relative, per step, over 6 steps at the preset's learning rate after a 2-step warm-up), on the
loss, the first step's gradient norm (the same weights on both devices) and the later steps' (after the
trajectories have parted):
fp32 1e-4 / 1e-3 / 1e-3 (summation order, SDPA kernels; TF32 stays off);
bf16 / fp16 2e-2 / 5e-2 / 5e-2 (the same 16-bit roundings done in another order);
fp8 2e-3 / 1e-2 / 0.15. FP8 runs take 256-token steps (``FP8_SHAPE``: the CPU reference's FP8 GEMMs are slow),
and at that size the gradient norm of an FP8 run is chaotic once the weights differ in a few FP8 roundings:
two CPU runs that differ only in how the FP8 GEMM accumulates (``torch._scaled_mm`` against ``fp8.emulate``)
measured 0.07% apart at step 1 and up to 4.5% (clip 1.0) / 7% (no clipping) by steps 4-6, while their losses
stayed within 4e-4; an H100 against CPU measured 0.16% at step 1, 7% at step 6, losses within 2.2e-4. The CPU
reference runs FP8 GEMMs through ``torch._scaled_mm`` where this torch has it on CPU, else through
``fp8.emulate`` (the same operands multiplied after dequantizing). The loss falls by more than the loss
tolerance over the run (checked), and the gradient norms move by several times theirs from step to step, so a
broken step cannot pass.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Optional

import pytest
import torch

from tests.gpu.gpu_utils import cpu_scaled_mm_works, world_of_one

ROOT = Path(__file__).resolve().parents[2]
STEPS = 6
# (loss, gradient norm at step 1, gradient norm later): see the module docstring
TOL = {"fp32": (1e-4, 1e-3, 1e-3), "bf16": (2e-2, 5e-2, 5e-2), "fp16": (2e-2, 5e-2, 5e-2),
       "fp8": (2e-3, 1e-2, 0.15)}
# FP8 GEMMs on CPU (the reference) run at ~60 tokens/s: FP8 runs use 256-token steps (every GEMM dimension
# still a multiple of 16, as CUDA's _scaled_mm needs)
FP8_SHAPE = ["model.seq_len=64", "train.micro_batch_size=2", "train.global_batch_size=4"]


def _cfg(run_dir: Path, device: str, *overrides: str):
    from config import load_config

    return load_config(str(ROOT / "configs" / "tiny.yaml"), [
        f"device={device}", f"logging.run_dir={run_dir}", "logging.interval=1", "logging.wandb.mode=disabled",
        f"data.paths=[{ROOT / 'data/sample/sample_text_document'}]", f"data.tokenizer={ROOT / 'data/sample/tokenizer.model'}",
        f"train.max_steps={STEPS}", f"train.decay_steps={STEPS}", "train.warmup_steps=2", "train.eval_interval=0", "checkpoint.interval=0",
        # CUDA against CPU compares devices, eager on both; compiled against eager is its own test below
        "checkpoint.save_at_exit=false", "train.compile=false", *overrides])


def _train(run_dir: Path, device: str, *overrides: str) -> Dict[int, dict]:
    from training.trainer import run

    run(_cfg(run_dir, device, *overrides), "gpu-tier")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in records if "loss" in r}


def _compare(got: Dict[int, dict], want: Dict[int, dict], tol_loss: float, tol_norm: float, steps,
             tol_norm_later: Optional[float] = None) -> List[str]:
    bad = []
    for s in steps:
        norm_tol = tol_norm if s == min(steps) or tol_norm_later is None else tol_norm_later
        for key, tol in (("loss", tol_loss), ("grad_norm", norm_tol)):
            a, b = got[s][key], want[s][key]
            if not abs(a - b) <= tol * abs(b):
                bad.append(f"step {s} {key}: cuda {a:.6g} vs cpu {b:.6g} (rel {abs(a - b) / abs(b):.2e} > {tol:g})")
    return bad


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16", "fp8"])
def test_training_steps_on_cuda_match_cpu(tmp_path, precision):
    if precision == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no FP8 tensor cores on this GPU")
    extra = [f"precision={precision}", *(FP8_SHAPE if precision == "fp8" else [])]
    ref_extra = list(extra)
    if precision == "fp8" and not cpu_scaled_mm_works():
        ref_extra.append("fp8.emulate=true")
        print(f"torch {torch.__version__} has no CPU _scaled_mm: the CPU reference emulates the FP8 GEMMs")
    cpu = _train(tmp_path / "cpu", "cpu", *ref_extra)
    gpu = _train(tmp_path / "cuda", "cuda", *extra)
    assert sorted(gpu) == sorted(cpu) == list(range(1, STEPS + 1))
    tol_loss, tol_norm, tol_later = TOL[precision]
    for s in cpu:
        print(f"{precision} step {s}: loss cpu {cpu[s]['loss']:.5f} cuda {gpu[s]['loss']:.5f}; grad norm cpu "
              f"{cpu[s]['grad_norm']:.5f} cuda {gpu[s]['grad_norm']:.5f}")
    bad = _compare(gpu, cpu, tol_loss, tol_norm, sorted(cpu), tol_later)
    assert not bad, bad
    fall = cpu[1]["loss"] - cpu[STEPS]["loss"]
    assert fall > tol_loss * cpu[1]["loss"], f"the loss must fall for the comparison to mean anything ({fall})"
    assert gpu[STEPS]["peak_mem_bytes"] > 0


@pytest.mark.parametrize("precision,overrides", [("bf16", []), ("fp8", []), ("fp8", ["fp8.scaling=current"]),
                                                 ("bf16", ["zero.stage=3"])],
                         ids=["bf16", "fp8_delayed", "fp8_current", "bf16_zero3"])
def test_compiled_training_matches_eager_on_cuda(tmp_path, precision, overrides):
    """train.compile=true (blocks and loss through inductor) trains the steps eager CUDA trains, within the bf16 /
    FP8 tolerances of the device comparison, with validation in between (a second graph for no_grad) and no
    recompilation after the first two steps."""
    if precision == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no FP8 tensor cores on this GPU")
    extra = [f"precision={precision}", "train.eval_interval=2", *overrides, *(FP8_SHAPE if precision == "fp8" else [])]
    eager = _train(tmp_path / "eager", "cuda", *extra)
    compiled = _train(tmp_path / "compiled", "cuda", *extra, "train.compile=true")
    bad = _compare(compiled, eager, *TOL[precision][:2], sorted(eager), TOL[precision][2])
    assert not bad, bad
    # warm-up: step 1 (delayed FP8 runs it eagerly), step 2's compile, the first validation's no_grad graphs
    counts = [compiled[s]["recompiles"] for s in sorted(compiled)]
    assert len(set(counts[2:])) == 1, counts


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_zero3_gather_release_prefetch_on_cuda(tmp_path, precision):
    """ZeRO-3 (units gathered, released and prefetched by hooks, ZeRO++ options on) gives stage 0's steps.

    At one rank qwZ, qgZ and hpZ have no peer to talk to, so their collectives are skipped by design; their
    kernels are checked on CUDA in test_gpu_kernels.py and their multi-rank paths on CPU by the main suite."""
    if precision == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no FP8 tensor cores on this GPU")
    # FP8-LM moves weights and gradients in FP8 itself: qwZ / qgZ are bf16-only options
    zeropp = ["zero.quantized_weights=true", "zero.quantized_gradients=true"] if precision != "fp8" else []
    z3 = [f"precision={precision}", "zero.stage=3", "zero.prefetch_depth=3", "zero.reduce_in_flight=2", *zeropp,
          *(FP8_SHAPE if precision == "fp8" else [])]
    ref = _train(tmp_path / "cpu", "cpu", *z3)
    zero3 = _train(tmp_path / "stage3", "cuda", *z3)
    bad = _compare(zero3, ref, *TOL[precision][:2], sorted(ref), TOL[precision][2])
    assert not bad, bad
    # the stage-3 run really gathered and released: a working set was counted
    assert zero3[1]["model_state_bytes"]["working_peak"] > 0
    if precision == "bf16":  # bf16 ZeRO-3 is stage 0's arithmetic in other buffers (FP8-LM's stage 3 is not)
        base = _train(tmp_path / "stage0", "cuda", f"precision={precision}")
        assert not _compare(zero3, base, 1e-3, 1e-2, base), _compare(zero3, base, 1e-3, 1e-2, base)


def _warm_up_cublas(device: torch.device) -> None:
    """cuBLAS keeps a workspace per thread and stream, from the caching allocator: make the forward's and the
    autograd thread's before measuring, so they are not counted as model state."""
    a = torch.randn(64, 64, device=device, requires_grad=True)
    (a @ a).sum().backward()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        (a @ a).float().sum().backward()
    if torch.cuda.get_device_capability(device) >= (8, 9):
        from fp8.linear import fp8_linear
        from fp8.scaling import Fp8States
        from tests.test_fp8_linear import _cfg as fp8_cfg, _group

        x = torch.randn(16, 1, 64, device=device, requires_grad=True)
        fp8_linear(x, a, None, Fp8States(fp8_cfg()), _group(), sp_gather=False, emulate=False).sum().backward()
    torch.cuda.synchronize()


def _measure_memory(precision: str, stage: int) -> dict:
    """One engine on CUDA: bytes the CUDA allocator holds for model states after two steps, and the estimate."""
    import gc

    from config import load_config
    from parallel.layout import make_layout
    from parallel.mesh import Mesh
    from tests.parallel_utils import batch_fn
    from training.engine import Engine
    from training.memory import held_between_steps, model_state_bytes

    cfg = load_config(None, ["model.n_layers=6", "model.d_model=1024", "model.n_heads=16", "model.seq_len=256",
                             "model.vocab_size=32768", "train.micro_batch_size=4", "train.global_batch_size=8",
                             "logging.wandb.mode=disabled", f"precision={precision}", f"zero.stage={stage}",
                             "train.compile=false"])
    device = torch.device("cuda")
    _warm_up_cublas(device)
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    with world_of_one(device):
        before = torch.cuda.memory_allocated()
        engine = Engine(cfg, Mesh(make_layout(cfg, 1, 1), device))
        for step in range(2):
            engine.train_step(batch_fn(engine, step))
        torch.cuda.synchronize()
        gc.collect()
        held = torch.cuda.memory_allocated() - before
        working = getattr(engine.dp, "working", None)  # (stage 0 bf16/fp32 has no working buffers)
        out = {"allocator": held, "tensors": engine.dp.memory(),
               "estimate": model_state_bytes(cfg, engine.mesh.layout, 0),
               "working_now": working.now if working is not None else 0,
               "held": held_between_steps(cfg, engine.mesh.layout, 0)}
        del engine
    gc.collect()
    torch.cuda.empty_cache()
    return out


@pytest.mark.parametrize("precision,stage", [("bf16", 0), ("bf16", 3), ("fp32", 3), ("fp8", 0), ("fp8", 3)])
def test_cuda_memory_matches_the_estimator(precision, stage):
    """What the CUDA caching allocator holds after two steps is the estimator's model states (its persistent
    parts) plus what stays gathered between steps (``held_between_steps``: stage 3's gathers of the next forward's
    first modules, FP8-LM stage 0's bf16 weights), within 1% + 32 MiB (RNG and FP8 scaling state, loss scalars,
    cuBLAS workspaces of other streams). The estimator equals the tensors this strategy holds to the byte."""
    if precision == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no FP8 tensor cores on this GPU")
    m = _measure_memory(precision, stage)
    persistent = sum(v for k, v in m["estimate"].items() if k != "working_peak")
    tensors = sum(v for k, v in m["tensors"].items() if k != "working_peak")
    print(f"{precision} stage {stage}: allocator {m['allocator'] / 2**20:.1f} MiB, tensors {tensors / 2**20:.1f} MiB, "
          f"estimate {persistent / 2**20:.1f} MiB ({m['estimate']})")
    assert tensors == persistent, (m["tensors"], m["estimate"])
    assert m["working_now"] == m["held"], m
    kept = m["held"]
    slack = 0.01 * persistent + 32 * 2**20
    assert persistent + kept - slack <= m["allocator"] <= persistent + kept + slack, (m["allocator"], persistent, kept)


def test_checkpoint_moves_between_gpu_and_cpu(tmp_path):
    """Steps 1-2 on CUDA, 3-4 resumed on CPU from the CUDA checkpoint, 5-6 back on CUDA from the CPU one: every
    step's loss and gradient norm as in one uninterrupted CUDA run (fp32)."""
    whole = _train(tmp_path / "whole", "cuda")
    ckpt = tmp_path / "ckpt"
    common = [f"checkpoint.dir={ckpt}", "checkpoint.save_at_exit=true", "checkpoint.resume=true"]
    part = {}
    for device, stop, name in (("cuda", 2, "a"), ("cpu", 4, "b"), ("cuda", 6, "c")):
        part.update(_train(tmp_path / name, device, *common, f"train.max_steps={stop}"))
    assert sorted(part) == list(range(1, STEPS + 1))
    assert not _compare(part, whole, 1e-4, 1e-3, whole), _compare(part, whole, 1e-4, 1e-3, whole)
