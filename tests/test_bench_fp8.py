"""scripts/plain_gpt.py, the peer rows of scripts/bench_fp8.py: the preset's shape in plain PyTorch trains and reports.

The GPU rows are measured by scripts/gpu_check.sh; here the script runs eager on CPU at the tiny preset, and its
model is checked against the trainer's own parameter count for the same preset (the same shape, so the same FLOPs a
token in the bench's TFLOP/s column)."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from config import load_config
from model.flops import parameter_count

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))


@pytest.mark.parametrize("preset", ["tiny", "gpt_1.3b"])
def test_plain_gpt_has_the_presets_shape(preset):
    import torch

    from plain_gpt import GPT

    m = load_config(str(ROOT / "configs" / f"{preset}.yaml"), []).model
    with torch.device("meta"):
        model = GPT(m)
    assert sum(p.numel() for p in model.parameters()) == parameter_count(m)["total"]


def test_plain_gpt_trains_and_prints_one_json_line(capsys):
    from plain_gpt import main

    assert main(["--preset", "tiny", "--steps", "3", "--warmup", "1", "--micro-batch", "2", "--accum", "2"]) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["tokens_per_s"] > 0 and not record["compile"] and not record["float8"]
    vocab = load_config(str(ROOT / "configs" / "tiny.yaml"), []).model.vocab_size
    assert abs(record["loss"] - math.log(vocab)) < 0.5, record  # random tokens: about ln(vocab) after 3 steps
