"""scripts/export_hf.py: checkpoints of any layout become Llama directories that transformers loads and that
give our model's logits and greedy text. The reference is transformers' own LlamaForCausalLM (fp32)."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from tests.as_python import forked_python
from tests.dist_harness import run_world
from tests.parallel_utils import checkpoint_worker

import transformers  # noqa: E402  (a test dependency: requirements-dev.txt)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import export_hf  # noqa: E402

RTOL = 1e-5
TOKENIZER_VOCAB = 4096  # the bundled tokenizer's: generation needs real tokens
PROMPT = "The function returns"


def our_logits(step_dir: Path, tokens: torch.Tensor, config_file: Path = None, overrides=()) -> torch.Tensor:
    """Logits [b, s, V] of our single-process fp32 model holding a checkpoint's weights (the code under test).

    The config is the checkpoint's own (meta.json), or ``config_file`` (e.g. an import's model.yaml)."""
    from config import load_config
    from parallel.launch import LaunchEnv, init_distributed
    from parallel.layout import make_layout
    from parallel.mesh import Mesh
    from training.checkpoint import Checkpointer
    from training.engine import Engine

    if config_file is None:
        config_file = step_dir.parent / f"{step_dir.name}.yaml"
        OmegaConf.save(OmegaConf.load(step_dir / "meta.json").config, config_file)
    cfg = load_config(str(config_file), ["parallel.tp=1", "parallel.pp=1", "parallel.sequence_parallel=false",
                                         "zero.stage=0", "precision=fp32", "device=cpu", "train.micro_batch_size=1",
                                         "train.global_batch_size=1", "logging.wandb.mode=disabled", *overrides])
    owned = not dist.is_initialized()
    init_distributed(LaunchEnv(0, 1, 0, 1, "127.0.0.1", 0, "single"), torch.device("cpu"), 60)
    try:
        engine = Engine(cfg, Mesh(make_layout(cfg, 1, 1), torch.device("cpu")))
        Checkpointer(cfg, str(step_dir.parent), engine).load_weights(step_dir)
        with torch.no_grad():
            return engine.chunks[0].eval().logits(tokens)
    finally:
        if owned:
            dist.destroy_process_group()


def hf_logits(model_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    model = transformers.LlamaForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits


def assert_close(got: torch.Tensor, want: torch.Tensor, rtol: float = RTOL) -> None:
    """Equal within rtol relative to the largest logit (fp32 sums in another order)."""
    assert got.shape == want.shape
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err <= rtol, f"logits differ by {err:.2e} relative to the largest"


def random_tokens(vocab: int, seq: int = 32, batch: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def export(*args: str) -> int:
    return export_hf.main([str(a) for a in args])


def train(tmp: Path, world: int, overrides, steps: int = 2) -> Path:
    """A checkpoint of the tiny model (the bundled tokenizer's vocabulary) trained ``steps`` steps on synthetic
    data in a layout; its step directory."""
    overrides = [f"model.vocab_size={TOKENIZER_VOCAB}", *overrides]
    run_world(checkpoint_worker, world, overrides, "fresh", steps, str(tmp))
    return tmp / f"step_{steps:08d}"


@pytest.fixture(scope="module")
def tp2_pp2(tmp_path_factory) -> Path:
    """A model trained at tp2 x pp2 (sequence parallel) over the bundled tokenizer's vocabulary."""
    return train(tmp_path_factory.mktemp("tp2pp2"), 4, ["parallel.tp=2", "parallel.pp=2",
                                                        "parallel.sequence_parallel=true"])


@pytest.fixture(scope="module")
def exported(tp2_pp2, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hf") / "llama"
    assert export("--checkpoint", tp2_pp2.parent, "--output", out) == 0  # a checkpoint root: its newest
    return out


def test_tp2_pp2_checkpoint_exports_and_transformers_gives_the_same_logits(tp2_pp2, exported):
    files = sorted(p.name for p in exported.iterdir())
    assert files == ["config.json", "generation_config.json", "model.safetensors", "special_tokens_map.json",
                     "tokenizer.json", "tokenizer.model", "tokenizer_config.json"]
    config = transformers.AutoConfig.from_pretrained(str(exported))
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
            config.intermediate_size, config.vocab_size) == (4, 64, 4, 4, 128, TOKENIZER_VOCAB)
    assert config.rms_norm_eps == 1e-5 and config.rope_parameters["rope_theta"] == 10000.0
    assert config.max_position_embeddings == 32 and not config.tie_word_embeddings
    assert not config.attention_bias and not config.mlp_bias and config.hidden_act == "silu"
    tokens = random_tokens(TOKENIZER_VOCAB)
    assert_close(our_logits(tp2_pp2, tokens), hf_logits(exported, tokens))


def test_large_models_are_sharded_with_an_index(tp2_pp2, exported, tmp_path):
    out = tmp_path / "sharded"
    assert export("--checkpoint", tp2_pp2, "--output", out, "--max-shard-size", "400KB") == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3 and not (out / "model.safetensors").exists()
    for s in shards:  # within the limit (plus the file's header), unless one tensor alone is larger
        names = [k for k, v in index["weight_map"].items() if v == s]
        assert (out / s).stat().st_size - _safetensors_header(out / s) <= 400_000 or len(names) == 1, s
        # readable as the config is (safetensors itself creates its files 0600, unreadable on a shared cluster)
        assert (out / s).stat().st_mode & 0o777 == (out / "config.json").stat().st_mode & 0o777, s
    assert index["metadata"]["total_size"] == (exported / "model.safetensors").stat().st_size - \
        _safetensors_header(exported / "model.safetensors")
    tokens = random_tokens(TOKENIZER_VOCAB, seed=1)
    assert_close(our_logits(tp2_pp2, tokens), hf_logits(out, tokens))


def _safetensors_header(path: Path) -> int:
    with open(path, "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


def test_greedy_text_of_generate_py_and_of_transformers_generate_agree(tp2_pp2, exported):
    proc = forked_python(str(ROOT / "scripts" / "generate.py"), "--checkpoint", str(tp2_pp2), "--prompt", PROMPT,
                         "--max-new-tokens", "12", "--temperature", "0", "--device", "cpu", timeout=120)
    assert proc.returncode == 0, proc.stderr
    tok = transformers.AutoTokenizer.from_pretrained(str(exported))
    model = transformers.LlamaForCausalLM.from_pretrained(str(exported), dtype=torch.float32).eval()
    ids = tok(PROMPT, return_tensors="pt").input_ids
    assert ids[0, 0] != tok.bos_token_id  # trained without a leading bos, as generate.py encodes
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12)
    text = tok.decode(out[0], skip_special_tokens=True)
    assert out.shape[1] > ids.shape[1], "an empty continuation would make the comparison vacuous"
    assert proc.stdout.rstrip("\n") == text


def test_exported_tokenizer_encodes_and_decodes_as_sentencepiece_does(exported):
    """transformers' tokenizer of the export gives our sentencepiece ids for corpus text, text that starts with
    spaces, whitespace runs and characters outside the vocabulary (byte fallback), and decodes them back alike."""
    import gzip

    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(ROOT / "data" / "sample" / "tokenizer.model"))
    tok = transformers.AutoTokenizer.from_pretrained(str(exported))
    with gzip.open(ROOT / "data" / "sample" / "corpus.jsonl.gz", "rt") as f:
        corpus = [json.loads(line)["text"][:300] for _, line in zip(range(100), f)]
    texts = corpus + [" " + t for t in corpus[:20]] + [
        " leading", "  two leading", " ", "", "trailing ", "a  b\t\tc\n\nd", "Tiếng Việt, 中文, emoji 🙂"]
    for text in texts:
        ids = sp.encode(text)
        assert tok(text, add_special_tokens=False)["input_ids"] == ids, repr(text)
        assert tok.decode(ids) == sp.decode(ids), repr(text)


