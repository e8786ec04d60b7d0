"""Sample text from a trained checkpoint, in one process.

    python scripts/generate.py --checkpoint runs/gpt7b/checkpoints [--prompt TEXT] [--max-new-tokens N]
                               [--temperature T] [--top-k K] [--seed S] [--device cpu|cuda] [--tokenizer PATH]

``--checkpoint`` is one checkpoint (``.../step_00000200``), a checkpoint root (its newest
valid checkpoint is used) or a run directory holding ``checkpoints/``. The model is rebuilt
from the config stored in the checkpoint's meta.json in one process: every ``parallel.*`` and
``zero.*`` setting (how the run was spread over ranks and nodes: tp, pp, virtual stages,
sequence parallelism, ranks per node, ZeRO stage and ZeRO++ qwZ/qgZ/hpZ) is reset to its
default, none of which changes the model's forward pass. Checkpoints hold every parameter
under its global name and shape, so one written at any layout, ZeRO++ and fp8 included,
loads. On CPU the model runs in fp32; on CUDA in the checkpoint's precision, except that an
fp8 checkpoint samples in bf16 (FP8 GEMMs speed up training; the weights are high precision).
Temperature 0 (or top-k 1) is greedy decoding. The tokenizer (the checkpoint's data.tokenizer, or --tokenizer) is
anything data/tokenizer.py reads: a sentencepiece .model, a Hugging Face tokenizer.json, or a directory holding one;
a prompt is encoded as in preprocessing (a Hugging Face post-processor's bos included), without an eos the
post-processor may append, so that the model continues it. The prompt and its continuation go to stdout,
progress to stderr. Every bad input (a missing or empty directory, no valid checkpoint, an
unreadable meta.json or tokenizer, bad option values) stops with one line and exit code 2; so do weights
holding NaN or inf (checked once, as loaded, naming the first such tensor) and a tokenizer other than the one
the checkpoint was trained with, compared by content (``data/tokenizer.py`` ``check_trained_with``: the
tokenizer at the checkpoint's data.tokenizer, the tokenizer records of the data it read), as training refuses
data made with another tokenizer. A copy of the right tokenizer anywhere passes; where nothing is left to compare
with, a ``--tokenizer`` is used on trust and stderr says so.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any, Dict

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the application runs from the repository root (like Megatron-LM)

import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from omegaconf.errors import OmegaConfBaseException  # noqa: E402

DISTRIBUTED_SECTIONS = ("parallel", "zero")
"""Config sections that only say how a run is spread over processes and nodes (and how its gradients, weights and
optimizer states move between them): reset whole to their defaults for one process, so that a setting added to
them later is reset too. Kept: parallel.timeout_s (a collective timeout, also of this one-rank group)."""
KEEP = {"parallel": ("timeout_s",)}
SINGLE_PROCESS = ["train.micro_batch_size=1", "train.global_batch_size=1", "logging.wandb.mode=disabled"]


class GenerateError(ValueError):
    """A bad input (path, checkpoint, tokenizer, option); the message is one line naming it."""


def read_meta(step_dir: Path) -> Dict[str, Any]:
    """meta.json of a verified checkpoint; GenerateError when it is not a JSON object with a config in it."""
    meta_file = step_dir / "meta.json"
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, ValueError) as e:
        raise GenerateError(f"{meta_file} is not readable JSON ({e.__class__.__name__}: {e})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("config"), dict):
        raise GenerateError(f"{meta_file} holds no config (a mapping under 'config')")
    return meta


def single_process(config: Dict[str, Any]) -> Dict[str, Any]:
    """A checkpoint's config with every distributed-only setting (``DISTRIBUTED_SECTIONS``) at its default."""
    out = dict(config)
    for section in DISTRIBUTED_SECTIONS:
        saved = out.pop(section, None)
        kept = {k: saved[k] for k in KEEP.get(section, ()) if isinstance(saved, dict) and k in saved}
        if kept:
            out[section] = kept
    return out


def build_config(meta: Dict[str, Any], device: str, source: Path = Path("meta.json")):
    """The one-process Config of a checkpoint's meta.json: its settings, none of its layout, on ``device``
    (fp32 on CPU; bf16 instead of fp8 on CUDA)."""
    from config import Config, ConfigError, validate_config

    precision = meta["config"].get("precision")
    overrides = SINGLE_PROCESS + [f"device={device}"]
    if device == "cpu":
        overrides.append("precision=fp32")
    elif precision == "fp8":
        overrides.append("precision=bf16")
    try:
        merged = OmegaConf.merge(OmegaConf.structured(Config), single_process(meta["config"]),
                                 OmegaConf.from_dotlist(overrides))
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None)
        msg = str(e).splitlines()[0] if str(e) else e.__class__.__name__
        raise GenerateError(f"{source}: invalid config ({key + ': ' if key and key not in msg else ''}{msg})") \
            from None
    try:
        validate_config(cfg)
    except ConfigError as e:
        problems = "; ".join(e.problems or [str(e)])
        raise GenerateError(f"{source}: invalid config ({problems})") from None
    return cfg


def resolve_tokenizer(name: str, override: str | None) -> Path:
    """The tokenizer file or directory: --tokenizer, or the checkpoint's data.tokenizer (as given or under the repo)."""
    from data.tokenizer import find_tokenizer
    found = find_tokenizer(name, override)
    if found is not None:
        return found
    if override:
        raise GenerateError(f"--tokenizer {override} is not a file or directory")
    raise GenerateError(f"tokenizer {name} not found (the checkpoint's data.tokenizer; pass --tokenizer PATH)")


