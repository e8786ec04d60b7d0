"""--calibrate with what the benchmark scripts write (training/plan/measured.py): scripts/bench_fp8.py's --json
(written here by the script itself, its runs replaced by given measurements), a scripts/gpu_check.sh OUTDIR,
scripts/bench_cluster.py's rows and its probe. References: the measured figures fed in, and hand arithmetic."""
from __future__ import annotations

import json

import pytest
import torch

from config import load_config
from scripts import bench_fp8, plan
from scripts._cli import run
from training.plan import evaluate, make_cluster
from training.plan.calibrate import calibrated
from training.plan.devices import DEVICES, LINK_EFFICIENCY

TINY = "configs/tiny.yaml"


def _bench_fp8_file(tmp_path, monkeypatch, measured: dict, device: str = "NVIDIA H100 80GB HBM3"):
    """scripts/bench_fp8.py --json as the script writes it, each trainer row's run returning ``measured``'s
    tokens/s for its precision (the peers off)."""
    def fake_run(preset, precision, recompute, args, out):
        return {"tokens_per_s": measured[precision], "best": measured[precision], "tflops": 1.0, "mfu": 0.1,
                "peak_mem_gib": 1.0, "loss": 5.0}

    monkeypatch.setattr(bench_fp8, "run", fake_run)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the header's device name: the GPU's
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: device)
    path = tmp_path / "bench_fp8.json"
    code = run(bench_fp8.main, ["--presets", "tiny", "--precisions", *measured, "--recompute", "off", "--steps", "3",
                                "--warmup", "1", "--micro-batch", "2", "--accum", "2", "--no-peers", "--json",
                                str(path)])
    assert code == 0
    return path


def _tiny(precision: str):
    return load_config(TINY, [f"precision={precision}", "model.activation_checkpointing=off",
                              "train.micro_batch_size=2", "train.global_batch_size=4"])


def test_bench_fp8_rows_fit_the_gemm_rates_to_the_measured_steps(tmp_path, monkeypatch):
    plain = make_cluster("h100", 1)
    before = {p: evaluate(_tiny(p), plain)["tokens_per_s"] for p in ("bf16", "fp8")}
    measured = {"bf16": 0.6 * before["bf16"], "fp8": 0.7 * before["fp8"]}  # slower than the table says
    path = _bench_fp8_file(tmp_path, monkeypatch, measured)
    data = json.loads(path.read_text())
    assert data["source"] == "scripts/bench_fp8.py" and [r["precision"] for r in data["rows"]] == ["bf16", "fp8"]
    for cal in (str(path), str(tmp_path)):  # the file, and a gpu_check.sh OUTDIR holding it
        cluster = calibrated(plain, _tiny("bf16"), cal)
        assert cluster.device.gemm_ceiling < DEVICES["h100"].gemm_ceiling
        for precision in ("bf16", "fp8"):
            got = evaluate(_tiny(precision), cluster)["tokens_per_s"]
            assert got == pytest.approx(measured[precision], rel=5e-3)


def test_bench_fp8_of_another_kind_is_refused(tmp_path, monkeypatch, capsys):
    path = _bench_fp8_file(tmp_path, monkeypatch, {"bf16": 1000.0}, device="NVIDIA A100-SXM4-80GB")
    code = run(plan.main, ["--gpus", "1", "--gpu", "h100", "--calibrate", str(path), "--config", TINY])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "a100, not --gpu h100" in err
    bare = tmp_path / "outdir"
    bare.mkdir()
    code = run(plan.main, ["--gpus", "1", "--calibrate", str(bare), "--config", TINY])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "without bench_fp8.json" in err


def test_bench_cluster_rows_set_the_overlap(tmp_path):
    from training.plan.calibrate import apply, read

    # shaped step 2.0 s, unshaped (compute) 1.0 s, wire bound 1.5 s: 0.5 s of the wire hid behind 1.0 s of compute
    rows = [{"row": "zero3", "step_time_s": 2.0, "unshaped_step_time_s": 1.0, "lower_bound_s": 1.5},
            {"row": "zeropp", "step_time_s": 1.2, "unshaped_step_time_s": 1.0, "lower_bound_s": 0.4},  # 0.2
            {"row": "fsdp2_hybrid", "step_time_s": 3.0, "unshaped_step_time_s": 1.0, "lower_bound_s": 2.9},  # 0.9
            {"row": "dp", "error": "timed out"}]
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"header": "2 nodes x 2 ranks", "rows": rows}))
    cluster = make_cluster("cpu", 4, 2, 0.1)

    [item] = read(str(path))
    assert item == {"overlap": pytest.approx(0.5), "gpu": "cpu"}
    assert apply(cluster, item).overlap == pytest.approx(0.5)
    path.write_text(json.dumps({"header": "h", "rows": [{"row": "zero3", "step_time_s": 2.0}]}))
    with pytest.raises(Exception, match="without --no-unshaped"):
        read(str(path))


def test_bench_cluster_probe_sets_the_link(tmp_path):
    from training.plan.calibrate import apply, read

    probe = [{"kind": "all_gather", "group": "world", "group_size": 4, "wire_bytes": 3.0e6, "time_s": 0.12,
              "ranks_running": 4},  # 1.5e6 B per node link in 0.12 s: 12.5 MB/s
             {"kind": "all_gather", "group": "inter", "group_size": 2, "wire_bytes": 2.0e6, "time_s": 0.1,
              "ranks_running": 4},  # 10 MB/s
             {"kind": "all_reduce", "group": "inter", "group_size": 2, "wire_bytes": 4.4e6, "time_s": 0.2,
              "ranks_running": 4}]  # 11 MB/s
    path = tmp_path / "probe.json"
    path.write_text(json.dumps({"probe": probe}))
    [item] = read(str(path))
    assert item["inter_node_gbit"] == pytest.approx(11e6 * 8 / 1e9 / LINK_EFFICIENCY)
    assert apply(make_cluster("cpu", 4, 2, 0.1), item).inter_node_Bps == pytest.approx(11e6)