@pytest.mark.parametrize("world,overrides", [
    (2, ["zero.stage=3", "model.tie_embeddings=true", "model.bias=true", "model.norm_eps=1e-6",
         "model.rope_theta=500000", "model.max_seq_len=64"]),
    (2, ["precision=fp8", "parallel.tp=2", "parallel.sequence_parallel=true", "zero.stage=1",
         "zero.partition=whole_tensor"]),
], ids=["zero3_dp2_tied_bias_eps_theta", "fp8_tp2_sp_zero1"])
def test_other_layouts_and_settings_export(tmp_path, world, overrides):
    step_dir = train(tmp_path / "ckpt", world, overrides, steps=1)
    out = tmp_path / "hf"
    assert export("--checkpoint", step_dir, "--output", out) == 0
    config = json.loads((out / "config.json").read_text())
    tied = "model.tie_embeddings=true" in overrides
    assert config["tie_word_embeddings"] is tied and config["attention_bias"] is ("model.bias=true" in overrides)
    from safetensors import safe_open
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert ("lm_head.weight" in f.keys()) is not tied
    tokens = random_tokens(TOKENIZER_VOCAB, seed=2)
    assert_close(our_logits(step_dir, tokens), hf_logits(out, tokens))


def test_grouped_query_attention_model_exports(tmp_path):
    """Trained at tp4 with 2 KV heads, so each KV head is replicated on 2 TP ranks and saved once."""
    step_dir = train(tmp_path / "ckpt", 4, ["parallel.tp=4", "model.n_heads=8", "model.n_kv_heads=2"], steps=1)
    out = tmp_path / "hf"
    assert export("--checkpoint", step_dir, "--output", out) == 0
    config = transformers.AutoConfig.from_pretrained(str(out))
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (8, 2, 8)
    tokens = random_tokens(TOKENIZER_VOCAB, seed=3)
    assert_close(our_logits(step_dir, tokens), hf_logits(out, tokens))