MAX_NEW_TOKENS = 2**20
"""--max-new-tokens: config.MAX_SEQ_LEN, the longest context any model here has (the window slides past it)."""
SEED_RANGE = (0, 2**64 - 1)
"""--seed: what torch.Generator.manual_seed takes (an unsigned 64-bit number)."""


def check_options(args: argparse.Namespace) -> None:
    if not 0 <= args.max_new_tokens <= MAX_NEW_TOKENS:
        raise GenerateError(f"--max-new-tokens {args.max_new_tokens} must be in [0, {MAX_NEW_TOKENS}] "
                            f"(generate.MAX_NEW_TOKENS = config.MAX_SEQ_LEN)")
    if not SEED_RANGE[0] <= args.seed <= SEED_RANGE[1]:
        raise GenerateError(f"--seed {args.seed} must be in [0, 2**64 - 1] (torch's generator seeds)")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise GenerateError(f"--temperature {args.temperature} must be a finite number >= 0 (0 = greedy)")
    if args.top_k < 0:
        raise GenerateError(f"--top-k {args.top_k} must be >= 0 (0 = all tokens)")


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
    p.add_argument("--tokenizer", help="sentencepiece .model, tokenizer.json or a directory holding one "
                                        "(default: the checkpoint's data.tokenizer)")
    args = p.parse_args(argv)
    check_options(args)

    from data.tokenizer import check_trained_with, load_tokenizer
    from model.hf import first_non_finite
    from parallel.launch import LaunchEnv, init_distributed
    from parallel.layout import make_layout
    from parallel.mesh import Mesh
    from training.checkpoint import Checkpointer, find_checkpoint
    from training.engine import Engine

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise GenerateError("--device cuda was requested but CUDA is not available")
    path = find_checkpoint(Path(args.checkpoint), "sampling")
    saved = read_meta(path)
    cfg = build_config(saved, args.device, path / "meta.json")
    tok = load_tokenizer(str(resolve_tokenizer(cfg.data.tokenizer, args.tokenizer)))
    if tok.vocab_size > cfg.model.vocab_size:
        raise GenerateError(f"tokenizer {tok.model_path} has {tok.vocab_size} tokens but the model's vocabulary "
                            f"has {cfg.model.vocab_size} rows (model.vocab_size): not the tokenizer it was trained "
                            "with")
    setting = "--tokenizer" if args.tokenizer else "data.tokenizer"
    if not check_trained_with(tok, saved["config"], saved.get("data"), f"checkpoint {path}", setting) \
            and args.tokenizer:
        print(f"[generate] note: nothing left tells which tokenizer {path} was trained with (its data.tokenizer "
              f"{cfg.data.tokenizer} is not found, its data records none): --tokenizer {args.tokenizer} is taken on trust",
              file=sys.stderr, flush=True)

    owned = not torch.distributed.is_initialized()
    init_distributed(LaunchEnv(0, 1, 0, 1, "127.0.0.1", 0, "single"), device, cfg.parallel.timeout_s)
    try:
        engine = Engine(cfg, Mesh(make_layout(cfg, 1, 1), device))
        meta = Checkpointer(cfg, str(path.parent), engine).load(path, with_optimizer=False)
        broken = first_non_finite({name: p.detach() for name, p in engine.params.items()})
        if broken is not None:  # sampling would fail on NaN probabilities, or print noise
            raise GenerateError(f"checkpoint {path}: model.{broken[0]} holds {broken[1]}: the weights are broken, "
                                "nothing to sample from")
        print(f"[generate] {path} (step {meta['step']}), {sum(p.numel() for p in engine.params.values()) / 1e6:.2f}M "
              f"parameters on {device} ({cfg.precision})", file=sys.stderr, flush=True)

        model = engine.chunks[0].eval()
        prompt_ids = tok.encode(args.prompt)
        if tok.appends_eod and prompt_ids and prompt_ids[-1] == tok.eod_id:
            prompt_ids = prompt_ids[:-1]  # a prompt is continued, not ended
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
        if owned:
            torch.distributed.destroy_process_group()

    # decode the whole sequence (tokenizers join pieces by context), then print the prompt as given
    text, prompt_text = tok.decode(prompt_ids + new), tok.decode(prompt_ids)
    continuation = text[len(prompt_text):] if text.startswith(prompt_text) else tok.decode(new)
    print(args.prompt + continuation, flush=True)
    print(f"[generate] {len(new)} new tokens" + (" (stopped at end of document)" if len(new) < args.max_new_tokens
                                                   else ""), file=sys.stderr)
    return 0


def cli(argv=None) -> int:
    """main() with every bad input as one line on stderr and exit code 2 (as train.py)."""
    from config import ConfigError
    from data.indexed import DataError
    from training.checkpoint import CheckpointError
    try:
        return main(argv)
    except (GenerateError, ConfigError, DataError, CheckpointError) as e:
        print("error: " + "; ".join(line.strip() for line in str(e).splitlines() if line.strip()), file=sys.stderr)
        return 2
    except OSError as e:  # an input that cannot be read (permissions, a device error)
        where = f" ({e.filename})" if e.filename else ""
        print(f"error: {e.strerror or e}{where}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(cli())
