"""Llama 3.2, Qwen2.5 and Mistral style checkpoints in and out: each family's model, built and saved locally by
transformers, imports to transformers' logits (fp32), trains a step at tp2 x pp2 from those weights (its first
loss is transformers' loss on the same batch), and exports to a directory that transformers loads as the same
family with our logits and our greedy text. The reference is always transformers' own model class."""
import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from tests.as_python import forked_python
from tests.test_hf_export import ROOT, assert_close, export, our_logits, random_tokens
from tests.test_hf_import import VOCAB, import_model, train_from_import

import transformers  # noqa: E402  (a test dependency: requirements-dev.txt)

PROMPT = "The function returns"
# Small but with each family's distinguishing settings: grouped-query attention everywhere (KV heads split over
# tp2), Llama 3.2's tied embeddings and llama3 RoPE (an original context short enough that the test's positions
# see the scaled frequencies), Qwen2's q/k/v biases and large theta, Mistral's head_dim unlike hidden / heads.
COMMON = dict(vocab_size=VOCAB, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
              initializer_range=0.1)
FAMILIES = {
    "llama3": (transformers.LlamaForCausalLM, transformers.LlamaConfig, dict(
        hidden_size=128, head_dim=64, tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
    "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config, dict(
        hidden_size=64, tie_word_embeddings=True, use_sliding_window=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "mistral": (transformers.MistralForCausalLM, transformers.MistralConfig, dict(
        hidden_size=64, head_dim=24, tie_word_embeddings=False, sliding_window=None,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
}
EXPECTED = {  # what the import must set (beyond sizes), per family
    "llama3": {"rope_scaling": "llama3", "rope_scaling_factor": 32.0, "rope_low_freq_factor": 1.0,
               "rope_high_freq_factor": 4.0, "rope_original_max_positions": 16, "tie_embeddings": True,
               "kv_channels": 64, "rope_theta": 500000.0},
    "qwen2": {"qkv_bias": True, "bias": False, "tie_embeddings": True, "rope_theta": 1e6},
    "mistral": {"hf_model_type": "mistral", "kv_channels": 24, "bias": False, "tie_embeddings": False},
}


CORPUS = ROOT / "data" / "sample" / "corpus.jsonl.gz"
# Qwen2's pre-tokenizer split (letters with one leading non-letter, single digits, punctuation runs, newlines,
# spaces), which transformers' Qwen2Tokenizer rebuilds in code around any Qwen2 vocabulary.
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")


def make_tokenizer(family: str, directory: Path) -> None:
    """The tokenizer each family ships, small, trained with the tokenizers library on the bundled corpus: Llama 3's
    byte-level BPE whose post-processor puts <|begin_of_text|> first; Qwen2's byte-level BPE (NFC, its split, no bos,
    <|endoftext|>); Mistral's sentencepiece model (the bundled one)."""
    import gzip

    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    directory.mkdir(parents=True, exist_ok=True)
    if family == "mistral":
        shutil.copyfile(ROOT / "data" / "sample" / "tokenizer.model", directory / "tokenizer.model")
        return
    tok = Tokenizer(models.BPE())
    tok.decoder = decoders.ByteLevel()
    if family == "qwen2":
        specials, bos, eos, cls = ["<|endoftext|>"], None, "<|endoftext|>", "Qwen2Tokenizer"
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        specials, bos, eos, cls = ["<|begin_of_text|>", "<|end_of_text|>"], "<|begin_of_text|>", "<|end_of_text|>", \
            "PreTrainedTokenizerFast"
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    with gzip.open(CORPUS, "rt") as f:
        tok.train_from_iterator((json.loads(line)["text"] for line in f), trainer)
    if bos is not None:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, tok.token_to_id(bos))])
    tok.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": cls, "bos_token": bos, "eos_token": eos, "model_max_length": 64,
              "clean_up_tokenization_spaces": False}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def make_model(family: str, path: Path, **overrides):
    """A random tiny model of the family saved with save_pretrained (std 0.1, norms and biases randomised so that
    every tensor's place shows in the logits), with the family's kind of tokenizer."""
    model_class, config_class, settings = FAMILIES[family]
    torch.manual_seed(0)
    model = model_class(config_class(**{**COMMON, **settings, **overrides})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0, 0.2)
    model.save_pretrained(str(path))
    make_tokenizer(family, path)
    return model


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def imported(request, tmp_path_factory):
    """(family, transformers model, directory): the model saved under hf/, imported as ckpt/, and the bundled
    corpus tokenized with the model's own tokenizer (as copied next to the checkpoint) as data_text_document."""
    from data.preprocess import preprocess

    tmp = tmp_path_factory.mktemp(request.param)
    model = make_model(request.param, tmp / "hf")
    assert import_model(tmp / "hf", tmp / "ckpt") == 0
    tokenizer = "tokenizer.model" if request.param == "mistral" else "tokenizer.json"
    assert (tmp / "ckpt" / tokenizer).is_file()
    preprocess([str(CORPUS)], str(tmp / "data_text_document"), str(tmp / "ckpt" / tokenizer))
    return request.param, model, tmp


