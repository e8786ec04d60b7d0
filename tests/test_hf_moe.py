"""Qwen3 (QK-norm), Mixtral, Qwen2-MoE and Qwen3-MoE in and out: each family's tiny random model, built and saved by
transformers (fp32), imports to transformers' logits, exports to a directory transformers loads as the same family
with the same logits, and the round trip gives back its tensors bit for bit and its settings; Qwen's MoE layer sets
(decoder_sparse_step, mlp_only_layers, dense layers first) included. A Qwen2-MoE import trains at pp2 from its
weights (first loss transformers') and samples with scripts/generate.py as transformers' greedy search does. What
the families have and we cannot compute, or the reverse, is refused in one line naming it. The reference is always
transformers' own model class."""
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from tests.test_hf_export import ROOT, export, our_logits, random_tokens
from tests.test_hf_import import import_model, train_from_import

import transformers  # noqa: E402  (a test dependency: requirements-dev.txt)

sys.path.insert(0, str(ROOT / "scripts"))

VOCAB = 4096  # the bundled tokenizer's: generate.py samples with it
TOLERANCE = 1e-5  # max abs difference of the logits (fp32)
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
              initializer_range=0.1, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
# Widths multiples of 4 run our experts as torch._grouped_mm on CPU (fp32 rows of 16 bytes, model/moe.py
# grouped_gemm_runs); Qwen3-MoE's 22 (88-byte rows) runs our loop over experts. transformers' own experts run
# "eager" (a loop over experts, its numerics reference): its default grouped_mm path fails on 88-byte rows.
EXPERTS = "eager"
FAMILIES = {
    "qwen3": (transformers.Qwen3ForCausalLM, transformers.Qwen3Config, dict(
        head_dim=24, tie_word_embeddings=True, use_sliding_window=False)),
    "mixtral": (transformers.MixtralForCausalLM, transformers.MixtralConfig, dict(
        head_dim=8, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.02,
        router_jitter_noise=0.0, sliding_window=None)),
    "qwen2_moe": (transformers.Qwen2MoeForCausalLM, transformers.Qwen2MoeConfig, dict(
        moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=False, use_sliding_window=False, tie_word_embeddings=True)),
    "qwen2_moe_step2": (transformers.Qwen2MoeForCausalLM, transformers.Qwen2MoeConfig, dict(
        num_hidden_layers=4, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=2, use_sliding_window=False)),
    "qwen3_moe_dense_first": (transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig, dict(
        num_hidden_layers=3, head_dim=16, moe_intermediate_size=22, num_experts=8, num_experts_per_tok=3,
        norm_topk_prob=True, mlp_only_layers=[0], use_sliding_window=False)),
}
EXPECTED = {  # what the import must set (beyond sizes), per case
    "qwen3": {"hf_model_type": "qwen3", "qk_norm": True, "kv_channels": 24, "bias": False, "tie_embeddings": True,
              "moe": "absent"},
    "mixtral": {"hf_model_type": "mixtral", "qk_norm": "absent", "kv_channels": 8, "ffn_hidden": 32,
                "moe": {"num_experts": 4, "top_k": 2, "score": "softmax", "aux_loss_coeff": 0.02, "ffn_hidden": 32,
                        "norm_topk": True}},
    "qwen2_moe": {"hf_model_type": "qwen2_moe", "qkv_bias": True, "ffn_hidden": 96, "moe": {
        "num_experts": 4, "top_k": 2, "score": "softmax", "aux_loss_coeff": 0.001, "ffn_hidden": 32,
        "norm_topk": False, "shared_experts": 1, "shared_ffn_hidden": 48, "shared_gate": True, "layer_freq": 1,
        "first_dense": 0}},
    "qwen2_moe_step2": {"hf_model_type": "qwen2_moe", "moe": {
        "num_experts": 4, "top_k": 2, "score": "softmax", "aux_loss_coeff": 0.001, "ffn_hidden": 32,
        "norm_topk": True, "shared_experts": 1, "shared_ffn_hidden": 32, "shared_gate": True, "layer_freq": 2,
        "first_dense": 1}},
    "qwen3_moe_dense_first": {"hf_model_type": "qwen3_moe", "qk_norm": True, "qkv_bias": "absent", "moe": {
        "num_experts": 8, "top_k": 3, "score": "softmax", "aux_loss_coeff": 0.001, "ffn_hidden": 22,
        "norm_topk": True, "layer_freq": 1, "first_dense": 1}},
}


