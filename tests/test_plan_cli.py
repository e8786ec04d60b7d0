"""scripts/plan.py in-process (main(argv) through scripts/_cli.run): its errors are one line and exit code 2, its
JSON has the fields users read, and the search returns exactly the fastest layouts that fit (against a brute
force over the same space); calibration files (training/plan/calibrate.py)."""
from __future__ import annotations

import json

import pytest

from config import load_config
from scripts import plan
from scripts._cli import run
from training.plan import costs, make_cluster
from training.plan.search import candidates, search
from training.plan.step import predict

SMALL = ["model.n_layers=4", "model.d_model=256", "model.n_heads=4", "model.seq_len=256", "model.vocab_size=1024",
         "train.micro_batch_size=1", "train.global_batch_size=16", "precision=bf16"]


def _plan(capsys, *argv):
    try:
        code = run(plan.main, list(argv))
    except SystemExit as e:  # argparse's usage errors exit (scripts/_cli.py makes them one line)
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("argv, needle", [
    (["--gpus", "8", "--gpu", "b200"], "unknown GPU kind"),
    (["--gpus", "12", "--gpus-per-node", "8"], "not divisible by --gpus-per-node 8"),
    (["--gpus", "6", "parallel.tp=4"], "impossible parallel layout on 6 GPUs"),
    (["--gpus", "8", "--search", "model.d_model=16384", "model.n_heads=128", "model.n_layers=64", "--gpu", "v100",
      "--gpus-per-node", "8"], "no layout of this model fits"),
    (["--gpus", "0"], "--gpus must be at least 1"),
    (["--gpus", "8", "--top", "0"], "--top must be at least 1"),
    (["--gpus", "8", "zero.stage=7"], "zero.stage=7"),
    (["--gpus", "8", "--gpu-kind", "h100"], "unrecognized arguments"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, needle):
    code, out, err = _plan(capsys, *SMALL, *argv)
    assert code == 2, (out, err)
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: ") and needle in err, err


def test_calibration_file_errors(capsys, tmp_path):
    bad = tmp_path / "cal.json"
    bad.write_text('{"gemm_tflops": 500, "colour": 1}')
    code, _, err = _plan(capsys, "--gpus", "8", "--calibrate", str(bad), *SMALL)
    assert code == 2 and "unknown key(s) colour" in err and len(err.strip().splitlines()) == 1
    code, _, err = _plan(capsys, "--gpus", "8", "--calibrate", str(tmp_path / "absent.json"), *SMALL)
    assert code == 2 and "absent.json" in err


def test_json_has_the_fields_and_a_calibration_moves_them(capsys, tmp_path):
    big = SMALL + ["model.d_model=4096", "model.n_heads=32", "model.seq_len=2048"]
    code, out, _ = _plan(capsys, "--gpus", "8", "--json", *big)
    assert code == 0
    p = json.loads(out)
    for key in ("step_time_s", "tokens_per_s", "tflops_per_gpu", "mfu", "memory_gib", "fits", "breakdown"):
        assert key in p
    assert set(p["breakdown"]) == {"compute", "recompute", "bubble", "tp", "cp", "ep", "pp", "dp", "optimizer"}
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"gpu": "h100", "gemm_tflops": 380.75}))  # half the table's 0.77 x 989
    code, out, _ = _plan(capsys, "--gpus", "8", "--json", "--calibrate", str(cal), *big)
    slower = json.loads(out)
    assert code == 0 and slower["breakdown"]["compute"] > 1.5 * p["breakdown"]["compute"]


def test_text_table_names_the_keys_to_launch_with(capsys):
    code, out, _ = _plan(capsys, "--gpus", "8", "--search", "--top", "3", *SMALL)
    assert code == 0
    assert "top layout: parallel.tp=" in out and "zero.stage=" in out and out.count("\n") > 8


def test_search_is_the_brute_forces_top():
    cfg = load_config(None, SMALL)
    cluster = make_cluster("h100", 16)
    top = search(cfg, cluster, top=5)
    with costs.shared_meta():
        every = [predict(c, lay, cluster) for c, lay in candidates(cfg, cluster)]
    fitting = sorted(p["step_time_s"] for p in every if p["fits"])
    assert [p["step_time_s"] for p in top] == pytest.approx(fitting[:5])
    assert all(p["fits"] for p in top)
    assert [p["step_time_s"] for p in top] == sorted(p["step_time_s"] for p in top)


def test_search_orders_by_the_model():
    """On a slow network the fastest layout keeps the data-parallel traffic off it (its dp time is small), and no
    layout is faster there than the fastest on a fast network."""
    cfg = load_config(None, SMALL + ["model.d_model=1024", "model.n_heads=16", "train.global_batch_size=64"])
    slow = search(cfg, make_cluster("h100", 16, inter_node_gbps=1.0), top=1)[0]
    fast = search(cfg, make_cluster("h100", 16), top=1)[0]
    assert slow["breakdown"]["dp"] < 0.5 * slow["step_time_s"]
    assert slow["step_time_s"] >= fast["step_time_s"]


def test_plan_check_reads_the_bench_rows_as_the_bench_runs_them(capsys, tmp_path):
    from scripts import plan_check
    from parallel.layout import make_layout

    keys = plan_check.bench_overrides("zeropp", 4, 2)
    assert "zero.hpz_size=2" in keys and "model.d_model=256" in keys and "train.global_batch_size=8" in keys
    cfg = load_config(None, plan_check.bench_overrides("fsdp2_hybrid", 4, 2))
    layout = make_layout(cfg, 4, 2)
    total = costs.parameters(cfg)["total"]
    got = plan_check.hsdp_bytes(cfg, layout)  # x = 2 ranks a node, y = 2 nodes, bf16, one micro-batch
    assert got["dp_inter"] == pytest.approx(2 * (1 / 2) * total / 2 * 2)
    assert got["dp_intra"] == pytest.approx(3 * 1 * total / 2 * 2)
    bad = tmp_path / "bench.json"
    bad.write_text('{"header": "no rows"}')
    assert run(plan_check.main, ["--cluster-only", "--bench-json", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --bench-json") and len(err.strip().splitlines()) == 1
