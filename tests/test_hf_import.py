"""scripts/import_hf.py and checkpoint.init_from: a Llama built and saved locally by transformers becomes a
checkpoint that train.py starts from in any layout, and its first-step loss is LlamaForCausalLM's loss on the
same batch (fp32). The reference is transformers' own model, never ours."""
import contextlib
import io
import json
import math
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.dist_harness import run_world
from tests.test_hf_export import ROOT, assert_close, our_logits, random_tokens

import transformers  # noqa: E402  (a test dependency: requirements-dev.txt)

sys.path.insert(0, str(ROOT / "scripts"))
import import_hf  # noqa: E402

RTOL = 1e-5
RTOL_FP8 = 1e-2  # FP8 GEMMs round to 3 mantissa bits: 4e-3 measured; a model ignoring the weights is 5% off
VOCAB = 4096  # the bundled tokenizer's, so train.py runs on the bundled corpus
SEQ, BATCH = 32, 4
RUN = [f"model.seq_len={SEQ}", f"train.global_batch_size={BATCH}", "train.micro_batch_size=2", "train.max_steps=1",
       "train.eval_interval=0", "logging.interval=1", "logging.wandb.mode=disabled", "checkpoint.interval=0",
       "device=cpu", "precision=fp32"]


def make_llama(path: Path, shard_size: str = None, **overrides) -> "transformers.LlamaForCausalLM":
    """A random tiny Llama saved with save_pretrained (std 0.1, norms and biases randomised too, so that every
    tensor's place shows in the logits and the loss is far from uniform), with the bundled tokenizer.model."""
    settings = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64, rms_norm_eps=1e-6,
                    rope_theta=500000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                    initializer_range=0.1)
    settings.update(overrides)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**settings)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0, 0.05)
    model.save_pretrained(str(path), **({"max_shard_size": shard_size} if shard_size else {}))
    shutil.copyfile(ROOT / "data" / "sample" / "tokenizer.model", path / "tokenizer.model")
    return model


def import_model(model_dir: Path, out: Path, *extra: str) -> int:
    return import_hf.main(["--model", str(model_dir), "--output", str(out), *extra])


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """A Llama (no bias, untied) and its import."""
    tmp = tmp_path_factory.mktemp("import")
    model = make_llama(tmp / "llama")
    assert import_model(tmp / "llama", tmp / "ckpt") == 0
    return model, tmp / "ckpt"


def train_worker(config_file: str, overrides):
    """train.py's run() on this world (the harness's process group); returns its console output and result,
    or the one-line error train.py would print."""
    from config import load_config
    from training.checkpoint import CheckpointError
    from training.trainer import run

    out = io.StringIO()
    real = dist.destroy_process_group
    dist.destroy_process_group = lambda *a, **k: None  # the harness destroys the group it made
    try:
        with contextlib.redirect_stdout(out):
            result = run(load_config(config_file, list(overrides)), config_name="hf")
    except CheckpointError as e:
        return {"error": str(e)}
    finally:
        dist.destroy_process_group = real
    return {"stdout": out.getvalue(), **result}


def first_loss(run_dir: Path) -> float:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return next(r["loss"] for r in records if r.get("step") == 1 and "loss" in r)


def reference_loss(model, config_file: Path, data=()) -> float:
    """transformers' mean next-token loss on the run's first global batch (read by the trainer's data code from the
    default data, or ``data``'s overrides)."""
    from config import load_config
    from data.gpt_dataset import get_batch
    from training.trainer import check_data

    train_ds, _ = check_data(load_config(str(config_file), RUN + list(data)))
    tokens, labels = get_batch(train_ds, range(BATCH))
    with torch.no_grad():
        logits = model(tokens).logits
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten()).item()


def train_from_import(model, ckpt: Path, run_dir: Path, world: int, layout, rtol: float = RTOL, data=()) -> dict:
    config = ckpt / "model.yaml"
    out = run_world(train_worker, world, str(config), RUN + [f"logging.run_dir={run_dir}", *layout])
    assert all("error" not in r for r in out), out[0]
    assert out[0]["step"] == 1 and "model weights from" in out[0]["stdout"]
    want = reference_loss(model, config, data)
    assert abs(want - math.log(VOCAB)) > 0.1, "near-uniform logits: any model would give this loss"
    got = first_loss(run_dir)
    assert abs(got - want) <= rtol * want, (got, want)
    return out[0]


