"""scripts/generate.py end to end: train a tiny model with train.py, then sample from its checkpoints.

Greedy decoding must reproduce the argmax continuation computed here directly from the
checkpoint through the model's logits.
"""
import json
import os
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from config import load_config
from data.tokenizer import Tokenizer
from parallel.launch import LaunchEnv, init_distributed
from parallel.layout import make_layout
from parallel.mesh import Mesh
from tests.as_python import forked_python
from training.checkpoint import Checkpointer, file_digest
from training.engine import Engine

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "generate.py"
PROMPT = "The function returns"


def _run(*args: str) -> subprocess.CompletedProcess:
    """``python ARGS`` (train.py or scripts/generate.py) as a fresh interpreter would run it, forked instead."""
    return forked_python(*args, timeout=120)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("gen") / "run"
    proc = _run("train.py", "model.n_layers=2", "model.d_model=64", "model.n_heads=2", "train.max_steps=3",
                "train.global_batch_size=4", "train.micro_batch_size=2", f"logging.run_dir={run}",
                "logging.wandb.mode=disabled", "train.eval_interval=0", "checkpoint.interval=3", "device=cpu")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (run / "checkpoints" / "step_00000003" / "meta.json").is_file()
    return run


def reference_greedy(checkpoint: Path, prompt: str, max_new_tokens: int) -> str:
    """Argmax decoding straight from the checkpoint, written independently of the script."""
    meta_cfg = OmegaConf.load(checkpoint / "meta.json").config
    yaml_file = checkpoint.parent.parent / "reference.yaml"
    OmegaConf.save(meta_cfg, yaml_file)
    cfg = load_config(str(yaml_file), ["logging.wandb.mode=disabled", "device=cpu"])
    tok = Tokenizer(str(ROOT / cfg.data.tokenizer))
    assert tok.vocab_size == cfg.model.vocab_size  # no padded rows, so the full-vocabulary argmax is a real token
    owned = not dist.is_initialized()
    init_distributed(LaunchEnv(0, 1, 0, 1, "127.0.0.1", 0, "single"), torch.device("cpu"), 60)
    try:
        engine = Engine(cfg, Mesh(make_layout(cfg, 1, 1), torch.device("cpu")))
        Checkpointer(cfg, str(checkpoint.parent), engine).load(checkpoint, with_optimizer=False)
        model = engine.chunks[0].eval()
        prompt_ids = tok.encode(prompt)
        ids = list(prompt_ids)
        with torch.no_grad():
            for _ in range(max_new_tokens):
                logits = model.logits(torch.tensor([ids[-cfg.model.seq_len:]]))
                nxt = int(logits[0, -1].argmax())
                if nxt == tok.eod_id:
                    break
                ids.append(nxt)
    finally:
        if owned:
            dist.destroy_process_group()
    assert len(ids) > len(prompt_ids), "the reference continuation is empty: the comparison would be vacuous"
    assert tok.decode(prompt_ids) == prompt
    return tok.decode(ids)


def test_sampling_prints_prompt_and_continuation(run_dir):
    args = [str(SCRIPT), "--checkpoint", str(run_dir / "checkpoints"), "--prompt", PROMPT, "--max-new-tokens", "16",
            "--temperature", "0.9", "--top-k", "20", "--seed", "7", "--device", "cpu"]
    first, second = _run(*args), _run(*args)
    assert first.returncode == 0, first.stdout + first.stderr
    assert first.stdout.startswith(PROMPT)
    assert "step 3" in first.stderr
    assert second.stdout == first.stdout, "the same seed must give the same sample"


def test_greedy_matches_reference_argmax(run_dir):
    proc = _run(str(SCRIPT), "--checkpoint", str(run_dir), "--prompt", PROMPT, "--max-new-tokens", "12",
                "--temperature", "0", "--device", "cpu")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    expected = reference_greedy(run_dir / "checkpoints" / "step_00000003", PROMPT, 12)
    assert proc.stdout.rstrip("\n") == expected


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    proc = _run(str(SCRIPT), "--checkpoint", str(tmp_path / "nowhere"), "--device", "cpu")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == f"error: checkpoint {tmp_path / 'nowhere'} does not exist"