def test_import_sets_the_family_settings_and_gives_transformers_logits(imported):
    family, model, tmp = imported
    from omegaconf import OmegaConf
    settings = OmegaConf.to_container(OmegaConf.load(tmp / "ckpt" / "model.yaml"))["model"]
    assert {k: settings.get(k, "absent") for k in EXPECTED[family]} == EXPECTED[family]
    tokens = random_tokens(VOCAB, seq=48)
    with torch.no_grad():
        want = model(tokens).logits
    assert_close(our_logits(tmp / "ckpt", tokens, tmp / "ckpt" / "model.yaml"), want)


def test_llama3_rope_scaling_is_what_the_logits_depend_on(tmp_path):
    """The llama3 frequencies matter at the test's positions: plain RoPE (same weights) is far off, so the
    import test above would catch scaling computed wrongly or dropped."""
    model = make_model("llama3", tmp_path / "hf")
    plain = make_model("llama3", tmp_path / "plain", rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    tokens = random_tokens(VOCAB, seq=48)
    with torch.no_grad():
        a, b = model(tokens).logits, plain(tokens).logits
    assert ((a - b).abs().max() / a.abs().max()).item() > 1e-2


def test_train_at_tp2_pp2_then_export_loads_in_transformers_with_our_logits_and_text(imported):
    family, model, tmp = imported
    run_dir = tmp / "run"
    data = f"data.paths=[{tmp / 'data_text_document'}]"
    train_from_import(model, tmp / "ckpt", run_dir, 4, ["parallel.tp=2", "parallel.pp=2", data], data=[data])
    step_dir = run_dir / "checkpoints" / "step_00000001"
    out = tmp / "export"
    assert export("--checkpoint", step_dir, "--output", out) == 0
    config = json.loads((out / "config.json").read_text())
    model_class = FAMILIES[family][0]
    assert config["architectures"] == [model_class.__name__]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert type(loaded) is model_class
    tokens = random_tokens(VOCAB, seq=48, seed=1)
    with torch.no_grad():
        theirs = loaded(tokens).logits
    assert_close(our_logits(step_dir, tokens), theirs)
    with torch.no_grad():
        before = model(tokens).logits
    assert (theirs - before).abs().max() > 1e-6, "the export must hold the trained weights, not the imported ones"

    proc = forked_python(str(ROOT / "scripts" / "generate.py"), "--checkpoint", str(step_dir), "--prompt", PROMPT,
                         "--max-new-tokens", "10", "--temperature", "0", "--device", "cpu", timeout=120)
    assert proc.returncode == 0, proc.stderr
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    # generate.py encodes as training data was: a tokenizer.json's own post-processor applies (Llama 3's bos)
    ids = tok(PROMPT, return_tensors="pt", add_special_tokens=family != "mistral").input_ids
    assert (ids[0, 0] == tok.bos_token_id) == (family == "llama3")
    generated = loaded.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=10)
    assert generated.shape[1] > ids.shape[1]
    assert proc.stdout.rstrip("\n") == tok.decode(generated[0], skip_special_tokens=True)