def test_what_llama_cannot_express_is_refused_by_name(tmp_path, capsys):
    step_dir = train(tmp_path / "ckpt", 1, ["model.activation=gelu", "model.norm=layernorm"], steps=0)
    assert export("--checkpoint", step_dir, "--output", tmp_path / "hf") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: cannot export")
    assert "model.activation=gelu" in err and "model.norm=layernorm" in err
    assert not (tmp_path / "hf").exists()


def test_bad_inputs_are_one_line_errors(tp2_pp2, exported, tmp_path, capsys):
    def error(*args) -> str:
        assert export(*args) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("error: "), err
        return err

    assert "does not exist" in error("--checkpoint", tmp_path / "nowhere", "--output", tmp_path / "o1")
    (tmp_path / "empty").mkdir()
    assert "no checkpoint in" in error("--checkpoint", tmp_path / "empty", "--output", tmp_path / "o2")
    before = (exported / "model.safetensors").read_bytes()
    assert "not empty (pass --force" in error("--checkpoint", tp2_pp2, "--output", exported)
    assert (exported / "model.safetensors").read_bytes() == before
    assert "--max-shard-size" in error("--checkpoint", tp2_pp2, "--output", tmp_path / "o3", "--max-shard-size", "big")
    broken = tmp_path / "broken" / tp2_pp2.name
    shutil.copytree(tp2_pp2, broken)
    victim = sorted(broken.glob("*.distcp"))[0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    err = error("--checkpoint", broken, "--output", tmp_path / "o4")
    assert victim.name in err and "corrupted" in err
    assert not (tmp_path / "o4").exists()
    (tmp_path / "random.bin").write_bytes(os.urandom(4096))  # a file where a directory belongs, and vice versa
    assert "is not a directory" in error("--checkpoint", tmp_path / "random.bin", "--output", tmp_path / "o5")
    assert f"{tmp_path / 'random.bin'} is not a directory" in error("--checkpoint", tp2_pp2, "--output",
                                                                    tmp_path / "random.bin" / "hf")
    assert "not a valid SentencePiece model" in error("--checkpoint", tp2_pp2, "--output", tmp_path / "o6",
                                                      "--tokenizer", tmp_path / "random.bin")
    assert "holds no tokenizer.json" in error("--checkpoint", tp2_pp2, "--output", tmp_path / "o6",
                                              "--tokenizer", tmp_path / "empty")
    for name, meta, expected in (("not_json", b"{not json", "meta.json is not readable JSON"),
                                 ("binary", os.urandom(256), "meta.json is not readable JSON"),
                                 ("config_list", json.dumps({"config": [1]}).encode(), "no model config in it"),
                                 ("bad_type", None, "model.d_model: Value 'abc'")):
        bad = tmp_path / "meta" / name / tp2_pp2.name
        shutil.copytree(tp2_pp2, bad)
        if meta is None:
            doc = json.loads((bad / "meta.json").read_text())
            doc["config"]["model"]["d_model"] = "abc"
            meta = json.dumps(doc).encode()
        _rewrite(bad, "meta.json", meta)
        assert expected in error("--checkpoint", bad, "--output", tmp_path / "o7"), name
    assert not any((tmp_path / f"o{k}").exists() for k in range(1, 8))


def test_command_line(tp2_pp2, tmp_path):
    """As a script, from another directory: exit code 2 and one line on stderr, no traceback."""
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "export_hf.py"), "--checkpoint",
                           str(tmp_path / "missing"), "--output", str(tmp_path / "out")], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip() == f"error: checkpoint {tmp_path / 'missing'} does not exist"