# ---- every bad input: one line, exit code 2 (as train.py) ----------------------------------------------------

def run_script(monkeypatch, capfd, *args: str) -> tuple:
    """The script as the command line runs it (``sys.exit(cli())``), in this process: (exit code, stderr)."""
    capfd.readouterr()
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), *args])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(SCRIPT), run_name="__main__")
    return exit_info.value.code, capfd.readouterr().err.strip()


def _rewrite(step_dir: Path, name: str, data: bytes) -> None:
    """Replace a checkpoint file and record it in the manifest, so that the checkpoint still verifies."""
    (step_dir / name).write_bytes(data)
    manifest = json.loads((step_dir / "manifest.json").read_text())
    manifest["files"][name] = file_digest(step_dir / name)
    (step_dir / "manifest.json").write_text(json.dumps(manifest))


def _with_config(**changes):
    """A meta.json editor (bytes to bytes) updating config sections: ``model={"n_heads": 3}``."""
    def edit(raw: bytes) -> bytes:
        meta = json.loads(raw)
        for section, values in changes.items():
            meta["config"][section].update(values)
        return json.dumps(meta).encode()
    return edit


def _flip_byte(data: bytes) -> bytes:
    data = bytearray(data)
    data[len(data) // 2] ^= 0xFF
    return bytes(data)


BAD_META = {  # name: (how meta.json changes, whether the manifest is updated, what the error names)
    "meta_corrupted": (_flip_byte, False, "meta.json: content does not match"),
    "meta_not_json": (lambda raw: b"{not json", True, "meta.json is not readable JSON"),
    "meta_without_config": (lambda raw: json.dumps({"step": 3}).encode(), True, "meta.json holds no config"),
    "meta_wrong_type": (_with_config(model={"d_model": "abc"}), True, "model.d_model"),
    "meta_unknown_key": (_with_config(model={"n_expert": 4}), True, "n_expert"),
    "meta_inconsistent": (_with_config(model={"n_heads": 3}), True,
                          "model.d_model=64 is not divisible by model.n_heads=3"),
    "meta_tokenizer_missing": (_with_config(data={"tokenizer": "nowhere/tok.model"}), True,
                               "tokenizer nowhere/tok.model not found"),
    "meta_vocabulary_too_small": (_with_config(model={"vocab_size": 128}), True,
                                  "has 4096 tokens but the model's vocabulary has 128 rows"),
}


@pytest.mark.parametrize("name", sorted(BAD_META))
def test_bad_checkpoint_is_one_line_and_exit_code_2(run_dir, tmp_path, monkeypatch, capfd, name):
    edit, update_manifest, expected = BAD_META[name]
    step_dir = tmp_path / "checkpoints" / "step_00000003"
    shutil.copytree(run_dir / "checkpoints" / "step_00000003", step_dir)
    data = edit((step_dir / "meta.json").read_bytes())
    if update_manifest:
        _rewrite(step_dir, "meta.json", data)
    else:
        (step_dir / "meta.json").write_bytes(data)
    code, err = run_script(monkeypatch, capfd, "--checkpoint", str(step_dir), "--device", "cpu")
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("error: ") and expected in err, (code, err)


def test_bad_paths_and_options_are_one_line_and_exit_code_2(run_dir, tmp_path, monkeypatch, capfd):
    def error(*args: str) -> str:
        code, err = run_script(monkeypatch, capfd, *args)
        assert code == 2 and len(err.splitlines()) == 1 and err.startswith("error: "), (code, err)
        return err

    ckpt = str(run_dir / "checkpoints")
    assert "does not exist" in error("--checkpoint", str(tmp_path / "nowhere"), "--device", "cpu")
    (tmp_path / "file").write_text("x")
    assert "is not a directory" in error("--checkpoint", str(tmp_path / "file"), "--device", "cpu")
    (tmp_path / "empty").mkdir()
    assert "no checkpoint in" in error("--checkpoint", str(tmp_path / "empty"), "--device", "cpu")
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)  # a run directory that never saved
    assert "no checkpoint in" in error("--checkpoint", str(tmp_path / "run"), "--device", "cpu")
    broken = tmp_path / "broken" / "step_00000003"
    shutil.copytree(run_dir / "checkpoints" / "step_00000003", broken)
    victim = sorted(broken.glob("*.distcp"))[0]
    victim.write_bytes(_flip_byte(victim.read_bytes()))
    err = error("--checkpoint", str(broken.parent), "--device", "cpu")
    assert "no valid checkpoint in" in err and victim.name in err and "corrupted" in err
    assert "--tokenizer nowhere.model is not a file" in error("--checkpoint", ckpt, "--tokenizer", "nowhere.model",
                                                               "--device", "cpu")
    (tmp_path / "tok.model").write_text("not a sentencepiece model")
    assert "not a valid SentencePiece model" in error("--checkpoint", ckpt, "--tokenizer", str(tmp_path / "tok.model"),
                                                      "--device", "cpu")
    # a seed beyond torch's 64 bits was a manual_seed traceback; a token count had no ceiling
    for option, value in (("--max-new-tokens", "-1"), ("--top-k", "-2"), ("--temperature", "-1"),
                          ("--temperature", "nan"), ("--seed", str(2**70)), ("--seed", "-1"),
                          ("--max-new-tokens", "10000000000")):
        assert f"{option} {value}" in error("--checkpoint", ckpt, option, value, "--device", "cpu")
    if not torch.cuda.is_available():
        assert "CUDA is not available" in error("--checkpoint", ckpt, "--device", "cuda")
    (tmp_path / "random.bin").write_bytes(os.urandom(4096))
    assert "is not a directory" in error("--checkpoint", str(tmp_path / "random.bin"), "--device", "cpu")
    assert "not a valid SentencePiece model" in error("--checkpoint", ckpt, "--tokenizer", str(tmp_path / "random.bin"),
                                                      "--device", "cpu")
    assert "holds no tokenizer.json" in error("--checkpoint", ckpt, "--tokenizer", str(tmp_path / "empty"),
                                              "--device", "cpu")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "tokenizer.json").write_bytes(os.urandom(4096))
    assert "not a tokenizers JSON file" in error("--checkpoint", ckpt, "--tokenizer", str(tmp_path / "hf"),
                                                 "--device", "cpu")


