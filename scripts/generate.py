"""Sample text from a trained checkpoint, in one process.

    python scripts/generate.py --checkpoint runs/gpt7b/checkpoints [--prompt TEXT] [--max-new-tokens N]
                               [--temperature T] [--top-k K] [--seed S] [--device cpu|cuda]

``--checkpoint`` is one checkpoint (``.../step_00000200``), a checkpoint root (its newest
valid checkpoint is used) or a run directory holding ``checkpoints/``. The model is rebuilt
from the config stored in the checkpoint's meta.json with a single-process layout;
checkpoints reshard, so one written at any (tp, pp, dp) loads. Temperature 0 (or top-k 1)
is greedy decoding. The prompt and its continuation go to stdout, progress to stderr.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the application runs from the repository root (like Megatron-LM)

import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

SINGLE_PROCESS = ["parallel.tp=1", "parallel.pp=1", "parallel.virtual_stages=1", "parallel.sequence_parallel=false",
                  "parallel.ranks_per_node=null", "train.micro_batch_size=1", "train.global_batch_size=1",
                  "logging.wandb.mode=disabled"]


def find_meta(path: Path) -> Path:
    """meta.json of the checkpoint itself, or of the newest one under a root (only to read the config)."""
    if (path / "meta.json").is_file():
        return path / "meta.json"
    metas = sorted(m for m in path.glob("step_*/meta.json") if re.fullmatch(r"step_\d{8}", m.parent.name))
    if not metas:
        raise SystemExit(f"error: no checkpoint in {path} (expected step_*/meta.json there)")
    return metas[-1]


def build_config(meta: dict, device: str):
    from config import Config, validate_config
    overrides = SINGLE_PROCESS + [f"device={device}"] + (["precision=fp32"] if device == "cpu" else [])
    merged = OmegaConf.merge(OmegaConf.structured(Config), meta["config"], OmegaConf.from_dotlist(overrides))
    cfg = OmegaConf.to_object(merged)
    validate_config(cfg)
    return cfg


def resolve_tokenizer(name: str, override: str | None) -> Path:
    from data.tokenizer import find_model_file
    found = find_model_file(name, override)
    if found is not None:
        return found
    raise SystemExit(f"error: tokenizer {override or name} not found (the checkpoint's data.tokenizer; "
                     "pass --tokenizer PATH)")


def sample_next(logits: torch.Tensor, temperature: float, top_k: int, gen: torch.Generator) -> int:
    """One token id from the last position's logits [V]."""
    if temperature <= 0 or top_k == 1:
        return int(logits.argmax())
    logits = logits.float() / temperature
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="checkpoint dir, checkpoint root or run dir")
    p.add_argument("--prompt", default="", help="text to continue (empty: start a new document)")
    p.add_argument("--max-new-tokens", type=int, default=100)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=50, help="sample among the k most likely tokens (0 = all)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokenizer", help="sentencepiece model (default: the checkpoint's data.tokenizer)")
    args = p.parse_args(argv)

    from data.tokenizer import Tokenizer
    from parallel.launch import LaunchEnv, init_distributed
    from parallel.layout import make_layout
    from parallel.mesh import Mesh
    from training.checkpoint import Checkpointer
    from training.engine import Engine

    path = Path(args.checkpoint)
    if not path.exists():
        raise SystemExit(f"error: checkpoint {path} does not exist")
    if not (path / "meta.json").is_file() and not any(path.glob("step_*")) and (path / "checkpoints").is_dir():
        path = path / "checkpoints"  # a run directory
    cfg = build_config(json.loads(find_meta(path).read_text()), args.device)
    tok = Tokenizer(str(resolve_tokenizer(cfg.data.tokenizer, args.tokenizer)))

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda was requested but CUDA is not available")
    init_distributed(LaunchEnv(0, 1, 0, 1, "127.0.0.1", 0, "single"), device, cfg.parallel.timeout_s)
    try:
        engine = Engine(cfg, Mesh(make_layout(cfg, 1, 1), device))
        ckpt = Checkpointer(cfg, str(path), engine)
        if not (path / "meta.json").is_file():
            path = ckpt.find_resumable(quarantine=False)  # newest verified checkpoint; read-only
            if path is None:
                raise SystemExit(f"error: no valid checkpoint in {args.checkpoint}")
        meta = ckpt.load(path, with_optimizer=False)
        print(f"[generate] {path} (step {meta['step']}), {sum(p.numel() for p in engine.params.values()) / 1e6:.2f}M "
              f"parameters on {device}", file=sys.stderr, flush=True)

        model = engine.chunks[0].eval()
        prompt_ids = tok.encode(args.prompt)
        ids = list(prompt_ids) or [tok.eod_id]  # an empty prompt starts a document, as after an EOD in training
        gen = torch.Generator(device=device).manual_seed(args.seed)
        new: list[int] = []
        with torch.no_grad(), engine.autocast():
            for _ in range(args.max_new_tokens):
                context = torch.tensor([ids[-cfg.model.seq_len:]], device=device)
                logits = model.logits(context)[0, -1, :tok.vocab_size]  # padded rows are never real tokens
                nxt = sample_next(logits, args.temperature, args.top_k, gen)
                if nxt == tok.eod_id:
                    break
                ids.append(nxt)
                new.append(nxt)
    finally:
        torch.distributed.destroy_process_group()

    # decode the whole sequence (sentencepiece joins pieces by context), then print the prompt as given
    text, prompt_text = tok.decode(prompt_ids + new), tok.decode(prompt_ids)
    continuation = text[len(prompt_text):] if text.startswith(prompt_text) else tok.decode(new)
    print(args.prompt + continuation, flush=True)
    print(f"[generate] {len(new)} new tokens" + (" (stopped at end of document)" if len(new) < args.max_new_tokens
                                                   else ""), file=sys.stderr)
    return 0


def cli() -> int:
    from config import ConfigError
    from data.indexed import DataError
    from training.checkpoint import CheckpointError
    try:
        return main()
    except (ConfigError, DataError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(cli())