def test_import_writes_a_checkpoint_model_yaml_and_the_command(imported, tmp_path, capsys):
    model, ckpt = imported
    model_yaml = (ckpt / "model.yaml").read_text()
    from omegaconf import OmegaConf
    doc = OmegaConf.to_container(OmegaConf.load(ckpt / "model.yaml"))
    assert doc["model"] == {"n_layers": 2, "d_model": 64, "n_heads": 4, "vocab_size": VOCAB, "ffn_hidden": 96,
                            "activation": "swiglu", "norm": "rmsnorm", "norm_eps": 1e-6, "rope_theta": 500000.0,
                            "tie_embeddings": False, "bias": False, "max_seq_len": 64, "seq_len": 64}, model_yaml
    assert doc["checkpoint"] == {"init_from": str(ckpt.resolve())}
    assert doc["data"] == {"tokenizer": str((ckpt / "tokenizer.model").resolve())}
    assert {"meta.json", "manifest.json", ".metadata"} <= {p.name for p in ckpt.iterdir()}
    capsys.readouterr()
    assert import_model(ckpt.parent / "llama", tmp_path / "again") == 0
    assert capsys.readouterr().out.strip() == f"python train.py --config {tmp_path / 'again' / 'model.yaml'} " \
                                              "data.paths=[YOUR_DATA_PREFIX]"


def test_import_then_train_at_tp2_first_loss_is_llamas(imported, tmp_path):
    model, ckpt = imported
    train_from_import(model, ckpt, tmp_path / "run", 2, ["parallel.tp=2", "parallel.sequence_parallel=true"])


def test_import_named_by_checkpoint_load_trains_at_pp2_from_llamas_weights(imported, tmp_path):
    """checkpoint.load naming an import (weights only, nothing to resume) starts at step 0 from its weights with a
    fresh optimizer, like checkpoint.init_from."""
    model, ckpt = imported
    out = train_from_import(model, ckpt, tmp_path / "run", 2,
                            ["parallel.pp=2", "checkpoint.init_from=null", f"checkpoint.load={ckpt}"])
    assert f"model weights from {ckpt} (checkpoint.load, imported from" in out["stdout"]


def test_import_then_train_with_zero3_dp2_first_loss_is_llamas(imported, tmp_path):
    model, ckpt = imported
    train_from_import(model, ckpt, tmp_path / "run", 2, ["zero.stage=3"])


def test_a_run_with_its_own_checkpoint_resumes_it_instead(imported, tmp_path):
    """init_from applies to a fresh run only: a requeued job continues from its own checkpoints."""
    model, ckpt = imported
    config, run_dir = str(ckpt / "model.yaml"), tmp_path / "run"
    first = run_world(train_worker, 1, config, RUN + [f"logging.run_dir={run_dir}"])[0]
    assert "model weights from" in first["stdout"] and (run_dir / "checkpoints" / "step_00000001").is_dir()
    second = run_world(train_worker, 1, config, RUN + [f"logging.run_dir={run_dir}", "train.max_steps=2"])[0]
    assert second["step"] == 2 and "resumed from" in second["stdout"]
    assert "model weights from" not in second["stdout"]
    # init_from may name a run directory too (another run's newest checkpoint; its settings are the import's)
    third = run_world(train_worker, 1, config, RUN + [f"logging.run_dir={tmp_path / 'run3'}",
                                                      f"checkpoint.init_from={run_dir}"])[0]
    assert f"model weights from {run_dir / 'checkpoints' / 'step_00000002'}" in third["stdout"]


def test_a_different_model_config_is_an_error_naming_the_keys(imported, tmp_path):
    _, ckpt = imported
    out = run_world(train_worker, 1, str(ckpt / "model.yaml"),
                    RUN + [f"logging.run_dir={tmp_path / 'run'}", "model.d_model=128", "model.norm_eps=1e-5"])[0]
    assert "model.d_model: checkpoint 64 vs config 128" in out["error"]
    assert "model.norm_eps: checkpoint 1e-06 vs config 1e-05" in out["error"]
    assert "model.n_layers" not in out["error"]