# ---- the weights and the tokenizer are the checkpoint's --------------------------------------------------------

def test_weights_holding_nan_are_refused_naming_the_tensor(run_dir, tmp_path, monkeypatch, capfd):
    from tests.test_hf_export import poisoned

    step = run_dir / "checkpoints" / "step_00000003"
    ckpt = poisoned(step, tmp_path / "checkpoints" / step.name, "model.layers.1.mlp.down.weight", float("nan"))
    code, err = run_script(monkeypatch, capfd, "--checkpoint", str(ckpt), "--prompt", PROMPT, "--device", "cpu")
    assert code == 2 and len(err.splitlines()) == 1, (code, err)
    assert err.startswith(f"error: checkpoint {ckpt}: model.layers.1.mlp.down.weight holds non-finite values "
                          "(1 NaN, 0 inf of "), err


def test_a_tokenizer_other_than_the_checkpoints_is_refused_as_training_refuses_it(run_dir, tmp_path, monkeypatch,
                                                                                  capfd):
    """By content: against the tokenizer at the checkpoint's data.tokenizer, else the tokenizer its data's index
    records; the right tokenizer copied anywhere passes; with nothing left to compare, stderr says so."""
    from tests.test_hf_export import other_sentencepiece, with_meta

    step = run_dir / "checkpoints" / "step_00000003"
    other = str(other_sentencepiece(tmp_path / "other" / "tokenizer.model"))
    copy = tmp_path / "copy" / "tok.model"
    copy.parent.mkdir()
    shutil.copyfile(ROOT / "data" / "sample" / "tokenizer.model", copy)

    def sample(ckpt: Path, tokenizer: str) -> tuple:
        return run_script(monkeypatch, capfd, "--checkpoint", str(ckpt), "--tokenizer", tokenizer, "--prompt", PROMPT,
                          "--max-new-tokens", "2", "--device", "cpu")

    code, err = sample(step, other)
    assert code == 2 and len(err.splitlines()) == 1, (code, err)
    assert err.startswith(f"error: --tokenizer {other} is not the tokenizer checkpoint {step} was trained with: its "
                          "data.tokenizer data/sample/tokenizer.model is another"), err
    moved = with_meta(step, tmp_path / "moved" / step.name, data={"tokenizer": "gone/tokenizer.model"})
    code, err = sample(moved, other)  # the data's index still records the tokenizer that made it
    assert code == 2 and len(err.splitlines()) == 1, (code, err)
    assert "the tokenizer that made its data data/sample/sample_text_document ('tokenizer.model') is another" in err
    code, err = sample(moved, str(copy))
    assert code == 0 and "error" not in err and "note:" not in err, (code, err)
    gone = with_meta(step, tmp_path / "gone" / step.name, data={"tokenizer": "gone/tokenizer.model"},
                     meta={"data": None})
    code, err = sample(gone, other)
    assert code == 0 and f"nothing left tells which tokenizer {gone} was trained with" in err, (code, err)