def make_model(case: str, path: Path, **overrides):
    """A random tiny model of the case saved with save_pretrained: every weight drawn here (std 0.1, routers'
    included), norms (QK-norms too) in [0.5, 1.5] and biases at std 0.2, so that every tensor's place shows in the
    logits; the bundled sentencepiece tokenizer beside it."""
    model_class, config_class, settings = FAMILIES[case]
    config = config_class(**{**COMMON, **settings, **overrides})
    config._experts_implementation = EXPERTS  # (ignored by the dense Qwen3)
    model = model_class(config).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (0.2 if name.endswith("bias") else 0.1))
    model.save_pretrained(str(path))
    shutil.copyfile(ROOT / "data" / "sample" / "tokenizer.model", path / "tokenizer.model")
    return model


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return (a - b).abs().max().item()


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def imported(request, tmp_path_factory):
    """(case, transformers model, directory): the model saved under hf/ and imported as ckpt/."""
    tmp = tmp_path_factory.mktemp(request.param)
    model = make_model(request.param, tmp / "hf")
    assert import_model(tmp / "hf", tmp / "ckpt") == 0
    return request.param, model, tmp


def _settings(model_yaml: Path) -> dict:
    from omegaconf import OmegaConf
    return OmegaConf.to_container(OmegaConf.load(model_yaml))["model"]


def test_import_sets_the_family_and_gives_transformers_logits(imported):
    case, model, tmp = imported
    settings = _settings(tmp / "ckpt" / "model.yaml")
    assert {k: settings.get(k, "absent") for k in EXPECTED[case]} == EXPECTED[case]
    meta = json.loads((tmp / "ckpt" / "meta.json").read_text())
    assert meta["model"]["qk_norm"] == case.startswith("qwen3")
    tokens = random_tokens(VOCAB, seq=48)
    with torch.no_grad():
        want = model(tokens).logits
    got = our_logits(tmp / "ckpt", tokens, tmp / "ckpt" / "model.yaml")
    assert max_diff(got, want) <= TOLERANCE


def test_export_loads_in_transformers_and_the_round_trip_is_bit_for_bit(imported):
    from safetensors.torch import load_file

    case, model, tmp = imported
    out = tmp / "export"
    assert export("--checkpoint", tmp / "ckpt", "--output", out, "--no-tokenizer", "--force") == 0
    original, exported = load_file(str(tmp / "hf" / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert sorted(exported) == sorted(original)
    assert all(torch.equal(exported[k], original[k]) for k in original), [k for k in original
                                                                          if not torch.equal(exported[k], original[k])]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32,
                                                               **({"experts_implementation": EXPERTS}
                                                                  if case != "qwen3" else {})).eval()
    assert type(loaded) is FAMILIES[case][0]
    tokens = random_tokens(VOCAB, seq=48, seed=1)
    with torch.no_grad():
        assert max_diff(loaded(tokens).logits, model(tokens).logits) <= TOLERANCE
    # and its config.json imports to the same settings (the MoE layer set through decoder_sparse_step / mlp_only)
    assert import_model(out, tmp / "again") == 0
    again, first = _settings(tmp / "again" / "model.yaml"), _settings(tmp / "ckpt" / "model.yaml")
    assert again == first


def test_a_qwen2_moe_import_trains_at_pp2_and_samples_as_transformers(tmp_path, capsys):
    """checkpoint.init_from through train.py at pp2 (an MoE layer on each stage): the first loss is transformers';
    then scripts/generate.py (which runs the model's own forward) continues a prompt as transformers' greedy
    search does."""
    from data.tokenizer import load_tokenizer
    import generate

    model = make_model("qwen2_moe_step2", tmp_path / "hf")
    ckpt = tmp_path / "ckpt"
    assert import_model(tmp_path / "hf", ckpt) == 0
    train_from_import(model, ckpt, tmp_path / "run", 2, ["parallel.pp=2"])

    prompt, new_tokens = "The function returns", 8
    capsys.readouterr()
    assert generate.cli(["--checkpoint", str(ckpt), "--prompt", prompt, "--max-new-tokens", str(new_tokens),
                         "--temperature", "0", "--device", "cpu"]) == 0
    printed = capsys.readouterr().out.rstrip("\n")
    tok = load_tokenizer(str(ROOT / "data" / "sample" / "tokenizer.model"))
    ids = tok.encode(prompt)
    with torch.no_grad():
        generated = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                   do_sample=False, max_new_tokens=new_tokens, eos_token_id=tok.eod_id)
    new = generated[0, len(ids):].tolist()
    new = new[:new.index(tok.eod_id)] if tok.eod_id in new else new
    assert new, "transformers generated nothing to compare with"
    assert printed == prompt + tok.decode(ids + new)[len(tok.decode(ids)):]


SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
REFUSED = {  # config class, its settings beyond SMALL, what the one line must name
    "qwen2_moe_mlp_only_layers": ("Qwen2MoeConfig", dict(num_experts=4, mlp_only_layers=[1]),
                                  "decoder_sparse_step=1 with mlp_only_layers=[1] makes layers [0, 2, 3] MoE of 4"),
    "qwen3_moe_no_moe_layer": ("Qwen3MoeConfig", dict(num_experts=4, decoder_sparse_step=8),
                               "decoder_sparse_step=8 with mlp_only_layers=[] makes layers [] MoE of 4"),
    "mixtral_window": ("MixtralConfig", dict(sliding_window=32), "sliding_window=32 (sliding-window attention"),
    "qwen3_window": ("Qwen3Config", dict(use_sliding_window=True, sliding_window=16, max_window_layers=2),
                     "use_sliding_window=true, sliding_window=16 (sliding-window attention"),
    "qwen3_moe_too_many_chosen": ("Qwen3MoeConfig", dict(num_experts=4, num_experts_per_tok=6),
                                  "num_experts_per_tok=6 exceeds the 4 experts"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_what_these_families_have_and_we_cannot_compute_is_refused_in_one_line(tmp_path, capsys, case):
    name, settings, expected = REFUSED[case]
    getattr(transformers, name)(**{**SMALL, **settings}).save_pretrained(str(tmp_path / "hf"))
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"")  # never read: the config is refused first
    capsys.readouterr()
    assert import_model(tmp_path / "hf", tmp_path / "ckpt") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: cannot import this model: ") and expected in err, err
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("family,overrides,expected", [
    ("mixtral", ["model.moe.score=sigmoid"], "model.moe.score=sigmoid (Mixtral's router is a softmax)"),
    ("mixtral", ["model.moe.layer_freq=2"], "model.moe.layer_freq=2, first_dense=0 (every Mixtral layer is MoE"),
    ("qwen2_moe", [], "model.moe.shared_experts=0, shared_gate=false (Qwen2-MoE has a shared expert"),
    ("qwen3_moe", ["model.moe.shared_experts=1"], "model.qk_norm=false (Qwen3Moe RMS-normalises each head"),
    ("qwen3", ["model.qk_norm=true"], "model.moe.num_experts=4 (Qwen3 has no experts; export as mixtral"),
    ("llama", ["model.qk_norm=true", "model.moe.num_experts=0"], "model.qk_norm=true (Llama has no QK-norm"),
], ids=["sigmoid_router", "mixtral_every_layer", "qwen2_moe_shared", "qwen3_moe_qk_norm", "qwen3_experts",
        "llama_qk_norm"])
def test_what_a_family_cannot_express_is_refused_on_export(family, overrides, expected):
    from config import load_config
    from dataclasses import asdict
    from model.hf import export_problems

    settings = asdict(load_config(None, ["model.moe.num_experts=4", *overrides]).model)
    assert any(expected in p for p in export_problems(settings, family)), export_problems(settings, family)


def test_an_expert_bias_moved_by_training_is_refused_on_export(tmp_path, capsys):
    """Aux-loss-free balancing moves the routers' selection bias, which no family here has: the export would route
    tokens to other experts, so it stops naming the tensor."""
    from tests.test_hf_export import train

    step_dir = train(tmp_path / "ckpt", 1, ["model.moe.num_experts=4", "model.moe.bias_update_rate=0.01"], steps=1)
    capsys.readouterr()
    assert export("--checkpoint", step_dir, "--output", tmp_path / "out", "--no-tokenizer") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "model.layers.0.mlp.router.expert_bias is not zero" in err, err
    assert not (tmp_path / "out").exists()