@pytest.mark.parametrize("family,overrides,expected", [
    ("qwen2", ["model.bias=true"], "model.bias=true (Qwen2 has biases on q/k/v only"),
    ("mistral", ["model.qkv_bias=true"], "model.qkv_bias=true (Mistral has no biases)"),
    ("llama", ["model.qkv_bias=true"], "model.qkv_bias=true without model.bias"),
], ids=["qwen2_all_biases", "mistral_bias", "llama_qkv_bias"])
def test_what_a_family_cannot_express_is_refused_on_export(tmp_path, capsys, family, overrides, expected):
    from tests.test_hf_export import train
    step_dir = train(tmp_path / "ckpt", 1, overrides, steps=1)
    capsys.readouterr()
    assert export("--checkpoint", step_dir, "--output", tmp_path / "out", "--model-type", family) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expected in err, err
    assert not (tmp_path / "out").exists()


def test_rope_scaling_is_validated_and_recorded_in_checkpoints(tmp_path):
    from config import ConfigError, load_config, validate_config
    from training.checkpoint import model_record

    def invalid(*overrides):
        with pytest.raises(ConfigError) as e:
            validate_config(load_config(None, list(overrides)))
        return str(e.value)

    assert "model.rope_low_freq_factor=4.0 and model.rope_high_freq_factor=1.0 must satisfy 0 < low < high" in \
        invalid("model.rope_scaling=llama3", "model.rope_low_freq_factor=4", "model.rope_high_freq_factor=1")
    assert "model.rope_scaling='yarn' is not one of" in invalid("model.rope_scaling=yarn")
    assert "model.rope_scaling_factor=0.5 must be" in invalid("model.rope_scaling=linear",
                                                               "model.rope_scaling_factor=0.5")
    assert "model.kv_channels=33 must be even" in invalid("model.kv_channels=33")
    cfg = load_config(None, ["model.rope_scaling=llama3", "model.rope_scaling_factor=8"])
    assert model_record(cfg.model)["rope_scaling_factor"] == 8.0
    assert "rope_scaling_factor" not in model_record(load_config(None, []).model)


def test_our_rope_frequencies_equal_transformers(tmp_path):
    """model.layers.rope_frequencies against transformers' own rope initialisers, for each supported type."""
    from config import ModelConfig
    from model.layers import rope_frequencies
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cases = {"linear": {"factor": 4.0}, "llama3": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                    "original_max_position_embeddings": 64}}
    for kind, params in cases.items():
        hf = transformers.LlamaConfig(hidden_size=256, num_attention_heads=2, max_position_embeddings=4096,
                                      rope_parameters={"rope_type": kind, "rope_theta": 500000.0, **params})
        want, factor = ROPE_INIT_FUNCTIONS[kind](hf, "cpu")
        assert factor == 1.0
        ours = rope_frequencies(ModelConfig(d_model=256, n_heads=2, rope_theta=500000.0, rope_scaling=kind,
                                            rope_scaling_factor=params["factor"],
                                            rope_low_freq_factor=params.get("low_freq_factor", 1.0),
                                            rope_high_freq_factor=params.get("high_freq_factor", 4.0),
                                            rope_original_max_positions=params.get(
                                                "original_max_position_embeddings", 8192)))
        torch.testing.assert_close(ours.float(), want.float(), rtol=1e-6, atol=0)
        assert not math.isclose(ours[-1].item(), ours[0].item())


