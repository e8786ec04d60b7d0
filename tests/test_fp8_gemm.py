"""precision=fp8 with 16-bit GEMMs (``fp8.gemm``): FP8-LM on GPUs without FP8 tensor cores (V100, A100).

* the device rule reads the compute capability only: capabilities 7.0 to 12.0 under misleading names;
* with bf16 / fp16 GEMMs the linears are plain 16-bit ones (no FP8 scaling state) while the gradients still cross
  DP as FP8, byte for byte what the FP8-GEMM path moves (dp4 stage 0, tp2 x dp2 with ZeRO-1/2/3);
* fp16 GEMMs run under the dynamic loss scaler composed with mu: an fp16 overflow skips the step and halves the
  loss scale while mu holds; a clean step moves both by their own rules (the resume with both moving and steps
  skipped: ``tests/test_fp8_e2e.py``'s resume test, fp16 case);
* a checkpoint changes GEMM path on resume, saying what happens to the FP8 scales.

The tracking, bytes, memory and resume tests of ``tests/test_fp8_e2e.py`` run with every GEMM setting too.
"""
import pytest
import torch

from tests.dist_harness import run_world
from tests.parallel_utils import batch_fn, build_engine, tiny_config

FP8 = "precision=fp8"

# (capability, a name that would mislead a rule reading names, the GEMMs fp8.gemm=auto must pick)
CAPABILITIES = [
    ((7, 0), "NVIDIA H100 80GB HBM3", "fp16"),
    ((7, 5), "NVIDIA H200", "fp16"),
    ((8, 0), "NVIDIA H100 PCIe", "bf16"),
    ((8, 6), "NVIDIA L40S (fp8 ready)", "bf16"),
    ((8, 9), "Tesla V100-SXM2-32GB", "fp8"),
    ((9, 0), "NVIDIA A100-SXM4-80GB", "fp8"),
    ((10, 0), "Tesla V100 (renamed)", "fp8"),
    ((12, 0), "NVIDIA A100", "fp8"),
]


def _fake_cuda(monkeypatch, cap, name):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: cap)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: name)


@pytest.mark.parametrize("cap,name,expected", CAPABILITIES, ids=[f"{c[0]}.{c[1]}" for c, _, _ in CAPABILITIES])
def test_gemm_path_is_chosen_by_capability_never_by_name(monkeypatch, cap, name, expected):
    from config import ConfigError, Fp8Config
    from fp8.device import resolve_gemm, startup_line

    _fake_cuda(monkeypatch, cap, name)
    cuda = torch.device("cuda", 0)
    gemm, why = resolve_gemm(cuda, Fp8Config())
    assert gemm == expected, (cap, name, gemm, why)
    line = startup_line(Fp8Config(gemm=gemm), why)
    assert f"compute capability {cap[0]}.{cap[1]}" in line and name in line and "\n" not in line, line
    assert line.startswith({"fp8": "[fp8] FP8 GEMMs", "bf16": "[fp8] bf16 GEMMs", "fp16": "[fp8] fp16 GEMMs"}[gemm])
    assert ("loss scaler" in line) == (gemm == "fp16"), line
    # forcing: FP8 GEMMs only with FP8 tensor cores (one line naming the device, its capability and the way out);
    # the 16-bit paths anywhere (on Hopper they time the A100 and V100 paths)
    if expected == "fp8":
        assert resolve_gemm(cuda, Fp8Config(gemm="fp8"))[0] == "fp8"
    else:
        with pytest.raises(ConfigError) as info:
            resolve_gemm(cuda, Fp8Config(gemm="fp8"))
        msg = str(info.value)
        assert f"{cap[0]}.{cap[1]}" in msg and name in msg and "fp8.gemm=auto" in msg and "\n" not in msg, msg
    for forced in ("bf16", "fp16"):
        assert resolve_gemm(cuda, Fp8Config(gemm=forced))[0] == forced
    # emulated FP8 numerics take the device's 16-bit GEMMs
    assert resolve_gemm(cuda, Fp8Config(emulate=True))[0] == ("fp16" if cap < (8, 0) else "bf16")
    # and torch.compile can touch E4M3 tensors where Triton has the type: from 8.9 on
    from fp8.device import triton_has_e4m3

    assert triton_has_e4m3(cuda) == (expected == "fp8")


def test_cpu_runs_fp8_gemms_and_te_is_refused():
    from config import ConfigError, Fp8Config
    from fp8.device import resolve_gemm

    assert resolve_gemm(torch.device("cpu"), Fp8Config())[0] == "fp8"
    assert resolve_gemm(torch.device("cpu"), Fp8Config(emulate=True))[0] == "bf16"
    with pytest.raises(ConfigError, match=r"fp8\.backend=te.*fp8\.backend=torch"):
        resolve_gemm(torch.device("cpu"), Fp8Config(backend="te"))