# ---- --force over a previous export: nothing of it is lost when the new export fails --------------------------

def _snapshot(directory: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def _rewrite(step_dir: Path, name: str, data: bytes) -> None:
    """Replace a checkpoint file and record it in the manifest, so that the checkpoint still verifies."""
    from training.checkpoint import file_digest

    (step_dir / name).write_bytes(data)
    manifest = json.loads((step_dir / "manifest.json").read_text())
    manifest["files"][name] = file_digest(step_dir / name)
    (step_dir / "manifest.json").write_text(json.dumps(manifest))


def test_a_failed_forced_export_leaves_the_previous_export_intact(tp2_pp2, tmp_path, capsys, monkeypatch):
    out = tmp_path / "hf"
    assert export("--checkpoint", tp2_pp2, "--output", out) == 0
    before = _snapshot(out)
    capsys.readouterr()

    def refused(*args) -> str:
        assert export(*args, "--output", out, "--force") == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("error: "), err
        assert _snapshot(out) == before, "the previous export changed"
        return err

    assert "tokenizer nowhere.model not found" in refused("--checkpoint", tp2_pp2, "--tokenizer", "nowhere.model")
    (tmp_path / "text.model").write_text("not a sentencepiece model")
    assert "not a valid SentencePiece model" in refused("--checkpoint", tp2_pp2, "--tokenizer",
                                                        tmp_path / "text.model")
    corrupted = tmp_path / "corrupted" / tp2_pp2.name
    shutil.copytree(tp2_pp2, corrupted)
    victim = sorted(corrupted.glob("*.distcp"))[0]
    victim.write_bytes(victim.read_bytes()[:-100])
    assert victim.name in refused("--checkpoint", corrupted)
    incomplete = tmp_path / "incomplete" / tp2_pp2.name  # verifies, but its meta.json promises 8 layers, not 4
    shutil.copytree(tp2_pp2, incomplete)
    meta = json.loads((incomplete / "meta.json").read_text())
    meta["config"]["model"]["n_layers"] = 8
    _rewrite(incomplete, "meta.json", json.dumps(meta).encode())
    assert "no tensor model.layers.4." in refused("--checkpoint", incomplete)

    def disk_full(model_file, staging, *args):  # after the weights are written
        assert (staging / "model.safetensors").is_file()
        raise OSError(28, "No space left on device", str(staging / "tokenizer.model"))

    monkeypatch.setattr(export_hf, "write_tokenizer", disk_full)
    assert "No space left on device" in refused("--checkpoint", tp2_pp2)
    monkeypatch.undo()
    tokens = random_tokens(TOKENIZER_VOCAB, seed=4)  # still loadable, and still the model it was
    assert_close(our_logits(tp2_pp2, tokens), hf_logits(out, tokens))
    assert transformers.AutoTokenizer.from_pretrained(str(out))(PROMPT).input_ids


def test_a_forced_export_holds_exactly_what_it_wrote(tp2_pp2, tmp_path):
    """--force over a sharded export without a tokenizer: no shard, no index of the previous one remains."""
    out = tmp_path / "hf"
    assert export("--checkpoint", tp2_pp2, "--output", out, "--max-shard-size", "400KB", "--no-tokenizer") == 0
    assert (out / "model.safetensors.index.json").is_file()
    assert export("--checkpoint", tp2_pp2, "--output", out, "--force") == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "special_tokens_map.json",
        "tokenizer.json", "tokenizer.model", "tokenizer_config.json"]  # no shard or index of the previous export
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"], "a temporary directory was left beside the export"
    tokens = random_tokens(TOKENIZER_VOCAB, seed=5)
    assert_close(our_logits(tp2_pp2, tokens), hf_logits(out, tokens))


