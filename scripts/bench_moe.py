"""Mixture of experts on one CPU process: tokens/s of the tiny MoE against its dense twin, and expert balancing.

    python scripts/bench_moe.py                               # throughput: MoE (grouped GEMM, loop) vs dense twin
    python scripts/bench_moe.py --steps 10 --warmup 3 [key=value ...]
    python scripts/bench_moe.py --balance                     # 200 steps: expert bias / aux loss / neither
    python scripts/bench_moe.py --balance --rates 0.001 0.01 --seeds 1 --out /tmp/moe_runs

Both read ``--config`` (default configs/tiny_moe.yaml, an MoE: model.moe.num_experts > 0) plus the ``key=value``
overrides, and train on the config's data (the bundled corpus for the preset).

**Throughput** (the default). Three rows, each one process (the engine of ``train.py``, fp32 unless the config
says otherwise), ``--warmup`` steps left out, then the median of ``--steps`` step times:

  moe grouped  the MoE with every routed expert projection one ``torch._grouped_mm`` (``Experts.grouped=True``;
               left out where ``model.moe.grouped_gemm_runs`` says it does not run for this dtype and widths)
  moe loop     the same model with a Python loop over the experts (``Experts.grouped=False``)
  dense twin   the same config with ``model.moe.num_experts=0`` and ``model.ffn_hidden`` = top_k x the expert
               width (+ the shared experts' width): the same active FFN parameters per token, without the router
               and the token sorting (a layer the MoE model keeps dense gets the twin's width too)

Printed per row: total and active parameters (``model.flops.parameter_count``), tokens/s and ms/step (median),
the speed against the dense twin, model GFLOP/s (``flops_per_token``: active parameters) and the last timed step's
max/mean expert load (routing imbalance slows the grouped GEMM's largest group).

**Balance** (``--balance``). The Done-when of issue 45: with aux-loss-free balancing (the expert bias) at its
rate, the max / mean expert load after ``--steps`` (default 200) steps is <= 1.3; the same run without it, with
the auxiliary loss instead, and with neither, beside it. Each row is ``python train.py --config ...`` in a
directory of its own (``--out``, else a temporary one), once per seed (``--seeds``, train.seed), logging every
step; the rows (everything else as the config says):

  bias <rate>  model.moe.bias_update_rate=<rate>, model.moe.aux_loss_coeff=0; one row per ``--rates`` value
               (default: DeepSeek-V3's 0.001 and the config's own rate when it differs)
  aux loss     model.moe.bias_update_rate=0, model.moe.aux_loss_coeff=``--aux-coeff`` (default 0.01)
  neither      both 0

Two measures of each MoE layer's max / mean token-slots per expert after the last step, and their max over the
layers: the last step's (metrics.jsonl's ``moe`` record: one batch, ``global_batch_size x seq_len`` tokens, whose
documents route alike, so it swings from step to step; also averaged over the last 10 steps), and the held-out
one: the run's final checkpoint (weights and expert biases) routing ``--heldout`` sequences of the validation
split, counted together (``heldout_worker``; 128 x 128 tokens by default, a quarter of the step-to-step noise).
Then the final training and validation losses. The bar: every seed's held-out max over the layers <= 1.3 for the
config's own rate (exit code 1 when missed; the last step's is printed beside it, and a row at another rate is
reported, not judged). A script, not a test: it takes minutes a run.

**Expert parallelism** has rows of its own on the emulated two-node cluster (it needs root): all-to-all bytes
per step against the formula, EP inside a node against EP across nodes, in scripts/bench_moe_cluster.py;
``--ep`` here says so (one line, exit 2).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts import _cli  # noqa: E402  (also registered as _cli, which _seeds imports)
from scripts import _seeds  # noqa: E402
DEFAULT_CONFIG = "configs/tiny_moe.yaml"
DEEPSEEK_RATE = 0.001  # DeepSeek-V3's bias update speed (its paper, section 2.1.2)
BAR = 1.3  # issue 45: max / mean expert load after 200 steps with the bias on
LAST = 10  # steps averaged besides the last one


# ---- throughput -------------------------------------------------------------------------------------------------


def twin_overrides(cfg) -> List[str]:
    """The dense twin: no routed experts, an MLP as wide as the FFN widths one token passes through."""
    from model.flops import expert_width

    m = cfg.model.moe
    width = m.top_k * expert_width(cfg.model)
    if m.shared_experts:
        width += m.shared_ffn_hidden if m.shared_ffn_hidden is not None else expert_width(cfg.model) * m.shared_experts
    return ["model.moe.num_experts=0", f"model.ffn_hidden={width}"]


def throughput_worker(config: str, overrides: List[str], grouped: Optional[bool], warmup: int, steps: int,
                      threads: int):
    """One row on a world of one process: step times on the config's training data after ``warmup`` steps, with
    ``threads`` CPU threads (train.py's: the test harness's ranks run one each)."""
    os.chdir(ROOT)  # the config's data paths are relative to the repository root
    import torch

    torch.set_num_threads(threads)
    from config import load_config
    from model.moe import Experts
    from tests.parallel_utils import build_engine
    from training.trainer import batch_source, check_data

    cfg = load_config(config, overrides)
    engine = build_engine(cfg)
    for chunk in engine.chunks:
        for module in chunk.modules():
            if isinstance(module, Experts):
                module.grouped = grouped
    train_ds, _ = check_data(cfg)
    times, stats = [], {}
    for step in range(warmup + steps):
        batch = batch_source(train_ds, step * cfg.train.global_batch_size, cfg, engine.mesh)
        t0 = time.perf_counter()
        stats = engine.train_step(batch)
        times.append(time.perf_counter() - t0)
    return {"times": times[warmup:], "loss": stats["loss"], "load": stats.get("moe", {}).get("load_max_over_mean")}


def throughput(args, cfg) -> int:
    from config import load_config
    from model.flops import expert_width, flops_per_token, parameter_count
    from model.moe import grouped_gemm_runs
    from tests.dist_harness import run_world

    import torch

    twin = twin_overrides(cfg)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.precision, torch.float32)
    rows = []
    if grouped_gemm_runs(dtype, torch.device("cpu"), cfg.model.d_model, expert_width(cfg.model)):
        rows.append(("moe grouped", args.overrides, True))
    else:
        print("moe grouped: left out (torch._grouped_mm does not run here for this dtype and these widths)")
    rows += [("moe loop", args.overrides, False), ("dense twin", args.overrides + twin, None)]
    m = cfg.model
    tokens = cfg.train.global_batch_size * m.seq_len
    print(f"{' '.join([args.config] + args.overrides)}: {m.n_layers} layers, d_model {m.d_model}, {m.moe.num_experts} "
          f"experts of {expert_width(m)}, top-{m.moe.top_k}; dense twin: {' '.join(twin)}; {cfg.precision}; "
          f"{tokens} tokens a step; {args.warmup} warm-up steps, median of {args.steps}; one process, "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads\n")
    results: Dict[str, dict] = {}
    for name, overrides, grouped in rows:
        out = run_world(throughput_worker, 1, args.config, overrides, grouped, args.warmup, args.steps,
                        torch.get_num_threads(), timeout=3600)[0]
        row_cfg = load_config(args.config, overrides).model
        step_s = statistics.median(out["times"])
        results[name] = {**out, "step_s": step_s, "tok_s": tokens / step_s, "params": parameter_count(row_cfg),
                         "gflops": tokens * flops_per_token(row_cfg) / step_s / 1e9}
        print(f"[bench_moe] {name}: {step_s * 1e3:.1f} ms/step", file=sys.stderr, flush=True)
    base = results["dense twin"]["tok_s"]
    print("| row | parameters | active | tokens/s | ms/step | vs dense twin | model GFLOP/s | max/mean load |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        load = f"{r['load']:.2f}" if r["load"] is not None else "-"
        print(f"| {name} | {r['params']['total'] / 1e6:.2f}M | {r['params']['active'] / 1e6:.2f}M | "
              f"{r['tok_s']:,.0f} | {r['step_s'] * 1e3:.1f} | {r['tok_s'] / base:.2f}x | {r['gflops']:.2f} | {load} |")
    return 0


# ---- balance ----------------------------------------------------------------------------------------------------


def balance_rows(args, cfg) -> Dict[str, List[str]]:
    """Row name -> overrides after the config's."""
    own = cfg.model.moe.bias_update_rate
    rates = args.rates or list(dict.fromkeys([DEEPSEEK_RATE] + ([own] if own > 0 else [])))
    rows = {f"bias {r:g}": [f"model.moe.bias_update_rate={r!r}", "model.moe.aux_loss_coeff=0"] for r in rates}
    rows["aux loss"] = ["model.moe.bias_update_rate=0", f"model.moe.aux_loss_coeff={args.aux_coeff!r}"]
    rows["neither"] = ["model.moe.bias_update_rate=0", "model.moe.aux_loss_coeff=0"]
    return rows