@pytest.mark.parametrize("overrides,fragment", [
    (["fp8.gemm=fp4"], "fp8.gemm='fp4' is not one of ['auto', 'fp8', 'bf16', 'fp16']"),
    (["fp8.gemm=FP16"], "fp8.gemm='FP16' is not one of"),
    (["fp8.gemm=fp8", "fp8.emulate=true"], "fp8.emulate=true emulates FP8 numerics around 16-bit GEMMs"),
    (["fp8.grad_accumulation=fp8"], "fp8.grad_accumulation='fp8' is not one of"),
], ids=["unknown", "case", "emulate_with_fp8", "accumulation"])
def test_bad_gemm_settings_are_one_line_and_exit_2(capsys, overrides, fragment):
    """train.py's answer (its main's return value is the exit code): one problem line, no traceback."""
    import train

    assert train.main([FP8, *overrides]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()  # one wrong value: one line (issue 53 item 9)
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], err
    assert "Traceback" not in err


def gemm_worker(overrides, steps):
    """Per step: loss, skipped, the loss scale used and after, mu used, mu's change count after, the overflow
    fraction; whether the master weights moved; the engine's start-up line, scaling states and compute dtype."""
    cfg = tiny_config(FP8, *overrides)
    engine = build_engine(cfg)
    masters = lambda: torch.cat([u.master.float() for u in engine.dp.units])  # noqa: E731
    rows, before = [], masters()
    for step in range(steps):
        stats = engine.train_step(batch_fn(engine, step))
        after = masters()
        rec = engine.dp.fp8_record()
        rows.append({"loss": stats["loss"], "skipped": stats["skipped"], "scale": stats["loss_scale"],
                     "scale_after": engine.scaler.scale, "mu": rec["mu"], "mu_after": engine.dp.autoscale.mu,
                     "fraction": rec["overflow_fraction"], "moved": not torch.equal(after, before)})
        before = after
    return {"rows": rows, "line": engine.gemm_line, "states": len(engine.fp8_scaling.states),
            "dtype": str(engine.compute_dtype), "gemm": engine.cfg.fp8.gemm,
            "params": sorted({str(p.dtype) for p in engine.params.values()})}


# fp16 GEMMs with a loss scale that grows every clean step (growth interval 1) from where the tiny model's fp16
# gradients overflow, and mu growing every clean step: both move, skipped and taken steps alternate
FP16_MOVING = ["fp8.gemm=fp16", "loss_scale.initial=16777216", "loss_scale.growth_interval=1",
               "fp8.mu_growth_interval=1"]


def test_fp16_overflow_skips_the_step_halves_the_loss_scale_and_holds_mu():
    out = run_world(gemm_worker, 1, FP16_MOVING, 10)[0]
    assert out["gemm"] == "fp16" and out["dtype"] == "torch.float16" and out["params"] == ["torch.float16"]
    assert out["states"] == 0, "16-bit GEMMs: no FP8 linears, no scaling state"
    rows = out["rows"]
    skipped = [r for r in rows if r["skipped"]]
    taken = [r for r in rows if not r["skipped"]]
    assert skipped and taken, rows
    for r in skipped:  # the fp16 backward overflowed: the loss scaler's business, mu is not touched
        assert r["scale_after"] == r["scale"] / 2 and r["mu_after"] == r["mu"] and not r["moved"], r
    threshold = tiny_config(FP8).fp8.mu_overflow_threshold
    for r in taken:  # a clean fp16 step: S grows (interval 1); mu halves on FP8 saturation, else grows
        assert r["scale_after"] == r["scale"] * 2 and r["moved"], r
        assert r["mu_after"] == (r["mu"] / 2 if r["fraction"] > threshold else r["mu"] * 2), r
    assert any(r["fraction"] > threshold for r in taken) and any(r["fraction"] <= threshold for r in taken), rows


def wire_worker(overrides, steps):
    cfg = tiny_config(*overrides)
    engine = build_engine(cfg)
    for step in range(steps):
        engine.mesh.ledger.reset()
        engine.train_step(batch_fn(engine, step))
    return {f"{kind}/{group}": n for (kind, _, group), n in engine.mesh.ledger.bytes.items()}


WIRE = {
    "dp4": (4, []),
    "tp2_sp_dp2_zero1": (4, ["parallel.tp=2", "parallel.sequence_parallel=true", "zero.stage=1"]),
    "tp2_dp2_zero2": (4, ["parallel.tp=2", "zero.stage=2"]),
    "tp2_dp2_zero3": (4, ["parallel.tp=2", "zero.stage=3"]),
}