@pytest.mark.parametrize("overrides", [
    ["model.kv_channels=24"], ["model.kv_channels=48", "model.n_kv_heads=2", "model.qkv_bias=true"],
    ["model.qkv_bias=true", "model.tie_embeddings=true"], ["model.kv_channels=16", "model.bias=true"],
], ids=["head_dim_24", "head_dim_48_gqa_qkv_bias", "qkv_bias_tied", "head_dim_16_bias"])
def test_parameter_count_and_flops_follow_head_dim_and_qkv_bias(overrides):
    """model.flops's analytic count (which MFU and the ZeRO byte counts use) equals the built model's."""
    from tests.test_gqa import _single_process_model, tiny_config
    from model.flops import parameter_count

    cfg = tiny_config(*overrides)
    params = dict(_single_process_model(cfg).named_parameters())
    assert sum(p.numel() for p in params.values()) == parameter_count(cfg.model)["total"]
    q = cfg.model.n_heads * cfg.model.kv_channels if cfg.model.kv_channels else cfg.model.d_model
    assert params["layers.0.attn.proj.weight"].shape == (cfg.model.d_model, q)
    assert ("layers.0.attn.proj.bias" in params) == cfg.model.bias
    assert any(k.startswith("layers.0.attn.q") and k.endswith(".bias") for k in params) == cfg.model.attn_bias


SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
REFUSED = {  # config class, its settings beyond SMALL, what the one line must name, what it must not
    "llama_yarn": ("LlamaConfig", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                                        "original_max_position_embeddings": 16}),
                   'rope_type="yarn"', None),
    "llama_dynamic": ("LlamaConfig", dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 4.0}),
                      'rope_type="dynamic"', None),
    "mistral_default_window": ("MistralConfig", {}, "sliding_window=4096 (sliding-window attention", None),
    "qwen2_window": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=32),
                     "use_sliding_window=true, sliding_window=32 (sliding-window attention", None),
    "qwen3": ("Qwen3Config", dict(attention_bias=True), "attention_bias=true (biases on q, k, v and o_proj", "sliding"),
    "mixtral": ("MixtralConfig", dict(router_jitter_noise=0.1), "router_jitter_noise=0.1 (routing with", "sliding"),
    "qwen2_moe": ("Qwen2MoeConfig", dict(mlp_only_layers=[0, 1]), "mlp_only_layers=[0, 1] makes layers [] MoE",
                  "sliding"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_what_cannot_be_imported_is_refused_in_one_line_naming_the_setting(tmp_path, capsys, case):
    """config.json exactly as transformers writes it for each model people would try: one line, exit code 2, naming
    the setting (and no reason that does not hold, e.g. Qwen2-MoE's sliding_window=0 with use_sliding_window off)."""
    from tests.test_hf_import import import_model

    name, settings, expected, absent = REFUSED[case]
    getattr(transformers, name)(**{**SMALL, **settings}).save_pretrained(str(tmp_path / "hf"))
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"")  # never read: the config is refused first
    capsys.readouterr()
    assert import_model(tmp_path / "hf", tmp_path / "ckpt") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: cannot import this model: ") and expected in err, err
    assert absent is None or absent not in err, err
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("family,overrides", [
    ("qwen2", dict(tie_word_embeddings=False)),
    ("mistral", dict(tie_word_embeddings=True)),
    ("llama3", dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0})),
], ids=["qwen2_untied", "mistral_tied", "llama_linear_rope"])
def test_other_variants_round_trip_to_transformers_logits(tmp_path, family, overrides):
    """Untied Qwen2 (Qwen2.5-7B and up), tied Mistral and linear RoPE: import gives transformers' logits and the
    export (of the import itself) loads as the same class with them."""
    model = make_model(family, tmp_path / "hf", **overrides)
    assert import_model(tmp_path / "hf", tmp_path / "ckpt") == 0
    tokens = random_tokens(VOCAB, seq=48)
    with torch.no_grad():
        want = model(tokens).logits
    assert_close(our_logits(tmp_path / "ckpt", tokens, tmp_path / "ckpt" / "model.yaml"), want)
    assert export("--checkpoint", tmp_path / "ckpt", "--output", tmp_path / "out") == 0
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32).eval()
    assert type(loaded) is FAMILIES[family][0]
    with torch.no_grad():
        assert_close(loaded(tokens).logits, want)
