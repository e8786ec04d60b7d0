"""Seed 003's (the ZeRO++ paper's) cluster tables as data, and the configs the planner runs them as.

Published figures: ZeRO-3's (the paper's "baseline") and ZeRO++'s TFLOP/s per GPU, Table 1(a) (384 V100, DGX-2
nodes of 16, 1 and 8 InfiniBand connections of 100 Gbit/s, 18B-138B, 1K and 2K tokens per GPU), Table 1(b)
(32 A100, 1 and 4 IB connections), Table 7 (ZeRO-3 against hpZ, 4 nodes of 16 V100) and Table 8 (64 V100 over
10 Gbit/s Ethernet). The paper gives the models' sizes, not their shapes ("the number of layers and hidden sizes
are adjusted", §4.1); the shapes below are ours: GPT-style (Megatron-DeepSpeed's GPT: GELU 4h MLP, LayerNorm,
biases, 128-wide heads, GPT-2's 50,304-token vocabulary, tied embeddings), 12 L h^2 within 2% of the size.

How the rows are read (stated, not fitted): "tokens per GPU" is the micro-batch (§4.1: "2K tokens per GPU (i.e.,
micro batch size)"), here one sequence of that length; one micro-batch per GPU and step; fp16 (V100 has no
bf16); full activation recomputation (a 138B model's activations do not fit 32 GB otherwise), and the paper's
TFLOP/s count the recomputed forward (Megatron-DeepSpeed's throughput formula, checkpoint_activations_factor 4:
4/3 of the model FLOPs), so the planner's model TFLOP/s are multiplied by 4/3 to compare. ZeRO++ is int8 qwZ,
hpZ over the node and int4 qgZ (§4.1, Table 8's note). The A100 nodes: 8 GPUs, 200 Gbit/s per IB connection
(HDR; not stated in the paper: an assumption). Table 7's bandwidth is not stated either: taken as the full
8 x 100 Gbit/s of §4.1's cluster.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

SHAPES: Dict[str, Tuple[int, int]] = {"7.5B": (36, 4096), "18B": (40, 6144), "49B": (60, 8192),
                                      "91B": (72, 10240), "138B": (76, 12288)}
"""(layers, d_model) per model size (ours; see the module docstring)."""

RECOMPUTE_FLOPS = 4 / 3
"""The paper's TFLOP/s count the recomputed forward: 4/3 of the model FLOPs (module docstring)."""

# (table, gpu, gpus, gpus per node, inter-node Gbit/s per node, model, tokens per GPU, baseline TFLOP/s,
#  other system, its TFLOP/s)
_ROWS: List[tuple] = []
for ib, base_zpp in ((1, ((19.96, 37.90), (11.25, 21.81), (19.99, 38.06), (11.27, 21.93), (20.06, 38.08),
                           (11.27, 21.95), (25.98, 46.40), (14.15, 30.57))),
                     (8, ((47.55, 55.30), (34.19, 44.38), (47.74, 56.26), (34.49, 44.36), (48.05, 56.24),
                          (34.54, 44.46), (47.31, 53.65), (31.27, 37.87)))):
    sizes = ("138B", "138B", "91B", "91B", "49B", "49B", "18B", "18B")
    for size, tokens, (base, zpp) in zip(sizes, (2048, 1024) * 4, base_zpp):
        _ROWS.append((f"1a {ib}IB", "v100", 384, 16, 100.0 * ib, size, tokens, base, "zeropp", zpp))
for ib, pairs in ((1, ((64.99, 111.66), (34.52, 65.2))), (4, ((134.65, 134.94), (85.16, 93.12)))):
    for tokens, (base, zpp) in zip((2048, 1024), pairs):
        _ROWS.append((f"1b {ib}IB", "a100", 32, 8, 200.0 * ib, "18B", tokens, base, "zeropp", zpp))
for size, tokens, base, hpz in (("7.5B", 1024, 36.99, 38.39), ("7.5B", 2048, 53.3, 54.4),
                                ("18B", 1024, 51.47, 52.42), ("18B", 2048, 60.94, 61.44)):
    _ROWS.append(("7", "v100", 64, 16, 800.0, size, tokens, base, "hpz", hpz))
for size, tokens, base, zpp in (("18B", 2048, 9.72, 31.94), ("18B", 1024, 4.98, 19.16), ("18B", 512, 2.51, 10.03),
                                ("7.5B", 2048, 10.07, 24.51), ("7.5B", 1024, 4.81, 15.90),
                                ("7.5B", 512, 2.48, 7.32)):
    _ROWS.append(("8 10GbE", "v100", 64, 16, 10.0, size, tokens, base, "zeropp", zpp))

FIELDS = ("table", "gpu", "gpus", "gpus_per_node", "inter_gbit", "model", "tokens", "baseline", "system", "other")
ROWS: List[Dict[str, object]] = [dict(zip(FIELDS, r)) for r in _ROWS]


def overrides(model: str, tokens: int, gpus: int, system: str, gpus_per_node: int) -> List[str]:
    """``key=value`` overrides (on the defaults) of one row's run: the model, the batch, ZeRO-3 or the system."""
    layers, d = SHAPES[model]
    keys = [f"model.n_layers={layers}", f"model.d_model={d}", f"model.n_heads={d // 128}",
            f"model.seq_len={tokens}", "model.vocab_size=50304", "model.activation=gelu", "model.norm=layernorm",
            "model.bias=true", "model.tie_embeddings=true", "model.activation_checkpointing=full",
            "train.micro_batch_size=1", f"train.global_batch_size={gpus}", "precision=fp16", "zero.stage=3"]
    if system == "zeropp":
        keys += ["zero.quantized_weights=true", "zero.weight_bits=8", f"zero.hpz_size={gpus_per_node}",
                 "zero.quantized_gradients=true", "zero.gradient_bits=4"]
    elif system == "hpz":
        keys += [f"zero.hpz_size={gpus_per_node}"]
    return keys


def zero3_link_bound(row: Dict[str, object]) -> float:
    """The most ZeRO-3 TFLOP/s per GPU (the paper's convention: 8 x parameters x tokens per step) the row's stated
    link allows, whatever the model: each step every node must take in, for each of the two parameter all-gathers
    (forward, backward) and the fp16 gradient reduce-scatter, the (1 - G/N) of the 2-byte parameters it does not
    hold, through its NICs at their full line rate, with no compute time and nothing else on the link. Per GPU
    this is 8 x tokens x rate / (6 x (1 - G/N)), independent of the model's size. A published figure above it
    says the row's link was faster than stated."""
    share = 1 - int(row["gpus_per_node"]) / int(row["gpus"])
    rate = float(row["inter_gbit"]) * 1e9 / 8
    return 8 * int(row["tokens"]) * rate / (6 * share) / 1e12 if share > 0 else float("inf")