@pytest.mark.parametrize("variant", ["sharded_safetensors_tied_bias", "pytorch_model_bin"])
def test_weight_formats_and_settings_import_to_llamas_logits(tmp_path, variant):
    if variant == "pytorch_model_bin":
        model = make_llama(tmp_path / "llama", num_hidden_layers=3)
        for f in (tmp_path / "llama").glob("*.safetensors"):
            f.unlink()
        torch.save(model.state_dict(), tmp_path / "llama" / "pytorch_model.bin")
    else:
        model = make_llama(tmp_path / "llama", shard_size="300KB", tie_word_embeddings=True, attention_bias=True,
                           mlp_bias=True)
        assert (tmp_path / "llama" / "model.safetensors.index.json").is_file()
    assert import_model(tmp_path / "llama", tmp_path / "ckpt") == 0
    tokens = random_tokens(VOCAB, seq=SEQ)
    with torch.no_grad():
        want = model(tokens).logits
    assert_close(our_logits(tmp_path / "ckpt", tokens, tmp_path / "ckpt" / "model.yaml"), want, RTOL)


@pytest.fixture(scope="module")
def imported_gqa(tmp_path_factory):
    """A grouped-query Llama: 8 query heads, 2 key/value heads."""
    tmp = tmp_path_factory.mktemp("gqa")
    model = make_llama(tmp / "llama", num_attention_heads=8, num_key_value_heads=2)
    assert import_model(tmp / "llama", tmp / "ckpt") == 0
    return model, tmp / "ckpt"


def test_grouped_query_import_then_train_at_tp2(imported_gqa, tmp_path):
    """8 query heads, 2 KV heads: one KV head per TP rank."""
    model, ckpt = imported_gqa
    assert "n_kv_heads: 2" in (ckpt / "model.yaml").read_text()
    train_from_import(model, ckpt, tmp_path / "run", 2, ["parallel.tp=2"])


def test_grouped_query_import_then_train_at_tp4_with_replicated_kv_heads(imported_gqa, tmp_path):
    """tp4 > 2 KV heads: each KV head is loaded into the 2 TP ranks that hold it."""
    model, ckpt = imported_gqa
    train_from_import(model, ckpt, tmp_path / "run", 4, ["parallel.tp=4", "parallel.sequence_parallel=true"])


def test_grouped_query_import_then_train_under_fp8(imported_gqa, tmp_path):
    """checkpoint.init_from under precision=fp8 (FP8 ZeRO-1 at tp2): the first loss is Llama's up to FP8 rounding."""
    model, ckpt = imported_gqa
    train_from_import(model, ckpt, tmp_path / "run", 2, ["parallel.tp=2", "precision=fp8", "fp8.emulate=true",
                                                         "zero.stage=1"], rtol=RTOL_FP8)


def test_grouped_query_import_then_train_at_pp2(imported_gqa, tmp_path):
    model, ckpt = imported_gqa
    train_from_import(model, ckpt, tmp_path / "run", 2, ["parallel.pp=2"])


