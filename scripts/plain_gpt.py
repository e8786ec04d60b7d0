"""The peer a GPU user compares the trainer with: a plain PyTorch GPT of a preset's shape, trained the usual way.

    python scripts/plain_gpt.py --preset gpt_1.3b                     # eager bf16 autocast, fp32 weights, fused AdamW
    python scripts/plain_gpt.py --preset gpt_1.3b --compile            # + torch.compile per transformer block
    python scripts/plain_gpt.py --preset gpt_1.3b --compile --float8   # + torchao float8 training (tensorwise)

The model is the preset's (``configs/<preset>.yaml``: layers, width, heads, sequence, vocabulary, GELU or SwiGLU,
LayerNorm or RMSNorm, biases, tied embeddings, rotary positions), written in about a hundred lines with nothing
of this project: ``nn.Linear``, SDPA, ``F.cross_entropy`` on fp32 logits, ``torch.optim.AdamW(fused=True)``. The
batches are random tokens (the speed of a step does not depend on them). ``--float8`` converts every linear of
the blocks with torchao's ``convert_to_float8_training`` (its default tensorwise recipe; the output head stays
bf16, as torchtitan and this trainer do), before compiling, as torchao asks. Prints one JSON line: tokens/s
(mean over the timed steps), peak memory and the last loss, which ``scripts/bench_fp8.py`` puts in its table.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from config import load_config  # noqa: E402  (the preset's shape only)
from scripts._cli import InputError, at_least, preset as preset_file  # noqa: E402


class Block(nn.Module):
    def __init__(self, m):
        super().__init__()
        d, bias = m.d_model, m.bias
        norm = (lambda: nn.LayerNorm(d, eps=m.norm_eps, bias=bias)) if m.norm == "layernorm" else \
            (lambda: nn.RMSNorm(d, eps=m.norm_eps))
        self.heads, self.swiglu = m.n_heads, m.activation == "swiglu"
        self.n1, self.n2 = norm(), norm()
        self.qkv = nn.Linear(d, 3 * d, bias=bias or m.qkv_bias)
        self.proj = nn.Linear(d, d, bias=bias)
        self.up = nn.Linear(d, m.ffn_size * (2 if self.swiglu else 1), bias=bias)
        self.down = nn.Linear(m.ffn_size, d, bias=bias)

    def forward(self, x, cos, sin):
        b, s, d = x.shape
        q, k, v = self.qkv(self.n1(x)).view(b, s, 3, self.heads, -1).transpose(1, 3).unbind(2)  # [b, h, s, hd]

        def rope(t):
            t1, t2 = t.chunk(2, dim=-1)
            return (t * cos + torch.cat([-t2, t1], dim=-1) * sin).to(t.dtype)

        o = F.scaled_dot_product_attention(rope(q), rope(k), v, is_causal=True)
        x = x + self.proj(o.transpose(1, 2).reshape(b, s, d))
        h = self.up(self.n2(x))
        h = F.silu(h.chunk(2, -1)[0]) * h.chunk(2, -1)[1] if self.swiglu else F.gelu(h, approximate="tanh")
        return x + self.down(h)


class GPT(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.embed = nn.Embedding(m.vocab_size, m.d_model)
        self.blocks = nn.ModuleList(Block(m) for _ in range(m.n_layers))
        self.norm = nn.LayerNorm(m.d_model, bias=m.bias) if m.norm == "layernorm" else nn.RMSNorm(m.d_model)
        self.head = nn.Linear(m.d_model, m.vocab_size, bias=False)
        if m.tie_embeddings:
            self.head.weight = self.embed.weight
        hd = m.d_model // m.n_heads
        freq = 1.0 / (m.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
        angles = torch.outer(torch.arange(m.seq_len, dtype=torch.float64), freq).repeat(1, 2)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:  # GPT-2 init: N(0, 0.02), output projections scaled by depth
                std = m.init_std / math.sqrt(2 * m.n_layers) if name.endswith(("proj.weight", "down.weight")) \
                    else m.init_std
                nn.init.normal_(p, std=std)

    def forward(self, tokens, labels):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, self.cos, self.sin)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="gpt_1.3b", help="configs/<preset>.yaml, or a YAML file's path")
    ap.add_argument("--compile", action="store_true", help="torch.compile each transformer block")
    ap.add_argument("--float8", action="store_true", help="torchao float8 training (tensorwise) of the blocks")
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=6)
    args = ap.parse_args(argv)
    for option in ("micro_batch", "accum", "steps"):
        at_least(getattr(args, option), 1, "--" + option.replace("_", "-"))
    at_least(args.warmup, 0, "--warmup")
    m = load_config(preset_file(args.preset), []).model  # bad --preset: one line, exit 2 (scripts/_cli.py)
    if args.float8:
        try:
            import torchao.float8  # noqa: F401
        except ImportError:
            raise InputError("--float8 needs torchao (pip install -r requirements-gpu.txt)") from None
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = GPT(m).to(device)
    if args.float8:
        from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(model, module_filter_fn=lambda mod, fqn: fqn.startswith("blocks."))
    if args.compile:
        for block in model.blocks:
            block.compile()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-4, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=device.type == "cuda")
    b, s = args.micro_batch, m.seq_len
    rates, loss = [], None
    for step in range(1, args.steps + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.accum):
            tokens = torch.randint(0, m.vocab_size, (b, s + 1), device=device)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = model(tokens[:, :-1], tokens[:, 1:]) / args.accum
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step > args.warmup:
            rates.append(b * s * args.accum / (time.perf_counter() - t0))
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
    print(json.dumps({"tokens_per_s": sum(rates) / max(len(rates), 1), "peak_mem_gib": peak,
                      "loss": loss.item() * args.accum, "compile": args.compile, "float8": args.float8}))
    return 0


if __name__ == "__main__":
    from _cli import run  # scripts/ is sys.path[0] when a script runs

    sys.exit(run(main))
