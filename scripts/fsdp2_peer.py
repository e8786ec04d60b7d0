"""The same GPT trained by torch's FSDP2 (``fully_shard``), for benchmarks against this repository's ZeRO.

Launched exactly like ``train.py`` (``torchrun ... scripts/fsdp2_peer.py [--mesh full|hybrid] key=value ...``)
and configured by the same config keys (``config``): the model is built by
``model.gpt.build_chunks`` (tp 1, pp 1), the batches are the trainer's (the configured data, each DP rank
its ``global_batch_size / world`` slice of every global batch), the optimizer is the trainer's AdamW
(``parallel.optim_rules.build_optimizer``) with its warm-up + cosine learning rate and ``train.grad_clip``.

* ``--placement auto`` (default) shards each parameter on its first dimension the shard count divides;
  FSDP2's own default (``--placement dim0``) pads dim 0 to a multiple of it, which for this model's fused
  qkv (3, d, d) and SwiGLU up (2, ffn, d) weights over 4 ranks gathers and reduces 1.5x a block's bytes.
* ``--mesh full``: ``fully_shard`` per transformer block and on the root over a 1-D mesh of every rank
  (ZeRO-3's layout).
* ``--mesh hybrid``: the same on a 2-D mesh (replicate = nodes, shard = ranks per node): parameters are
  gathered inside a node, gradients reduce-scattered inside it and all-reduced across nodes (HSDP).

With ``precision=bf16`` parameters are gathered and gradients reduced in bf16
(``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16)``), as the trainer's ZeRO-3 does by default.

Rank 0 writes ``<logging.run_dir>/metrics.jsonl``: one record per step with ``step``, ``loss``,
``step_time_s``, ``tokens_per_s``, ``time`` (wall clock at the end of the step) and ``comm``: this rank's bytes
by link and kind under ``parallel/comm.py``'s per-rank convention (FSDP2's collectives are counted by
wrapping ``torch.distributed``'s functions in this process), plus ``comm_by_rank``: every rank's inter-node
bytes of that step (gathered once, after the last step, so that counting adds no traffic to the steps).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


class CommCounter:
    """Bytes this rank sends in FSDP2's collectives, with parallel/comm.py's per-rank convention."""

    def __init__(self, ranks_per_node: int):
        self.ranks_per_node = ranks_per_node
        self.bytes = defaultdict(int)  # (kind, link) -> bytes
        self._links = {}

    def _group(self, group):
        key = id(group)
        if key not in self._links:
            ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
            nodes = {r // self.ranks_per_node for r in ranks}
            self._links[key] = (len(ranks), "inter" if len(nodes) > 1 else "intra")
        return self._links[key]

    def record(self, kind: str, group, nbytes: float, size_factor) -> None:
        g, link = self._group(group)
        if g > 1:
            self.bytes[(kind, link)] += int(round(size_factor(g) * nbytes))

    def install(self) -> None:
        """Wrap the torch.distributed functions FSDP2 calls (it looks them up on the module at call time)."""
        originals = {n: getattr(dist, n) for n in ("all_gather_single", "reduce_scatter_single", "all_reduce",
                                                   "all_to_all_single", "all_gather_into_tensor",
                                                   "reduce_scatter_tensor")}
        counter = self

        def nb(t):
            return t.numel() * t.element_size()

        def all_gather_single(output, input, group=None, async_op=False):
            counter.record("all_gather", group, nb(input), lambda g: g - 1)
            return originals["all_gather_single"](output, input, group=group, async_op=async_op)

        def reduce_scatter_single(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
            counter.record("reduce_scatter", group, nb(input), lambda g: (g - 1) / g)
            return originals["reduce_scatter_single"](output, input, op=op, group=group, async_op=async_op)

        def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
            counter.record("all_reduce", group, nb(tensor), lambda g: 2 * (g - 1) / g)
            return originals["all_reduce"](tensor, op=op, group=group, async_op=async_op)

        def all_to_all_single(output, input, *args, group=None, async_op=False, **kw):
            counter.record("all_to_all", group, nb(input), lambda g: (g - 1) / g)
            return originals["all_to_all_single"](output, input, *args, group=group, async_op=async_op, **kw)

        dist.all_gather_single = all_gather_single
        dist.all_gather_into_tensor = all_gather_single
        dist.reduce_scatter_single = reduce_scatter_single
        dist.reduce_scatter_tensor = reduce_scatter_single
        dist.all_reduce = all_reduce
        dist.all_to_all_single = all_to_all_single

    def snapshot_and_reset(self) -> dict:
        by_link, by_kind = {"intra": 0, "inter": 0}, defaultdict(int)
        for (kind, link), n in self.bytes.items():
            by_link[link] += n
            by_kind[kind] += n
        self.bytes.clear()
        return {"by_link": by_link, "by_kind": dict(by_kind), "total": sum(by_link.values())}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mesh", choices=["full", "hybrid"], default="full")
    parser.add_argument("--placement", choices=["auto", "dim0"], default="auto",
                        help="auto: shard a parameter on its first dim divisible by the shard count (no padding); "
                             "dim0: FSDP2's default, dim 0 padded to a multiple of the shard count")
    parser.add_argument("overrides", nargs="*", help="config dotlist, as for train.py")
    args = parser.parse_args(argv)

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from config import validate_config
    from data.gpt_dataset import get_batch
    from model.gpt import build_chunks
    from model.layers import TPContext
    from parallel.comm import Group, Ledger
    from parallel.optim_rules import build_optimizer
    from parallel.random import RNGTracker
    from training.optim import LRSchedule
    from training.trainer import check_data

    from scripts._cli import InputError, load_config

    # bad input before the process group: one line, exit code 2 on every rank (scripts/_cli.py)
    cfg = load_config(None, args.overrides)
    validate_config(cfg)
    if cfg.parallel.tp != 1 or cfg.parallel.pp != 1:
        raise InputError("fsdp2_peer.py runs parallel.tp=1 parallel.pp=1 only")
    train_ds, _ = check_data(cfg)
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise InputError(f"{', '.join(missing)} not set: run it under torchrun, as train.py "
                         "(torchrun --nproc-per-node N scripts/fsdp2_peer.py ...)")
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    except ValueError as e:
        raise InputError(f"the launch environment is not torchrun's: {e}") from None
    ranks_per_node = cfg.parallel.ranks_per_node or local_world
    if world % ranks_per_node:
        raise InputError(f"world {world} is not a multiple of ranks_per_node {ranks_per_node}")
    nodes = world // ranks_per_node
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    dist.init_process_group("gloo")
    counter = CommCounter(ranks_per_node)
    counter.install()
    cpu = torch.device("cpu")
    try:
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[cfg.precision]
        if args.mesh == "full":
            mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
        else:
            mesh = init_device_mesh("cpu", (nodes, ranks_per_node), mesh_dim_names=("replicate", "shard"))
        alone = Group("tp", None, [rank], 0, "intra", Ledger())  # a TP group of one: plain layers
        ctx = TPContext(alone, False, RNGTracker(cpu, cfg.train.seed, 0, rank, 0))
        [model] = build_chunks(cfg.model, ctx, 1, 1, 0, cfg.train.seed, cpu)
        mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)
        shards = world if args.mesh == "full" else ranks_per_node

        def placement(param):
            """--placement auto: shard on the first dim the shard count divides (FSDP2 pads dim 0 otherwise:
            this model's fused qkv (3, d, d) and SwiGLU up (2, ffn, d) weights would cost 4/3 and 2x)."""
            if args.placement == "dim0" or param.shape[0] % shards == 0:
                return None
            for dim in range(1, param.dim()):
                if param.shape[dim] % shards == 0:
                    return Shard(dim)
            return None

        for block in model.layers.values():
            fully_shard(block, mesh=mesh, mp_policy=mp, shard_placement_fn=placement)
        fully_shard(model, mesh=mesh, mp_policy=mp, shard_placement_fn=placement)
        optimizer = build_optimizer(list(model.named_parameters()), cfg.train, cpu)
        schedule = LRSchedule(cfg.train)
        t = cfg.train
        g, micro = t.global_batch_size, t.micro_batch_size
        per_rank = g // world
        n_micro = per_rank // micro
        records = []
        counter.snapshot_and_reset()  # set-up traffic (mesh, broadcasts) is not a step's
        for step in range(t.max_steps):
            t0 = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            total = torch.zeros(())
            for mb in range(n_micro):
                start = step * g + rank * per_rank + mb * micro
                tokens, labels = get_batch(train_ds, range(start, start + micro))
                loss = model(tokens, labels) / n_micro
                loss.backward()
                total += loss.detach().float()
            if t.grad_clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
            for group in optimizer.param_groups:
                group["lr"] = schedule(step)
            optimizer.step()
            dist.all_reduce(total)
            dt = time.perf_counter() - t0
            records.append({"step": step + 1, "loss": total.item() / world, "step_time_s": dt,
                            "tokens_per_s": g * cfg.model.seq_len / dt, "comm": counter.snapshot_and_reset(),
                            "time": time.time()})
            if rank == 0:
                print(f"[fsdp2 {args.mesh}] step {step + 1} loss {records[-1]['loss']:.4f} "
                      f"{dt * 1e3:.0f} ms", flush=True)
        everyone = [None] * world
        dist.all_gather_object(everyone, [r["comm"]["by_link"]["inter"] for r in records])
        if rank == 0:
            run_dir = Path(cfg.logging.run_dir or "runs/fsdp2")
            run_dir.mkdir(parents=True, exist_ok=True)
            with open(run_dir / "metrics.jsonl", "w") as f:
                for i, r in enumerate(records):
                    r["comm_by_rank"] = {"inter": [everyone[k][i] for k in range(world)]}
                    f.write(json.dumps(r) + "\n")
        dist.barrier()  # nobody tears gloo down while rank 0 still writes (a teardown race aborted a rank once)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from _cli import run  # scripts/ is sys.path[0] when a script runs

    sys.exit(run(main))