def _config(tmp_path: Path, **changes) -> Path:
    """A Llama directory whose config.json has ``changes`` (None deletes a key), with the fixture's weights."""
    src = tmp_path / "base"
    if not src.exists():
        make_llama(src)
    d = tmp_path / f"variant{len(list(tmp_path.iterdir()))}"
    shutil.copytree(src, d)
    cfg = json.loads((d / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("changes,expected", [
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 8.0}},
     'rope_parameters.rope_type="yarn" (only default, linear and llama3 RoPE are supported)'),
    # transformers 4's legacy "type" is named as the file spells it (it was named rope_type, a key not in the file)
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}},
     'rope_scaling.type="dynamic" (only default, linear and llama3 RoPE are supported)'),
    ({"rope_scaling": {"type": "foo"}}, 'rope_scaling.type="foo" (only default'),
    ({"rope_parameters": {"type": "yarn", "rope_theta": 500000.0, "factor": 8.0}}, 'rope_parameters.type="yarn"'),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0}},
     "rope_parameters.low_freq_factor=null is not a finite number above 0"),
    ({"head_dim": 33}, "head_dim=33 is odd"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"model_type": "gemma2"}, "model_type='gemma2' (soft-capped logits and sliding windows; only llama, qwen2, "
                               "mistral, qwen3, mixtral, qwen2_moe and qwen3_moe are supported)"),
    ({"model_type": "qwen3"}, "the weights lack 4 tensor(s) config.json implies, e.g. "
                              "model.layers.0.self_attn.q_norm.weight"),
    ({"model_type": "mistral", "sliding_window": 4096}, "sliding_window=4096 (sliding-window attention is not"),
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 32}, "use_sliding_window=true"),
    ({"num_local_experts": 8}, "num_local_experts=8 (mixture-of-experts in a llama model"),
    ({"attention_bias": True}, "attention_bias=True with mlp_bias=False"),
    ({"hidden_size": None}, "lacks a positive integer hidden_size"),
    ({"intermediate_size": 128}, "mlp.gate_proj.weight has shape (96, 64), config.json implies (128, 64)"),
], ids=["rope_yarn", "rope_dynamic_v4", "rope_foo_v4", "rope_yarn_type", "rope_llama3_incomplete", "head_dim_odd", "gelu", "gemma2", "qwen3_qk_norm",
        "mistral_sliding", "qwen2_sliding", "moe", "bias_mismatch", "no_hidden_size", "wrong_shapes"])
def test_unsupported_or_inconsistent_models_are_refused_with_the_reason(tmp_path, capsys, changes, expected):
    d = _config(tmp_path, **changes)
    capsys.readouterr()  # save_pretrained's progress bar
    assert import_model(d, tmp_path / "out") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and expected in err, err
    assert not (tmp_path / "out").exists()