def with_meta(step_dir: Path, dst: Path, **changes) -> Path:
    """A copy of a checkpoint whose meta.json's config sections are updated (``data={"tokenizer": ...}``), the
    manifest rewritten so that it verifies; ``meta={...}`` updates meta.json's top level."""
    shutil.copytree(step_dir, dst)
    meta = json.loads((dst / "meta.json").read_text())
    meta.update(changes.pop("meta", {}))
    for section, values in changes.items():
        meta["config"][section].update(values)
    _rewrite(dst, "meta.json", json.dumps(meta).encode())
    return dst


def test_a_forced_export_with_another_kind_of_tokenizer_leaves_none_of_the_previous_one(tp2_pp2, tmp_path, capsys):
    """A sentencepiece export, then --force with a model whose tokenizer is a Hugging Face tokenizer.json: nothing of
    the sentencepiece tokenizer stays, so AutoTokenizer loads the new tokenizer's special ids and import_hf.py takes
    its tokenizer.json."""
    out = tmp_path / "hf"
    assert export("--checkpoint", tp2_pp2, "--output", out) == 0
    assert (out / "tokenizer.model").is_file() and (out / "special_tokens_map.json").is_file()
    bpe = ROOT / "data" / "sample" / "bpe"
    other = with_meta(tp2_pp2, tmp_path / "bpe_ckpt" / tp2_pp2.name, data={"tokenizer": str(bpe)})
    assert export("--checkpoint", other, "--output", out, "--force") == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["config.json", "generation_config.json", "model.safetensors"] + [p.name for p in bpe.iterdir()])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bpe_ckpt", "hf"]
    from data.tokenizer import load_tokenizer

    ours = load_tokenizer(str(bpe))
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    assert (tok.eos_token_id, tok.bos_token_id) == (ours.eod_id, None)
    assert len(tok) == ours.vocab_size <= TOKENIZER_VOCAB  # no <s>/</s> added as ids beyond the model's rows
    assert tok(PROMPT)["input_ids"] == ours.encode(PROMPT)
    sys.path.insert(0, str(ROOT / "scripts"))
    import import_hf

    capsys.readouterr()
    assert import_hf.main(["--model", str(out), "--output", str(tmp_path / "imported")]) == 0
    assert (tmp_path / "imported" / "tokenizer.json").is_file()
    assert not (tmp_path / "imported" / "tokenizer.model").exists()
    model_yaml = (tmp_path / "imported" / "model.yaml").read_text()
    assert f"tokenizer: {tmp_path / 'imported' / 'tokenizer.json'}" in model_yaml


def test_force_refuses_what_is_not_a_previous_export(tp2_pp2, tmp_path, capsys, monkeypatch):
    """--force replaces the whole directory, so anything else in it, the checkpoint's own directories and the
    current directory are refused in one line, and nothing there changes."""
    out = tmp_path / "hf"
    assert export("--checkpoint", tp2_pp2, "--output", out, "--no-tokenizer") == 0
    (out / "NOTES.md").write_text("mine")
    before = _snapshot(out)
    capsys.readouterr()

    def refused(output, why: str) -> None:
        assert export("--checkpoint", tp2_pp2, "--output", output, "--force") == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith(f"error: --output {output} ") and why in err, err

    refused(out, "holds NOTES.md, which no export writes")
    assert _snapshot(out) == before
    run = tmp_path / "run"  # a run directory: its checkpoint inside
    shutil.copytree(tp2_pp2.parent, run / "checkpoints")
    for output in (run, run / "checkpoints", run / "checkpoints" / tp2_pp2.name):
        assert export("--checkpoint", run, "--output", output, "--force") == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "the checkpoint" in err, err
    assert _snapshot(run / "checkpoints" / tp2_pp2.name) == _snapshot(tp2_pp2)
    monkeypatch.chdir(out)
    refused(Path("."), "is the current directory")
    assert _snapshot(out) == before