# ---- one process, whatever the layout ------------------------------------------------------------------------

def test_every_distributed_setting_is_reset_for_one_process():
    """A checkpoint's config with every parallel.* and zero.* key away from its default (a layout of 2 nodes, ZeRO++)
    and precision=fp8 becomes a valid one-process config: those keys at their defaults (the collective timeout
    kept), the model untouched, fp32 on CPU and bf16 on CUDA."""
    import dataclasses

    from config import Config, ParallelConfig, ZeroConfig, to_dict
    from parallel.layout import make_layout

    sys.path.insert(0, str(ROOT / "scripts"))
    import generate

    parallel = {"tp": 2, "pp": 2, "sequence_parallel": True, "virtual_stages": 2, "ranks_per_node": 2,
                "bucket_mb": 1.0, "overlap_grad_reduce": False, "timeout_s": 30.0, "ep": 2, "cp": 2,
                "cp_comm": "all_gather"}
    zero = {"stage": 3, "partition": "whole_tensor", "reduce_dtype": "fp32", "prefetch": False,
            "quantized_weights": True, "weight_bits": 4, "hpz_size": 2, "quantized_gradients": True,
            "gradient_bits": 8, "quant_block": 64, "qgz_stages": 1, "qgz_min_numel": 0, "quant_error_interval": 5,
            "prefetch_depth": 3, "reduce_in_flight": 4, "weight_delta": True, "gradient_bits_intra": 8,
            "gradient_hadamard": True, "early_step": False}
    assert set(parallel) == {f.name for f in dataclasses.fields(ParallelConfig)}, "a new parallel.* key: add it"
    assert set(zero) == {f.name for f in dataclasses.fields(ZeroConfig)}, "a new zero.* key: add it"
    config = to_dict(Config())
    config["parallel"].update(parallel)
    config["zero"].update(zero)
    config["model"].update(n_layers=4, d_model=96, n_heads=6, n_kv_heads=2)
    config["model"]["moe"].update(num_experts=4)  # (parallel.ep=2 splits them; one process holds them all)
    config["precision"] = "fp8"
    for device, precision in (("cpu", "fp32"), ("cuda", "bf16")):
        cfg = generate.build_config({"config": config}, device)
        assert to_dict(cfg)["model"] == config["model"]
        assert to_dict(cfg)["zero"] == to_dict(Config())["zero"]
        assert to_dict(cfg)["parallel"] == {**to_dict(Config())["parallel"], "timeout_s": 30.0}
        assert (cfg.precision, cfg.device) == (precision, device)
        layout = make_layout(cfg, 1, 1)
        assert (layout.world_size, layout.tp, layout.pp, layout.dp) == (1, 1, 1, 1)