@pytest.mark.parametrize("name", list(WIRE))
def test_16bit_gemms_move_the_fp8_paths_gradient_and_weight_bytes(name):
    """Over DP, the 16-bit GEMM paths move exactly what the FP8-GEMM path moves (FP8 gradients, 1 byte an element,
    and E4M3 weights), except the delayed-scaling amax reduction they have no use for; over TP they move the
    16-bit activations of plain bf16 linears."""
    from parallel.layout import make_layout
    from parallel.volume import fp8_amax_bytes

    world, overrides = WIRE[name]
    fp8 = run_world(wire_worker, world, [FP8, "fp8.gemm=fp8", *overrides], 2)
    cfg = tiny_config(FP8, *overrides)
    layout = make_layout(cfg, world, world)
    for gemm in ("bf16", "fp16"):
        other = run_world(wire_worker, world, [FP8, f"fp8.gemm={gemm}", *overrides], 2)
        for rank, (a, b) in enumerate(zip(fp8, other)):
            dp = {k for k in a if k.endswith("/dp")} | {k for k in b if k.endswith("/dp")}
            assert any(k.startswith(("all_to_all", "all_gather")) for k in dp), a
            for key in dp - {"all_reduce/dp"}:
                assert a.get(key) == b.get(key), (gemm, rank, key, a, b)
            # the FP8-GEMM run also all-reduces its amaxes over DP (the ledger holds the second step: the first also
            # initialises every scale), nothing else
            linears = 4 * cfg.model.n_layers
            amax = fp8_amax_bytes(cfg, layout, linears, layout.num_microbatches)["dp"]
            assert abs(a["all_reduce/dp"] - b["all_reduce/dp"] - amax) <= 16, (gemm, rank, a, b, amax)


def _trainer_worker(run_dir, extra):
    from tests.dist_harness import train_main

    root = __import__("pathlib").Path(__file__).resolve().parents[1]
    sample = root / "data" / "sample"
    code, out, err = train_main(["--config", str(root / "configs" / "tiny.yaml"), f"logging.run_dir={run_dir}",
                                 "train.max_steps=2", "train.eval_interval=0", "logging.interval=1",
                                 "checkpoint.interval=0", "checkpoint.save_at_exit=false",
                                 "logging.wandb.mode=disabled",
                                 "model.n_layers=1", "train.micro_batch_size=4", "train.global_batch_size=8",
                                 f"data.paths=[{sample / 'sample_text_document'}]",
                                 f"data.tokenizer={sample / 'tokenizer.model'}", FP8, *extra])
    return code, out, err


@pytest.mark.parametrize("gemm,line", [
    ("auto", "[fp8] FP8 GEMMs (fp8.gemm=auto: CPU runs FP8 GEMMs)"),
    ("fp16", "[fp8] fp16 GEMMs of the step's fp16 working weights, activations not quantized (fp8.gemm=fp16 (forced) "
             "on CPU)")], ids=["auto", "fp16"])
def test_the_trainer_says_which_gemms_run_and_records_the_resolved_setting(tmp_path, gemm, line):
    """The start-up line names the GEMM path and why; config.yaml records what ran (auto resolved), and the
    metrics carry the loss scale where fp16 GEMMs run under it."""
    import json

    import yaml

    code, out, err = run_world(_trainer_worker, 1, tmp_path / "run", [f"fp8.gemm={gemm}"])[0]
    assert code == 0, err[-2000:]
    said = [s for s in out.splitlines() if s.startswith("[fp8]")]
    assert len(said) == 1 and said[0].startswith(line), out
    recorded = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["fp8"]["gemm"]
    assert recorded == ("fp8" if gemm == "auto" else gemm)
    records = [json.loads(s) for s in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    scales = [r["loss_scale"] for r in records if "loss_scale" in r]
    assert scales and all((s > 1) == (gemm == "fp16") for s in scales), scales


def _compile_worker(overrides, has_e4m3):
    """The engine's compile decisions with Triton's E4M3 support as given (no CUDA here: the rule is stubbed)."""
    import fp8.zero
    import training.engine
    from config import ConfigError

    for module in (training.engine, fp8.zero):
        module.triton_has_e4m3 = lambda device: has_e4m3
    try:
        engine = build_engine(tiny_config(FP8, "train.compile=true", *overrides))
    except ConfigError as e:
        return {"error": str(e)}
    return {"compiled": engine.compiled, "line": engine.gemm_line,
            "unit_update_compiled": engine.dp._unit_update is not fp8.zero.unit_update}


@pytest.mark.parametrize("overrides,has_e4m3,expect", [
    (["fp8.gemm=bf16"], False, dict(compiled=True, unit_update_compiled=False, line="runs eager")),
    (["fp8.gemm=bf16"], True, dict(compiled=True, unit_update_compiled=True, line=None)),
    (["fp8.emulate=true"], False, dict(error="train.compile=true with fp8.emulate=true needs compute capability")),
], ids=["a100_16bit_gemms", "fp8_capable", "a100_emulated"])
def test_fp8_work_is_compiled_only_where_triton_has_e4m3(overrides, has_e4m3, expect):
    """Below compute capability 8.9 Triton has no E4M3 type: FP8-LM's per-unit work runs eager there (said in the
    start-up line), and compiled blocks with emulated E4M3 casts are refused (train.compile=true)."""
    out = run_world(_compile_worker, 1, overrides, has_e4m3, env={"FP8_PACKED": "1"})[0]
    if "error" in expect:
        assert expect["error"] in out.get("error", ""), out
        return
    assert out["compiled"] == expect["compiled"] and out["unit_update_compiled"] == expect["unit_update_compiled"]
    assert (expect["line"] in out["line"]) if expect["line"] else "eager" not in out["line"], out["line"]