def test_a_failed_swap_puts_the_previous_export_back(tp2_pp2, tmp_path, monkeypatch, capsys):
    out = tmp_path / "hf"
    assert export("--checkpoint", tp2_pp2, "--output", out, "--no-tokenizer", "--max-shard-size", "400KB") == 0
    before = _snapshot(out)
    real_rename = os.rename

    def rename(src, dst):  # the new export cannot be moved in (after the previous one was moved aside)
        if Path(dst) == out and ".export_hf-previous-" not in str(src):
            raise OSError(5, "Input/output error", str(src))
        return real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    capsys.readouterr()
    assert export("--checkpoint", tp2_pp2, "--output", out, "--force") == 2
    monkeypatch.undo()
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Input/output error" in err and f"{out} is unchanged" in err, err
    assert _snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"], "a temporary directory was left beside the export"



# ---- what a killed export leaves beside --output: removed by the next export only when provably its own --------

def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", ""])
    proc.wait()
    return proc.pid


def left_by(out: Path, tool: str, role: str = "staging", files=("model.safetensors",), **owner) -> Path:
    """A staging directory as a run of ``tool`` killed while writing ``out`` leaves it: its marker says ``owner``
    (pid, host), and it holds ``files``."""
    from scripts._hf_staging import MARKER, staging_dir

    d = staging_dir(out, tool, role)
    marker = json.loads((d / MARKER).read_text())
    (d / MARKER).write_text(json.dumps({**marker, **owner}))
    for name in files:
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_bytes(b"partial")
    return d


def test_the_next_export_removes_what_killed_exports_left_and_only_that(tp2_pp2, tmp_path, capsys):
    """Staging directories whose marker proves them an export's and whose process has ended are removed; one of a
    running process, one made on another host and an entry merely named like one are left, named in one line."""
    out = tmp_path / "hf"
    dead = left_by(out, "export_hf", pid=dead_pid())
    running = left_by(out, "export_hf")  # this process's
    remote = left_by(out, "export_hf", host="another-node")
    mine = tmp_path / ".hf.export_hf-notes"  # a user's, no marker
    (mine / "notes.txt").parent.mkdir()
    (mine / "notes.txt").write_text("mine")
    capsys.readouterr()
    assert export("--checkpoint", tp2_pp2, "--output", out, "--no-tokenizer") == 0
    err = capsys.readouterr().err.splitlines()
    assert not dead.exists() and running.is_dir() and remote.is_dir() and (mine / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["hf", running.name, remote.name, mine.name])
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    removed = [line for line in err if line.startswith("[export] beside")]
    assert len(removed) == 1 and f"removed {dead.name} (pid " in removed[0] and "has ended" in removed[0], err
    left = [line for line in err if line.startswith("[export] note: left beside")]
    assert len(left) == 1 and f"{running.name} (pid {os.getpid()} " in left[0] and "still running" in left[0], err
    assert f"{remote.name} (made on host another-node)" in left[0] and f"{mine.name} (it holds no " in left[0], err
    # --force replaces only a previous export: an entry inside it merely named like a staging directory is refused
    (out / ".export_hf-notes").mkdir()
    (out / ".export_hf-notes" / "notes.txt").write_text("mine")
    assert export("--checkpoint", tp2_pp2, "--output", out, "--force", "--no-tokenizer") == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == f"error: --output {out} holds .export_hf-notes, which no export writes: it is not a previous " \
                  "export, and --force replaces the whole directory (move that away, or give another --output)"
    assert (out / ".export_hf-notes" / "notes.txt").read_text() == "mine" and (out / "config.json").is_file()


def test_an_export_killed_mid_swap_leaves_the_previous_export_to_be_put_back(tp2_pp2, tmp_path, capsys):
    """Killed after the previous export was moved aside and before the new one was moved in: --output is missing;
    the next export puts the previous one back (so, without --force, it refuses to replace it) and removes the
    complete staging directory."""
    out = tmp_path / "hf"
    pid = dead_pid()
    aside = left_by(out, "export_hf", "previous", files=("hf/config.json", "hf/model.safetensors"), pid=pid)
    staged = left_by(out, "export_hf", files=("config.json", "model.safetensors"), pid=pid)
    capsys.readouterr()
    assert export("--checkpoint", tp2_pp2, "--output", out) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and f"put the previous hf back from {aside.name}" in err[0], err
    assert f"removed {staged.name}" in err[0] and "not empty (pass --force" in err[1], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]


