"""scripts/generate.py samples, in one process, checkpoints written by layouts that cannot exist on one rank: ZeRO++
on 2 simulated nodes x 2 ranks (hpZ over 2, int8 weights, int4 gradients) and FP8-LM with ZeRO-3 and hpZ. Its greedy
text must be the argmax continuation of transformers' LlamaForCausalLM in float64 holding the checkpoint's weights
(read from the DCP files without our model, optimizer or layout code)."""
import json
import subprocess
import warnings
from pathlib import Path

import pytest
import torch

from tests.as_python import forked_python
from tests.dist_harness import run_world
from tests.parallel_utils import checkpoint_worker

import transformers  # noqa: E402  (a test dependency: requirements-dev.txt)

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "The function returns"
NEW_TOKENS = 8
# the bundled tokenizer's vocabulary (generation needs real tokens); a learning rate high enough that two steps move
# the weights far from their initialisation, so that text from unloaded weights could not pass
COMMON = ["model.vocab_size=4096", "model.n_layers=2", "train.lr=0.02", "train.warmup_steps=0"]
LAYOUTS = {
    "zeropp_2nodes_x2_hpz2_qwz_qgz": (4, ["parallel.ranks_per_node=2", "zero.stage=3", "zero.hpz_size=2",
                                          "zero.quantized_weights=true", "zero.quantized_gradients=true"]),
    "fp8_zero3_hpz2": (2, ["precision=fp8", "zero.stage=3", "zero.hpz_size=2", "parallel.ranks_per_node=2"]),
}


def checkpoint_tensors(step_dir: Path) -> dict:
    """Every model.* tensor of a checkpoint, whole, straight from its DCP files (names without 'model.')."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(str(step_dir)).read_metadata()
    state = {k: torch.empty(md.size, dtype=md.properties.dtype) for k, md in metadata.state_dict_metadata.items()
             if k.startswith("model.") and isinstance(md, TensorStorageMetadata)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming the intent is to load in a single process"
        dcp.load(state, checkpoint_id=str(step_dir), no_dist=True)
    return {k[len("model."):]: t for k, t in state.items()}


def reference_greedy(step_dir: Path, prompt: str, max_new_tokens: int) -> str:
    """Argmax decoding by transformers' Llama in float64 holding the checkpoint's weights, decoded by sentencepiece."""
    import sentencepiece as spm

    from model.hf import llama_config, to_hf

    settings = json.loads((step_dir / "meta.json").read_text())["config"]["model"]
    sp = spm.SentencePieceProcessor(model_file=str(ROOT / "data" / "sample" / "tokenizer.model"))
    config = llama_config(settings, dtype="float64", bos_id=sp.bos_id(), eos_id=sp.eos_id())
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).to(torch.float64).eval()
    weights = {k: t.double() for k, t in to_hf(checkpoint_tensors(step_dir), settings).items()}
    model.load_state_dict(weights, strict=True)
    ids = sp.encode(prompt)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1]
            top2 = logits.topk(2).values
            assert top2[0] - top2[1] > 1e-4, "a near tie: fp32 and float64 could pick different tokens"
            nxt = int(logits.argmax())
            if nxt == sp.eos_id():
                break
            ids.append(nxt)
    assert len(ids) > len(sp.encode(prompt)), "an empty continuation would make the comparison vacuous"
    return sp.decode(ids)


def generate(*args: str) -> subprocess.CompletedProcess:
    """``python scripts/generate.py ARGS``, forked (no fresh interpreter importing torch)."""
    return forked_python(str(ROOT / "scripts" / "generate.py"), *args, timeout=120)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_checkpoint_of_a_multi_node_layout_samples_in_one_process(tmp_path, name):
    world, overrides = LAYOUTS[name]
    run_world(checkpoint_worker, world, COMMON + overrides, "fresh", 2, str(tmp_path))
    step_dir = tmp_path / "step_00000002"
    greedy = generate("--checkpoint", str(tmp_path), "--prompt", PROMPT, "--max-new-tokens", str(NEW_TOKENS),
                      "--temperature", "0", "--device", "cpu")
    assert greedy.returncode == 0, greedy.stderr
    assert "step 2" in greedy.stderr
    assert greedy.stdout.rstrip("\n") == reference_greedy(step_dir, PROMPT, NEW_TOKENS)
    sampled = generate("--checkpoint", str(step_dir), "--prompt", PROMPT, "--max-new-tokens", "4",
                       "--temperature", "1.0", "--top-k", "0", "--seed", "3", "--device", "cpu")
    assert sampled.returncode == 0, sampled.stderr
    assert sampled.stdout.startswith(PROMPT)
