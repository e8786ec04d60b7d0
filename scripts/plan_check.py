"""How close the planner (training/plan/) comes to published and measured steps: row, published or measured,
predicted, error (docs/planning.md).

    python scripts/plan_check.py --seeds-only            # seed 003's Tables 1(a), 1(b), 7 and 8 (ZeRO++ paper)
    sudo python scripts/plan_check.py                    # and the emulated two-node cluster, measured now
    python scripts/plan_check.py --bench-json FILE       # the cluster rows from a bench_cluster.py --json file

(a) Seed 003's cluster tables: ZeRO-3's ("baseline") and ZeRO++'s (or hpZ's) TFLOP/s per GPU and the speed-up,
each row run through the planner as training/plan/seeds.py states (model shapes, batch, recomputation, the
paper's TFLOP/s convention). A row passes when both TFLOP/s are within 25% and the speed-up within 20%.

(b) The emulated cluster: ``scripts/bench_cluster.py`` (2 network namespaces x 2 ranks, 100 Mbit/s; needs root)
runs its ZeRO-3, ZeRO++ and FSDP2 hybrid rows in this invocation (namespaces removed when it ends), and each
row's measured step time (median over the steps after --skip) stands beside the planner's prediction for the same
config on the ``cpu`` kind, which measures this CPU's GEMM rate and copy bandwidth first (training/plan/
calibrate.py). FSDP2 hybrid shard is not this code's ZeRO: its bytes are HSDP's (parameters gathered and
gradients reduce-scattered in bf16 inside a node, the shard all-reduced across nodes) under ZeRO-3's overlap
rule. A row passes within 20%.

(c) This trainer on one GPU as docs/benchmarks.md measured it (tokens/s), beside the prediction: no tolerance,
shown so that the model's error on this code's own step stays in view.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.realpath(__file__))))

from scripts._cli import InputError, output_file  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BENCH_ROWS = "zero3,zeropp,fsdp2_hybrid"
TFLOPS_TOLERANCE, SPEEDUP_TOLERANCE, STEP_TOLERANCE = 0.25, 0.20, 0.20

OWN_GPU_ROWS = [
    # (row, config, overrides, gpu, gpus, measured tokens/s, source)
    ("gpt_1.3b bf16, compiled, 4 x 4 micro-batches, recompute off", "configs/gpt_1.3b.yaml",
     ["train.micro_batch_size=4", "train.global_batch_size=16", "model.activation_checkpointing=off"], "h200", 1,
     57130.0, "docs/benchmarks.md 2026-11-27, one H200: python scripts/bench_fp8.py --presets gpt_1.3b --recompute "
              "off --steps 8 --warmup 4 --micro-batch 4 --accum 4"),
]
"""Our own trainer measured on a GPU (no tolerance: shown so that the model's error on this code is in view)."""


def seed_rows() -> list:
    """Every row of seed 003's tables with the planner's figures beside the published ones."""
    from config import load_config
    from training.plan import evaluate, make_cluster, seeds

    out = []
    for r in seeds.ROWS:
        cluster = make_cluster(r["gpu"], r["gpus"], r["gpus_per_node"], r["inter_gbit"])
        got = {}
        for system in ("zero3", r["system"]):
            cfg = load_config(None, seeds.overrides(r["model"], r["tokens"], r["gpus"], system, r["gpus_per_node"]))
            got[system] = evaluate(cfg, cluster)["tflops_per_gpu"] * seeds.RECOMPUTE_FLOPS
        base, other = got["zero3"], got[r["system"]]
        row = dict(r, predicted_baseline=base, predicted_other=other, speedup=r["other"] / r["baseline"],
                   predicted_speedup=other / base)
        row["errors"] = (base / r["baseline"] - 1, other / r["other"] - 1, row["predicted_speedup"] / row["speedup"] - 1)
        row["link_bound"] = seeds.zero3_link_bound(r)
        row["ok"] = (abs(row["errors"][0]) <= TFLOPS_TOLERANCE and abs(row["errors"][1]) <= TFLOPS_TOLERANCE
                     and abs(row["errors"][2]) <= SPEEDUP_TOLERANCE)
        out.append(row)
    return out


def seed_table(rows: list) -> str:
    head = ("| table | model | tokens/GPU | ZeRO-3 TFLOP/s paper / predicted (error) | ZeRO-3 link bound | other | its "
            "TFLOP/s paper / predicted (error) | speed-up paper / predicted (error) | within |\n"
            "|---|---|---:|---|---:|---|---|---|---|")
    lines = [head]
    for r in rows:
        e = r["errors"]
        above = r["baseline"] > r["link_bound"]
        verdict = "yes" if r["ok"] else "**no**, paper above the link bound" if above else "**no**"
        lines.append(f"| {r['table']} | {r['model']} | {r['tokens']} | {r['baseline']:.2f} / "
                     f"{r['predicted_baseline']:.2f} ({e[0]:+.0%}) | {r['link_bound']:.2f} | "
                     f"{'ZeRO++' if r['system'] == 'zeropp' else 'hpZ'} "
                     f"| {r['other']:.2f} / {r['predicted_other']:.2f} ({e[1]:+.0%}) | {r['speedup']:.2f}x / "
                     f"{r['predicted_speedup']:.2f}x ({e[2]:+.0%}) | {verdict} |")
    ok = sum(r["ok"] for r in rows)
    above = sum(r["baseline"] > r["link_bound"] for r in rows)
    lines.append(f"\n{ok} of {len(rows)} rows within the tolerances (TFLOP/s 25%, speed-up 20%); {above} rows publish "
                 "a ZeRO-3 rate above its link bound (the most any model allows at the stated link: "
                 "training/plan/seeds.zero3_link_bound)")
    return "\n".join(lines)


def own_rows() -> list:
    from scripts._cli import load_config
    from training.plan import evaluate, make_cluster

    out = []
    for name, config, overrides, gpu, gpus, measured, source in OWN_GPU_ROWS:
        p = evaluate(load_config(str(ROOT / config), overrides), make_cluster(gpu, gpus))
        out.append({"row": name, "gpu": gpu, "measured_tokens_per_s": measured, "predicted": p["tokens_per_s"],
                    "error": p["tokens_per_s"] / measured - 1, "source": source})
    return out


def own_table(rows: list) -> str:
    lines = ["| row | GPU | measured tokens/s | predicted | error | source |", "|---|---|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['row']} | {r['gpu']} | {r['measured_tokens_per_s']:,.0f} | {r['predicted']:,.0f} | "
                     f"{r['error']:+.0%} | {r['source']} |")
    return "\n".join(lines)


def bench_overrides(row: str, world: int, ranks_per_node: int) -> list:
    """The config of one bench_cluster.py row (its common overrides and the row's; read from the script)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_cluster

    rows = bench_cluster.rows_for(ranks_per_node)
    args = rows[row].args if rows[row].script == "train" else ["zero.stage=3", "zero.prefetch_depth=4"]
    common = ["precision=bf16", "parallel.tp=1", "parallel.pp=1", f"train.global_batch_size={2 * world}",
              "train.micro_batch_size=2", "train.grad_clip=0"] + bench_cluster.MODEL
    return common + args


def hsdp_bytes(cfg, layout) -> dict:
    """FSDP2 hybrid shard's bytes per rank and step (fsdp2_peer.py --mesh hybrid, bf16 gathers and reduces): per
    micro-batch two gathers and one reduce-scatter of the node's shards inside the node, then the rank's shard
    all-reduced with its peers on the other nodes."""
    from training.plan import costs

    x, y = layout.dp_intra_size, layout.dp_inter_size
    shard = costs.parameters(cfg)["total"] / x
    return {"dp_intra": 3 * layout.num_microbatches * (x - 1) * shard * 2,
            "dp_inter": 2 * (y - 1) / y * shard * 2}


def predict_bench(name: str, nodes: int, ranks_per_node: int, rate_gbit: float) -> dict:
    from config import load_config, validate_config
    from parallel.layout import make_layout
    from training.plan import costs, make_cluster
    from training.plan.calibrate import measure_cpu
    from training.plan.step import predict

    world = nodes * ranks_per_node
    cfg = load_config(None, bench_overrides(name, world, ranks_per_node))
    validate_config(cfg)
    cluster = measure_cpu(make_cluster("cpu", world, ranks_per_node, rate_gbit), cfg)
    layout = make_layout(cfg, world, ranks_per_node)
    with costs.shared_meta():
        return predict(cfg, layout, cluster, dp_bytes=hsdp_bytes(cfg, layout) if name == "fsdp2_hybrid" else None)


def run_bench(args) -> dict:
    """bench_cluster.py's rows measured now (its namespaces are removed when it ends); its JSON."""
    with tempfile.TemporaryDirectory(prefix="plan-check-") as tmp:
        out = Path(tmp) / "bench.json"
        cmd = [sys.executable, str(ROOT / "scripts" / "bench_cluster.py"), "--rows", args.rows, "--steps",
               str(args.steps), "--repeat", str(args.repeat), "--rate", f"{args.rate_mbit:g}mbit", "--no-calibrated",
               "--no-unshaped", "--json", str(out)]
        print("[plan_check] " + " ".join(cmd[1:]), flush=True)
        code = subprocess.call(cmd, cwd=ROOT)
        if not out.exists():
            raise InputError(f"scripts/bench_cluster.py failed (exit code {code}); its output is above")
        return json.loads(out.read_text())


def cluster_rows(bench: dict, rate_gbit: float, nodes: int, ranks_per_node: int) -> list:
    out = []
    for r in bench.get("rows", []):
        if "error" in r or r.get("step_time_s") is None:
            out.append({"row": r.get("row"), "error": r.get("error", "no step time")})
            continue
        p = predict_bench(r["row"], nodes, ranks_per_node, rate_gbit)
        err = p["step_time_s"] / r["step_time_s"] - 1
        out.append({"row": r["row"], "measured_s": r["step_time_s"], "predicted_s": p["step_time_s"], "error": err,
                    "ok": abs(err) <= STEP_TOLERANCE, "breakdown": p["breakdown"], "bound_s": r.get("lower_bound_s")})
    return out


def cluster_table(rows: list) -> str:
    lines = ["| row | measured step s | predicted s (compute + exposed dp) | error | within 20% |", "|---|---:|---|---:|---|"]
    for r in rows:
        if "measured_s" not in r:
            lines.append(f"| {r['row']} | - | - | {r['error']} | **no** |")
            continue
        b = r["breakdown"]
        lines.append(f"| {r['row']} | {r['measured_s']:.3f} | {r['predicted_s']:.3f} ({b['compute']:.3f} + "
                     f"{b['dp']:.3f}) | {r['error']:+.0%} | {'yes' if r['ok'] else '**no**'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds-only", action="store_true", help="(a) only: no emulated cluster (no root needed)")
    ap.add_argument("--cluster-only", action="store_true", help="(b) only")
    ap.add_argument("--bench-json", help="(b) from this bench_cluster.py --json file instead of measuring now")
    ap.add_argument("--rows", default=BENCH_ROWS, help=f"bench_cluster.py rows (default {BENCH_ROWS})")
    ap.add_argument("--steps", type=int, default=8, help="bench_cluster.py --steps (default 8)")
    ap.add_argument("--repeat", type=int, default=1, help="bench_cluster.py --repeat (default 1)")
    ap.add_argument("--rate-mbit", type=float, default=100.0, help="the emulated link's rate (bench's --rate)")
    ap.add_argument("--json", help="also write the rows as JSON here")
    args = ap.parse_args(argv)
    if args.json:
        output_file(args.json, "--json")
    if args.steps < 3 or args.repeat < 1 or not args.rate_mbit > 0:
        raise InputError(f"need --steps >= 3, --repeat >= 1 and --rate-mbit > 0 (got {args.steps}, {args.repeat}, "
                         f"{args.rate_mbit})")
    bench = None
    if args.bench_json:
        try:
            bench = json.loads(Path(args.bench_json).read_text(encoding="utf-8"))
        except UnicodeDecodeError as e:
            raise InputError(f"--bench-json {args.bench_json}: not UTF-8 text (byte {e.start + 1})") from None
        except json.JSONDecodeError as e:
            raise InputError(f"--bench-json {args.bench_json}: malformed JSON ({e.msg} at line {e.lineno})") from None
        if not isinstance(bench, dict) or not isinstance(bench.get("rows"), list):
            raise InputError(f"--bench-json {args.bench_json}: not a bench_cluster.py --json file (no 'rows' list)")
    elif not args.seeds_only and os.geteuid() != 0:
        raise InputError("the emulated cluster needs root (network namespaces and tc): run with sudo, or pass "
                         "--seeds-only or --bench-json FILE")
    result: dict = {}
    if not args.cluster_only:
        result["seeds"] = seed_rows()
        print("(a) seed 003 (ZeRO++ paper), Tables 1(a), 1(b), 7, 8: TFLOP/s per GPU\n")
        print(seed_table(result["seeds"]), flush=True)
        result["own"] = own_rows()
        print("\n(c) this trainer on one GPU, measured (docs/benchmarks.md)\n")
        print(own_table(result["own"]), flush=True)
    if not args.seeds_only:
        if bench is None:
            bench = run_bench(args)
        result["cluster"] = cluster_rows(bench, args.rate_mbit / 1000, 2, 2)
        print("\n(b) the emulated cluster (scripts/bench_cluster.py: 2 nodes x 2 ranks, "
              f"{args.rate_mbit:g} Mbit/s), step time\n")
        print(cluster_table(result["cluster"]))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    from _cli import run  # scripts/ is sys.path[0] when a script runs

    sys.exit(run(main))