def train_overrides(row: List[str], seed: int, args, run_dir: Path) -> List[str]:
    return [*args.overrides, *row, f"train.seed={seed}", f"train.max_steps={args.steps}",
            f"train.eval_interval={args.steps}", "logging.interval=1", "checkpoint.interval=0",
            "checkpoint.save_at_exit=true", "logging.wandb.mode=disabled", f"logging.run_dir={run_dir}"]


def heldout_worker(run_dir: str, sequences: int) -> Dict[str, float]:
    """Each MoE layer's max / mean token-slots per expert when the run's final checkpoint (its weights and expert
    biases) routes the first ``sequences`` sequences of the validation split, counted together (one process)."""
    os.chdir(ROOT)
    import torch

    from config import load_config
    from data.gpt_dataset import get_batch
    from model.moe import MoE
    from tests.parallel_utils import build_engine
    from training.checkpoint import Checkpointer
    from training.checkpoint_files import find_checkpoint
    from training.trainer import check_data

    cfg = load_config(str(Path(run_dir) / "config.yaml"))
    engine = build_engine(cfg)
    path = find_checkpoint(Path(run_dir) / "checkpoints", "routing")
    Checkpointer(cfg, str(path.parent), engine).load(path, with_optimizer=False)
    _, valid = check_data(cfg)
    sequences = min(sequences, valid.samples_per_epoch)
    model = engine.chunks[0].eval()
    layers = {name.split(".")[1]: m for name, m in model.named_modules() if isinstance(m, MoE)}
    counts = {k: torch.zeros(m.num_experts, dtype=torch.float64) for k, m in layers.items()}
    batch = cfg.train.micro_batch_size
    with torch.no_grad(), engine.autocast():
        for start in range(0, sequences, batch):
            tokens, labels = get_batch(valid, range(start, min(start + batch, sequences)))
            model(tokens, labels)
            for k, m in layers.items():
                counts[k] += m.counts.double()
    return {k: (c.max() / c.mean()).item() for k, c in counts.items()}