def test_bad_inputs_are_one_line_errors(imported, tmp_path, capsys):
    _, ckpt = imported

    def error(model_dir, out, *extra) -> str:
        assert import_model(model_dir, out, *extra) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("error: "), err
        return err

    assert "is not a directory" in error(tmp_path / "nowhere", tmp_path / "o")
    (tmp_path / "noconfig").mkdir()
    assert "config.json not found" in error(tmp_path / "noconfig", tmp_path / "o")
    noweights = tmp_path / "noweights"
    noweights.mkdir()
    shutil.copyfile(ckpt.parent / "llama" / "config.json", noweights / "config.json")
    assert "no weights in" in error(noweights, tmp_path / "o")
    (noweights / "model.safetensors").write_bytes(b"not a safetensors file")
    assert "cannot read weights file" in error(noweights, tmp_path / "o")
    before = (ckpt / "meta.json").read_text()
    assert "not empty (pass --force" in error(ckpt.parent / "llama", ckpt)
    assert (ckpt / "meta.json").read_text() == before
    # a file where a directory belongs and the reverse, random bytes, malformed JSON: each named in one line
    (tmp_path / "random.bin").write_bytes(os.urandom(4096))
    assert "is not a directory" in error(tmp_path / "random.bin", tmp_path / "o")
    under_a_file = tmp_path / "random.bin" / "o"
    assert f"{tmp_path / 'random.bin'} is not a directory" in error(ckpt.parent / "llama", under_a_file)
    odd = tmp_path / "odd"
    (odd / "config.json").mkdir(parents=True)
    assert f"{odd / 'config.json'} is not a file" in error(odd, tmp_path / "o")
    (odd / "config.json").rmdir()
    (odd / "config.json").write_bytes(os.urandom(512))
    assert "config.json is not readable JSON" in error(odd, tmp_path / "o")
    (odd / "config.json").write_text('{"model_type": "llama", ')
    assert "config.json is not readable JSON" in error(odd, tmp_path / "o")
    shutil.copyfile(ckpt.parent / "llama" / "config.json", noweights / "config.json")
    (noweights / "model.safetensors").write_bytes(os.urandom(4096))
    assert "cannot read weights file" in error(noweights, tmp_path / "o")
    (noweights / "model.safetensors").unlink()
    torch.save([1, 2, 3], noweights / "pytorch_model.bin")
    assert "holds a list, not tensors by name" in error(noweights, tmp_path / "o")
    (noweights / "pytorch_model.bin").unlink()
    for weight_map, named in (({"a": ["x.safetensors"]}, '["x.safetensors"]'), ({"a": "../llama/model.safetensors"},
                                                                                '"../llama/model.safetensors"')):
        (noweights / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        assert f"weight_map names {named}, not a file name beside it" in error(noweights, tmp_path / "o")
    (noweights / "model.safetensors.index.json").write_bytes(os.urandom(256))
    assert "has no readable weight_map" in error(noweights, tmp_path / "o")
    (noweights / "model.safetensors.index.json").write_text('{"weight_map": {"a": "shard.safetensors"}}')
    (noweights / "shard.safetensors").mkdir()
    assert "shard.safetensors is not a file" in error(noweights, tmp_path / "o")
    assert not (tmp_path / "o").exists()



def _snapshot(directory: Path) -> dict:
    """Every file under ``directory`` (its path there) and its bytes."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_force_swaps_in_a_whole_new_import_and_a_failed_one_changes_nothing(imported, tmp_path, capsys, monkeypatch):
    """--force over an earlier import (sentencepiece) with a model whose tokenizer is a tokenizer.json: written
    whole beside it and swapped in, so no tokenizer.model is left to be read as the tokenizer; a forced import that
    fails leaves the earlier one as it was; a staging directory a killed import left beside it is removed."""
    from tests.test_hf_export import dead_pid, left_by
    from training.checkpoint import find_checkpoint

    _, ckpt = imported
    out = tmp_path / "ckpt"
    assert import_model(ckpt.parent / "llama", out) == 0
    bpe_model = tmp_path / "bpe_llama"
    shutil.copytree(ckpt.parent / "llama", bpe_model)
    (bpe_model / "tokenizer.model").unlink()
    for p in (ROOT / "data" / "sample" / "bpe").iterdir():
        shutil.copyfile(p, bpe_model / p.name)
    before = _snapshot(out)

    def disk_full(*args):
        raise OSError(28, "No space left on device", str(out / "model.yaml"))

    monkeypatch.setattr(import_hf, "model_yaml", disk_full)
    capsys.readouterr()
    assert import_model(bpe_model, out, "--force") == 2
    monkeypatch.undo()
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "No space left on device" in err and f"{out} is unchanged" in err, err
    assert _snapshot(out) == before
    killed = left_by(out, "import_hf", files=("__0_0.distcp",), pid=dead_pid())
    assert import_model(bpe_model, out, "--force") == 0
    assert f"removed {killed.name} (pid " in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bpe_llama", "ckpt"]
    assert sorted(p.name for p in out.iterdir()) == [".metadata", "__0_0.distcp", "manifest.json", "meta.json",
                                                     "model.yaml", "tokenizer.json", "tokenizer_config.json"]
    assert f"tokenizer: {out / 'tokenizer.json'}" in (out / "model.yaml").read_text()
    assert find_checkpoint(out, "loading") == out  # verifies against its manifest


def test_force_refuses_what_is_not_an_earlier_import(imported, tmp_path, capsys, monkeypatch):
    """A training run, a training checkpoint, notes, the current directory: refused in one line (exit code 2),
    nothing in them changed, instead of being replaced or mixed into."""
    _, ckpt = imported
    run = tmp_path / "run"  # a training run directory
    (run / "checkpoints" / "step_00000001").mkdir(parents=True)
    (run / "checkpoints" / "step_00000001" / "meta.json").write_text("{}")
    (run / "metrics.jsonl").write_text("{}\n")
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "notes.txt").write_text("mine")
    trained = tmp_path / "trained"  # a checkpoint training wrote: its meta.json records no import
    shutil.copytree(ckpt, trained)
    meta = json.loads((trained / "meta.json").read_text())
    del meta["imported_from"]
    (trained / "meta.json").write_text(json.dumps(meta))
    snapshots = {d: _snapshot(d) for d in (run, notes, trained)}
    capsys.readouterr()
    for output, why in ((run, "holds checkpoints, metrics.jsonl, which no import writes: it is not an earlier "
                              "import"), (notes, "holds notes.txt, which no import writes"),
                        (trained, "is not an earlier import (its meta.json records no imported_from")):
        assert import_model(ckpt.parent / "llama", output, "--force") == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith(f"error: --output {output} {why}"), err
        assert _snapshot(output) == snapshots[output]
    assert _snapshot(run / "checkpoints" / "step_00000001") == {"meta.json": b"{}"}
    monkeypatch.chdir(ckpt)
    assert import_model(ckpt.parent / "llama", Path("."), "--force") == 2
    assert "is the current directory" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes", "run", "trained"]


def test_init_from_and_load_exclude_each_other():
    from config import ConfigError, load_config, validate_config

    with pytest.raises(ConfigError, match="checkpoint.init_from=a and checkpoint.load=b exclude each other"):
        validate_config(load_config(None, ["checkpoint.init_from=a", "checkpoint.load=b"]))
    with pytest.raises(ConfigError, match="checkpoint.init_from is empty"):
        validate_config(load_config(None, ["checkpoint.init_from=' '"]))


@pytest.mark.parametrize("changes,expected", [
    ({"rms_norm_eps": "abc"}, 'rms_norm_eps="abc" is not a number in (0, 1)'),
    ({"tie_word_embeddings": "false"}, 'tie_word_embeddings="false" is not true or false'),
    ({"attention_bias": 1, "mlp_bias": 1}, "attention_bias=1 is not true or false; mlp_bias=1 is not true or false"),
    ({"num_hidden_layers": True}, "num_hidden_layers=true is not a positive integer"),
    ({"num_attention_heads": -4}, "num_attention_heads=-4 is not a positive integer"),
    ({"num_key_value_heads": -2}, "num_key_value_heads=-2 is not a positive integer"),
    ({"hidden_size": 64.0}, "hidden_size=64.0 is not a positive integer"),
    ({"max_position_embeddings": 2**40}, f"max_position_embeddings={2**40} exceeds {2**20}, the largest "
                                         "model.max_seq_len"),
    ({"rope_theta": -1}, "rope_theta=-1 is not a finite number above 0"),
    ({"model_type": ["llama"]}, 'model_type=["llama"] is not a string'),
    ({"hidden_act": {"name": "silu"}}, 'hidden_act={"name": "silu"} is not a string'),
    ({"rope_scaling": {"rope_type": ["llama3"], "factor": 8.0}}, 'rope_scaling.rope_type=["llama3"] is not a string'),
    ({"rope_parameters": {"type": ["linear"], "factor": 2.0}}, 'rope_parameters.type=["linear"] is not a string'),
], ids=["eps_string", "tie_string", "bias_int", "layers_bool", "negative_heads", "negative_kv_heads", "float_size",
        "positions_2e40", "negative_theta", "model_type_list", "hidden_act_mapping", "rope_type_list",
        "rope_type_v4_list"])
def test_config_json_fields_of_a_wrong_type_or_range_are_named(imported, tmp_path, capsys, changes, expected):
    """Checked before anything else (here there are no weights at all): the key and its value, as JSON writes it."""
    _, ckpt = imported
    cfg = json.loads((ckpt.parent / "llama" / "config.json").read_text())
    cfg.update(changes)
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps(cfg))
    assert import_model(tmp_path / "llama", tmp_path / "out") == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: config.json: {expected}", err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("bad", ["nan", "inf"])
def test_weights_holding_nan_or_inf_are_refused_naming_the_tensor(imported, tmp_path, capsys, bad):
    from safetensors.torch import load_file, save_file

    _, ckpt = imported
    src, model_dir = ckpt.parent / "llama", tmp_path / "llama"
    model_dir.mkdir()
    shutil.copyfile(src / "config.json", model_dir / "config.json")
    weights = load_file(str(src / "model.safetensors"))
    weights["model.layers.1.mlp.down_proj.weight"][3, 5] = float(bad)
    weights["model.layers.1.mlp.down_proj.weight"][7, 1] = -float(bad)
    save_file(weights, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    assert import_model(model_dir, tmp_path / "out") == 2
    err = capsys.readouterr().err.strip()
    counts = "2 NaN, 0 inf" if bad == "nan" else "0 NaN, 2 inf"
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"error: model.layers.1.mlp.down_proj.weight holds non-finite values ({counts} of "), err
    assert not (tmp_path / "out").exists()
