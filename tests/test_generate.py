"""scripts/generate.py end to end: train a tiny model with train.py, then sample from its checkpoints.

Greedy decoding must reproduce the argmax continuation computed here directly from the
checkpoint through the model's logits.
"""
import os
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
from training.checkpoint import Checkpointer
from training.engine import Engine

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "generate.py"
PROMPT = "The function returns"
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _env() -> dict:
    """A single-process environment even when the tests themselves run under torchrun or SLURM."""
    return {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and not k.startswith("SLURM_")}


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)


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
    assert proc.returncode != 0
    assert "error:" in proc.stderr and "nowhere" in proc.stderr
    assert "Traceback" not in proc.stderr