def poisoned(step_dir: Path, dst: Path, name: str, value: float) -> Path:
    """A copy of a checkpoint with element [0, 0] of tensor ``name`` set to ``value`` (every tensor saved again with
    DCP, the manifest rewritten), so that it verifies as a checkpoint training wrote."""
    import torch.distributed.checkpoint as dcp

    from training.checkpoint import FORMAT_VERSION, file_digest
    from training.safe_load import load_dcp, read_dcp_metadata

    import warnings

    metadata = read_dcp_metadata(step_dir)
    state = {k: torch.empty(md.size, dtype=md.properties.dtype) for k, md in metadata.state_dict_metadata.items()}
    dst.mkdir(parents=True)
    with warnings.catch_warnings():  # "assuming the intent is to load/save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        load_dcp(state, step_dir, no_dist=True)
        state[name].view(-1)[0] = value
        dcp.save(state, checkpoint_id=str(dst), no_dist=True)
    for p in step_dir.iterdir():
        if p.name != "manifest.json" and not (dst / p.name).exists():
            shutil.copyfile(p, dst / p.name)
    files = {p.name: file_digest(p) for p in dst.iterdir()}
    (dst / "manifest.json").write_text(json.dumps({"format": FORMAT_VERSION, "files": files}))
    return dst


@pytest.mark.parametrize("value,dtype,expected", [
    (float("nan"), "float32", "error: checkpoint {ckpt}: model.layers.2.mlp.down.weight holds non-finite values "
                              "(1 NaN, 0 inf of "),
    (float("-inf"), "bfloat16", "error: checkpoint {ckpt}: model.layers.2.mlp.down.weight holds non-finite values "
                                "(0 NaN, 1 inf of "),
    (1e6, "float16", "error: model.layers.2.mlp.down_proj.weight holds values beyond float16's range "
                     "(non-finite values (0 NaN, 1 inf of "),
], ids=["nan", "inf", "float16_overflow"])
def test_weights_holding_nan_or_inf_are_refused_naming_the_tensor(tp2_pp2, tmp_path, capsys, value, dtype, expected):
    ckpt = poisoned(tp2_pp2, tmp_path / "ckpt" / tp2_pp2.name, "model.layers.2.mlp.down.weight", value)
    capsys.readouterr()
    assert export("--checkpoint", ckpt, "--output", tmp_path / "hf", "--dtype", dtype) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(expected.format(ckpt=ckpt)), err
    assert not (tmp_path / "hf").exists()


def other_sentencepiece(path: Path) -> Path:
    """The bundled sentencepiece model with one piece's score changed: another tokenizer of the same vocabulary."""
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString((ROOT / "data" / "sample" / "tokenizer.model").read_bytes())
    proto.pieces[300].score += 1.0
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(proto.SerializeToString())
    return path


def test_a_tokenizer_other_than_the_checkpoints_is_refused_a_copy_is_not(tp2_pp2, tmp_path, capsys):
    """Compared by content with the tokenizer at the checkpoint's data.tokenizer, as training compares the data's
    tokenizer: one of the same vocabulary size but other content is refused; the same file elsewhere exports."""
    other = other_sentencepiece(tmp_path / "other" / "tokenizer.model")
    capsys.readouterr()
    assert export("--checkpoint", tp2_pp2, "--output", tmp_path / "hf", "--tokenizer", other) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"error: --tokenizer {other} is not the tokenizer "), err
    assert "data.tokenizer data/sample/tokenizer.model" in err
    assert not (tmp_path / "hf").exists()
    copy = tmp_path / "moved" / "tok.model"
    copy.parent.mkdir()
    shutil.copyfile(ROOT / "data" / "sample" / "tokenizer.model", copy)
    assert export("--checkpoint", tp2_pp2, "--output", tmp_path / "hf", "--tokenizer", copy) == 0
    assert "note:" not in capsys.readouterr().err
    assert (tmp_path / "hf" / "tokenizer.model").read_bytes() == copy.read_bytes()