def balance_run(name: str, row: List[str], seed: int, args, out_dir: Path) -> dict:
    run_dir = out_dir / f"{name.replace(' ', '_')}-seed{seed}"
    cmd = [sys.executable, str(ROOT / "train.py"), "--config", args.config, *train_overrides(row, seed, args, run_dir)]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if p.returncode == 2:  # train.py's bad input: its one line
        errors = [line for line in p.stderr.splitlines() if line.startswith("error")]
        raise _cli.InputError(f"{name}: {errors[-1] if errors else p.stderr.strip()[-300:]}")
    if p.returncode != 0:
        raise SystemExit(f"{name} seed {seed} failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
    from tests.dist_harness import run_world

    out = read_balance(run_dir)
    out["heldout"] = run_world(heldout_worker, 1, str(run_dir), args.heldout, timeout=1800)[0]
    out["heldout_max"] = max(out["heldout"].values())
    return out


def read_balance(run_dir: Path) -> dict:
    """A run's balance figures from its metrics.jsonl (logged every step): the last step's per-layer max / mean
    load and their max, that max's mean over the last LAST steps, the last training and validation losses."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in records if "moe" in r]
    last = steps[-1]
    layers = {k: v["load_max_over_mean"] for k, v in last["moe"]["layers"].items()}
    return {"step": last["step"], "layers": layers, "max": max(layers.values()), "loss": last["loss"],
            "recent": statistics.fmean(r["moe"]["load_max_over_mean"] for r in steps[-LAST:]),
            "val": [r["val_loss"] for r in records if "val_loss" in r][-1]}


def balance(args, cfg) -> int:
    rows = balance_rows(args, cfg)
    own = f"bias {cfg.model.moe.bias_update_rate:g}" if cfg.model.moe.bias_update_rate > 0 else None
    results = {}
    began = time.strftime("%Y-%m-%d")
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = Path(args.out or tmp).absolute()  # train.py runs in ROOT: no relative run dirs
        for seed in args.seeds:
            for name, row in rows.items():
                r = results[name, seed] = balance_run(name, row, seed, args, out_dir)
                print(f"[bench_moe] {name} seed {seed}: {r}", file=sys.stderr, flush=True)
    m = cfg.model
    print(f"\n{' '.join([args.config] + args.overrides)}: {m.moe.num_experts} experts, top-{m.moe.top_k}, "
          f"{args.steps} steps, seeds {' '.join(map(str, args.seeds))}; {began}; one process, "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs\n")
    layer_ids = list(next(iter(results.values()))["layers"])
    tokens = args.heldout * m.seq_len
    print(f"max / mean token-slots per expert after step {args.steps}: held-out = the final model routing "
          f"{args.heldout} validation sequences ({tokens} tokens, fewer if the split is shorter) together; last step = "
          f"the step's batch ({cfg.train.global_batch_size * m.seq_len} tokens), and its max over the layers "
          f"averaged over the last {LAST} steps\n")
    layers = " | ".join(f"layer {i}" for i in layer_ids)
    print(f"| row | seed | held-out: {layers} | held-out max | last step: {layers} | last-step max | "
          f"last {LAST} steps | train loss | val loss |")
    print("|---|---|" + "---|" * (2 * len(layer_ids) + 5))
    for name in rows:
        for seed in args.seeds:
            r = results[name, seed]
            print(f"| {name} | {seed} | " + " | ".join(f"{r['heldout'][i]:.3f}" for i in layer_ids)
                  + f" | {r['heldout_max']:.3f} | " + " | ".join(f"{r['layers'][i]:.3f}" for i in layer_ids)
                  + f" | {r['max']:.3f} | {r['recent']:.3f} | {r['loss']:.3f} | {r['val']:.3f} |")
    failed = False
    print()
    for name in rows:
        if not name.startswith("bias"):
            continue
        held = sum(results[name, s]["heldout_max"] <= BAR for s in args.seeds)
        last = sum(results[name, s]["max"] <= BAR for s in args.seeds)
        verdict = "yes" if held == len(args.seeds) else "NO"
        judged = " (the config's rate)" if name == own else " (reported, not judged)"
        print(f"bar: {name}{judged}: held-out max/mean load <= {BAR} in {held} of {len(args.seeds)} seeds: "
              f"{verdict} (last step's: {last} of {len(args.seeds)})")
        failed = failed or (name == own and verdict == "NO")
    return 1 if failed else 0


# ---- expert parallelism -----------------------------------------------------------------------------------------


def ep_rows(args, cfg) -> int:
    """The expert-parallel rows live in scripts/bench_moe_cluster.py (several processes on the emulated cluster,
    root): this script's rows are one process each."""
    raise _cli.InputError("--ep: the expert-parallel rows (all-to-all bytes per step against the formula, EP inside "
                          "against across nodes on the emulated cluster) are scripts/bench_moe_cluster.py's (run it "
                          "as root)")


# ---- main -------------------------------------------------------------------------------------------------------


def check_input(args):
    """Bad options, config, overrides and data before the first run: one line, exit code 2."""
    from config import validate_config
    from parallel.layout import make_layout

    cfg = _cli.load_config(args.config, args.overrides)
    validate_config(cfg)
    if cfg.model.moe.num_experts <= 0:
        raise _cli.InputError(f"--config {args.config}: not a mixture of experts (model.moe.num_experts=0); "
                              f"give an MoE config, e.g. {DEFAULT_CONFIG}")
    make_layout(cfg, 1, 1)
    if args.ep:
        return cfg
    if args.balance:
        _cli.at_least(args.steps, 1, "--steps")
        _seeds.check(args.seeds, args.overrides)
        for rate in args.rates or []:
            if not (math.isfinite(rate) and rate > 0):
                raise _cli.InputError(f"--rates: {rate} must be a number > 0 (the bias's step a training step)")
        _cli.at_least(args.heldout, 1, "--heldout")
        if not (math.isfinite(args.aux_coeff) and args.aux_coeff > 0):
            raise _cli.InputError(f"--aux-coeff {args.aux_coeff} must be a number > 0")
        if args.out:
            _cli.output_dir(args.out, "--out")
        for row in balance_rows(args, cfg).values():
            validate_config(_cli.load_config(args.config, train_overrides(row, args.seeds[0], args, Path("run"))))
    else:
        _cli.at_least(args.steps, 1, "--steps")
        _cli.at_least(args.warmup, 0, "--warmup")
        validate_config(_cli.load_config(args.config, args.overrides + twin_overrides(cfg)))
    _cli.check_run_data(cfg)
    return cfg


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=DEFAULT_CONFIG, help=f"an MoE config (default: {DEFAULT_CONFIG})")
    ap.add_argument("--steps", type=int, default=None,
                    help="timed steps of each throughput row (default 10), or training steps of each balance run "
                         "(default 200)")
    ap.add_argument("--warmup", type=int, default=3, help="throughput: steps before the timed ones (default 3)")
    ap.add_argument("--balance", action="store_true", help="the balancing comparison instead of the throughput")
    ap.add_argument("--rates", nargs="+", type=float, default=None, metavar="RATE",
                    help=f"--balance: bias update rates, a row each (default: {DEEPSEEK_RATE} and the config's)")
    ap.add_argument("--aux-coeff", type=float, default=0.01, help="--balance: the aux loss row's coefficient")
    ap.add_argument("--heldout", type=int, default=128,
                    help="--balance: validation sequences the final model routes for the held-out load (default 128)")
    _seeds.add_argument(ap)
    ap.add_argument("--out", default=None, help="--balance: keep the runs here (default: a temporary directory)")
    ap.add_argument("--ep", action="store_true", help="the expert-parallel rows: scripts/bench_moe_cluster.py")
    ap.add_argument("overrides", nargs="*", help="extra key=value overrides for every row")
    args = ap.parse_args(argv)
    if args.steps is None:
        args.steps = 200 if args.balance else 10
    cfg = check_input(args)
    if args.ep:
        return ep_rows(args, cfg)
    return balance(args, cfg) if args.balance else throughput(args, cfg)


if __name__ == "__main__":
    sys.exit(_cli.run(main))
