"""Tests for config/: defaults, precedence, rejection of bad input, validation, --help text."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from config import Config, ConfigError, describe, load_config, validate_config


def _leaf_keys(obj, prefix: str = "") -> list[str]:
    """Every dotted leaf key of a plain nested dict (an independent walk, not describe())."""
    keys = []
    for k, v in obj.items():
        if isinstance(v, dict):
            keys += _leaf_keys(v, f"{prefix}{k}.")
        else:
            keys.append(f"{prefix}{k}")
    return keys


# ---- loading --------------------------------------------------------------------------------------

def test_defaults_load_and_match_the_documented_values() -> None:
    cfg = load_config()
    assert isinstance(cfg, Config)
    assert (cfg.model.n_layers, cfg.model.d_model, cfg.model.n_heads, cfg.model.seq_len) == (4, 128, 4, 128)
    assert (cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.virtual_stages) == (1, 1, 1)
    assert cfg.parallel.sequence_parallel is False and cfg.parallel.ranks_per_node is None
    assert cfg.zero.stage == 0 and cfg.precision == "fp32" and cfg.logging.wandb.mode == "offline"
    assert (cfg.train.micro_batch_size, cfg.train.global_batch_size, cfg.train.seed) == (8, 16, 1234)
    # derived sizes from the docstring formulas
    assert cfg.model.head_dim == 128 // 4
    assert cfg.model.ffn_size == 384  # swiglu: ceil(int(8*128/3) / 64) * 64 = ceil(341/64)*64
    assert cfg.model.max_positions == cfg.model.seq_len
    validate_config(cfg)  # the defaults are a valid experiment


def test_ffn_size_formulas() -> None:
    assert load_config(None, ["model.activation=gelu", "model.d_model=96"]).model.ffn_size == 384
    assert load_config(None, ["model.d_model=96"]).model.ffn_size == 256  # int(256.0)=256 -> 256
    assert load_config(None, ["model.d_model=100"]).model.ffn_size == 320  # int(266.67)=266 -> 320
    assert load_config(None, ["model.ffn_hidden=77"]).model.ffn_size == 77


def test_yaml_overrides_defaults_and_dotlist_overrides_yaml(tmp_path: Path) -> None:
    path = tmp_path / "exp.yaml"
    path.write_text("model:\n  d_model: 256\n  n_layers: 6\ntrain:\n  lr: 0.5\nprecision: bf16\n")
    cfg = load_config(str(path), ["model.d_model=64", "train.seed=7"])
    assert cfg.model.d_model == 64          # dotlist beats YAML
    assert cfg.model.n_layers == 6          # YAML beats default
    assert cfg.train.lr == 0.5
    assert cfg.precision == "bf16"
    assert cfg.train.seed == 7              # dotlist beats default
    assert cfg.model.n_heads == 4           # untouched default
    only_yaml = load_config(str(path))
    assert (only_yaml.model.d_model, only_yaml.model.n_layers) == (256, 6)


def test_dotlist_values_are_typed() -> None:
    cfg = load_config(None, ["train.lr=1e-3", "parallel.sequence_parallel=true", "model.max_seq_len=256",
                             "data.paths=[a,b]", "data.weights=[0.25,0.75]"])
    assert cfg.train.lr == pytest.approx(1e-3) and isinstance(cfg.train.lr, float)
    assert cfg.parallel.sequence_parallel is True
    assert cfg.model.max_seq_len == 256 and cfg.model.max_positions == 256
    assert cfg.data.paths == ["a", "b"] and cfg.data.weights == [0.25, 0.75]


@pytest.mark.parametrize("override, key", [
    ("model.foo=1", "model.foo"),
    ("nonsense=3", "nonsense"),
    ("logging.wandb.colour=red", "colour"),
])
def test_unknown_key_is_rejected_naming_it(override: str, key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, [override])


@pytest.mark.parametrize("override, key", [
    ("model.n_layers=abc", "model.n_layers"),
    ("parallel.sequence_parallel=maybe", "parallel.sequence_parallel"),
    ("train.lr=fast", "train.lr"),
])
def test_wrong_type_is_rejected_naming_the_key(override: str, key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, [override])


def test_override_without_equals_is_rejected_naming_it() -> None:
    with pytest.raises(ConfigError, match=r"train\.max_steps"):
        load_config(None, ["model.d_model=64", "train.max_steps"])


def test_bad_yaml_is_rejected_naming_the_file_and_key(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  n_heads: many\n")
    with pytest.raises(ConfigError) as e:
        load_config(str(path))
    assert "model.n_heads" in str(e.value) and "bad.yaml" in str(e.value)
    path.write_text("model:\n  n_head: 4\n")
    with pytest.raises(ConfigError, match="n_head"):
        load_config(str(path))
    with pytest.raises(ConfigError, match="missing.yaml"):
        load_config(str(tmp_path / "missing.yaml"))


def test_yaml_the_loader_refuses_is_one_config_error_naming_the_file(tmp_path: Path) -> None:
    """A duplicated section and aliases that expand past omegaconf's limit (a billion-laughs file) are YAML errors
    of omegaconf's loader, not of the schema: one ConfigError naming the file (they were ConstructorError
    tracebacks), as train.py reports it (exit 2)."""
    import train

    dup = tmp_path / "dup.yaml"
    dup.write_text("train:\n  max_steps: 3\ntrain:\n  max_steps: 4\n")
    laughs = tmp_path / "laughs.yaml"
    levels = ['&l0 ["x","x","x","x","x","x","x","x","x"]'] + [
        f"&l{i} [" + ",".join([f"*l{i - 1}"] * 9) + "]" for i in range(1, 6)]  # 9**6 strings, from 60 lines' worth
    laughs.write_text("data:\n  paths: [" + ", ".join(levels) + "]\n")
    for path, fragment in ((dup, "duplicate key train"), (laughs, "expansion exceeds")):
        with pytest.raises(ConfigError) as e:
            load_config(str(path))
        assert str(path) in str(e.value) and fragment in str(e.value) and "\n" not in str(e.value), e.value
        assert train.main(["--config", str(path)]) == 2


def test_an_oversized_config_file_is_refused_before_it_is_parsed(tmp_path: Path, capsys) -> None:
    """A 300 MB file (sparse: no disk used) is refused at once, naming its size and the bound; YAML took about two
    minutes to reject it."""
    import time

    import train
    from config import MAX_CONFIG_BYTES

    big = tmp_path / "big.yaml"
    with open(big, "wb") as f:
        f.truncate(300 * 2**20)
    began = time.monotonic()
    with pytest.raises(ConfigError, match=r"big\.yaml is 300\.0 MiB; a config is at most 4 MiB"):
        load_config(str(big))
    assert train.main(["--config", str(big)]) == 2
    assert "300.0 MiB" in capsys.readouterr().err
    assert time.monotonic() - began < 5
    ok = tmp_path / "ok.yaml"
    ok.write_text("train:\n  max_steps: 3\n" + "#" * 80 + "\n" * 1)
    assert load_config(str(ok)).train.max_steps == 3 and ok.stat().st_size < MAX_CONFIG_BYTES


# ---- validation ----------------------------------------------------------------------------------

def _invalid(*overrides: str) -> str:
    cfg = load_config(None, list(overrides))
    with pytest.raises(ConfigError) as e:
        validate_config(cfg)
    return str(e.value)


def test_heads_must_divide_d_model() -> None:
    msg = _invalid("model.d_model=100", "model.n_heads=3")
    assert "model.d_model=100" in msg and "model.n_heads=3" in msg


def test_global_batch_must_be_a_multiple_of_micro_batch() -> None:
    msg = _invalid("train.global_batch_size=10", "train.micro_batch_size=4")
    assert "train.global_batch_size=10" in msg and "train.micro_batch_size=4" in msg


def test_seq_len_above_max_seq_len() -> None:
    msg = _invalid("model.seq_len=256", "model.max_seq_len=128")
    assert "model.seq_len=256" in msg and "128" in msg and "max_seq_len" in msg


@pytest.mark.parametrize("key, value", [
    ("model.activation", "relu"), ("model.norm", "batchnorm"), ("model.activation_checkpointing", "some"),
    ("precision", "fp64"), ("device", "tpu"), ("logging.wandb.mode", "loud"),
])
def test_bad_choice_strings(key: str, value: str) -> None:
    msg = _invalid(f"{key}={value}")
    assert key in msg and value in msg


def test_every_error_is_reported_at_once() -> None:
    msg = _invalid("model.norm=batchnorm", "model.activation=relu", "train.global_batch_size=10",
                   "train.micro_batch_size=4")
    assert "batchnorm" in msg and "relu" in msg and "global_batch_size=10" in msg


@pytest.mark.parametrize("overrides, words", [
    (["precision=fp8", "zero.quantized_weights=true", "zero.stage=3"], ["zero.quantized_weights=true", "precision=fp8"]),
    (["precision=fp8", "zero.quantized_gradients=true", "zero.stage=2"], ["zero.quantized_gradients=true"]),
    (["precision=fp8", "model.tie_embeddings=true", "parallel.pp=2"], ["tie_embeddings", "pp"]),
    (["fp8.gradient_format=e3m4"], ["fp8.gradient_format"]),
    (["fp8.scaling=sometimes"], ["fp8.scaling"]),
    (["fp8.amax_history_len=0"], ["fp8.amax_history_len"]),
    (["fp8.master_dtype=bf16"], ["fp8.master_dtype"]),
    (["fp8.mu_overflow_threshold=2"], ["fp8.mu_overflow_threshold"]),
])
def test_fp8_combinations_that_cannot_work_say_so(overrides: list, words: list) -> None:
    msg = _invalid(*overrides)
    for w in words:
        assert w in msg, (w, msg)


@pytest.mark.parametrize("overrides, words", [
    (["zero.stage=4"], ["zero.stage=4", "[0, 1, 2, 3]"]),
    (["zero.stage=-1"], ["zero.stage=-1"]),
    (["zero.partition=striped"], ["zero.partition='striped'", "whole_tensor"]),
    (["zero.reduce_dtype=fp8"], ["zero.reduce_dtype='fp8'"]),
    (["zero.stage=2", "zero.hpz_size=4"], ["zero.hpz_size=4 needs zero.stage=3", "zero.stage=2"]),
    (["zero.stage=0", "zero.quantized_gradients=true"], ["zero.quantized_gradients=true needs zero.stage 1, 2 or 3"]),
    (["zero.stage=0", "zero.quantized_weights=true"], ["zero.quantized_weights=true needs zero.stage 1, 2 or 3"]),
    (["zero.stage=3", "zero.weight_bits=6"], ["zero.weight_bits=6 must be 4 or 8"]),
    (["zero.stage=3", "zero.quantized_gradients=true", "zero.gradient_bits=2"], ["zero.gradient_bits=2 must be 4 or 8"]),
    (["zero.stage=3", "zero.quant_block=7"], ["zero.quant_block=7"]),
    (["zero.stage=3", "zero.qgz_stages=0"], ["zero.qgz_stages=0"]),
    (["zero.stage=3", "zero.hpz_size=0"], ["zero.hpz_size=0"]),
])
def test_bad_zero_options_name_key_and_value(overrides: list, words: list) -> None:
    msg = _invalid(*overrides)
    for w in words:
        assert w in msg, msg


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_stages_are_valid(stage: int) -> None:
    validate_config(load_config(None, [f"zero.stage={stage}", "zero.partition=whole_tensor",
                                       "zero.reduce_dtype=fp32"]))


@pytest.mark.parametrize("override, key", [
    ("model.dropout=1.0", "model.dropout"), ("model.attention_dropout=-0.1", "model.attention_dropout"),
    ("train.lr=0", "train.lr"), ("parallel.tp=0", "parallel.tp"), ("model.n_layers=0", "model.n_layers"),
    ("data.weights=[1.0,2.0]", "data.weights"),
])
def test_ranges_are_checked(override: str, key: str) -> None:
    assert key in _invalid(override)


@pytest.mark.parametrize("override, key", [("model.n_heads=0", "model.n_heads"),
                                           ("train.micro_batch_size=0", "train.micro_batch_size")])
def test_zero_divisors_give_a_config_error(override: str, key: str) -> None:
    cfg = load_config(None, [override])
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate_config(cfg)


# ---- ceilings of sizes, counts and intervals that allocate or loop (issue 17) ---------------------------

# (key, the largest value accepted, a value rejected, other overrides both need). Written out as numbers here,
# not read from config/: each row is the documented range, and each rejected value used to pass validation
# and then die in an allocation (or a near-endless loop, or skip every step).
BOUNDS = [
    ("model.max_seq_len", 2**20, 2**40, []),
    ("model.seq_len", 2**20, 2**20 + 1, []),
    ("model.vocab_size", 2**22, 2**22 + 1, []),
    ("model.d_model", 2**17, 2**18, []),
    ("model.n_layers", 2**12, 2**12 + 1, []),
    ("model.ffn_hidden", 2**19, 2**19 + 1, []),
    ("train.global_batch_size", 2**20, 2**21, []),
    ("train.micro_batch_size", 2**17, 2**18, ["train.global_batch_size=262144"]),  # x seq_len 128 <= 2**24 tokens
    ("train.eval_iters", 2**16, 2**16 + 1, []),
    ("fp8.amax_history_len", 2**16, 10**9, []),
    ("fp8.margin", 32, 33, []),
    ("fp8.mu_initial", 2.0**64, 1e38, []),
    ("fp8.mu_initial", 2.0**-64, 2.0**-65, []),
    ("fp8.mu_initial", 1.0, float("inf"), []),
    ("zero.quant_block", 2**16, 10**12, []),
    ("zero.qgz_stages", 64, 10**8, []),
    ("loss_scale.initial", 2.0**64, 1e38, []),
    ("loss_scale.initial", 65536.0, float("inf"), []),
    ("loss_scale.growth_interval", 1, 0, []),
    ("parallel.bucket_mb", 2.0**20, float("inf"), []),
    ("parallel.bucket_mb", 0.01, 0.0, []),
    ("parallel.timeout_s", 7 * 24 * 3600.0, 1e9, []),
]


@pytest.mark.parametrize("key, ok, bad, extra", BOUNDS, ids=[f"{k}={bad}" for k, _, bad, _ in BOUNDS])
def test_sizes_that_allocate_or_loop_are_bounded(key: str, ok, bad, extra: list) -> None:
    validate_config(load_config(None, [*extra, f"{key}={ok}"]))  # the bound itself is a valid experiment
    msg = _invalid(*extra, f"{key}={bad}")
    assert len(msg.splitlines()) == 1 and msg.startswith(f"invalid configuration: {key}="), msg  # this field alone


def test_sequence_length_bound_is_exported() -> None:
    """scripts/import_hf.py refuses max_position_embeddings above config.MAX_SEQ_LEN: the same number."""
    import config

    assert config.MAX_SEQ_LEN == 2**20


def test_huge_max_seq_len_stops_train_py_with_one_line(capsys, tmp_path: Path) -> None:
    """It used to pass validation and die building the rotary table (an 8 TiB allocation traceback)."""
    import train

    assert train.main([f"logging.run_dir={tmp_path}", "model.max_seq_len=1099511627776"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: invalid configuration: model.max_seq_len=1099511627776 must be in [1, 1048576]") \
        and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("overrides, lines", [
    (["train.lr=0"], ["error: invalid configuration: train.lr=0.0 must be > 0"]),
    (["parallel.pp=2"], ["error: impossible parallel layout: world size 1 is not divisible by parallel.tp=1 x "
                         "parallel.pp=2 = 2"]),
    (["train.lr=0", "model.norm=batchnorm"], ["error: invalid configuration:",
                                              "  - model.norm='batchnorm' is not one of ['rmsnorm', 'layernorm']",
                                              "  - train.lr=0.0 must be > 0"]),
], ids=["one_value", "one_layout_problem", "two_values"])
def test_one_bad_value_is_one_line_several_are_a_header_and_a_line_each(capsys, tmp_path: Path, overrides,
                                                                        lines) -> None:
    """It was two lines for one value (the header, then the value's line); the run directory is not made."""
    import train

    assert train.main([f"logging.run_dir={tmp_path / 'run'}", *overrides]) == 2
    assert capsys.readouterr().err.splitlines() == lines
    assert not (tmp_path / "run").exists()


# ---- --help ----------------------------------------------------------------------------------------

def test_describe_lists_every_leaf_key_with_its_docstring() -> None:
    lines = describe()
    expected = _leaf_keys(OmegaConf.to_container(OmegaConf.structured(Config)))
    assert len(expected) > 50
    keyed = {}
    for line in lines:
        key = line.strip().split(" ", 1)[0]
        keyed[key] = line
    assert sorted(keyed) == sorted(expected)
    assert len(lines) == len(expected)
    for key, line in keyed.items():
        doc = line.split("): ", 1)[1] if "): " in line else ""
        assert doc.strip(), f"{key} has no docstring in describe(): {line!r}"
    # spot checks against the docstrings written in the source
    assert keyed["model.d_model"].endswith("Hidden size.")
    assert "default 128" in keyed["model.d_model"]
    assert keyed["parallel.pp"].endswith("Pipeline-parallel size (outermost).")
    assert keyed["logging.wandb.mode"].endswith("online | offline | disabled.")
    assert keyed["precision"].startswith("  precision (str, default 'fp32'): fp32 | bf16")


def test_config_is_a_plain_dataclass_tree() -> None:
    cfg = load_config(None, ["model.d_model=64"])
    assert dataclasses.asdict(cfg)["model"]["d_model"] == 64


def test_a_malformed_override_value_is_one_line_naming_it():
    """``model.n_layers=[x`` is not YAML: a ConfigError naming the override (train.py prints it as one line), not
    yaml's traceback."""
    from config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"override 'model.n_layers=\[x' is not a valid YAML value") as info:
        load_config(None, ["train.max_steps=3", "model.n_layers=[x"])
    assert "\n" not in str(info.value)


def test_numbers_in_string_settings_keep_their_text_in_files_lists_and_nested_overrides(tmp_path: Path) -> None:
    """A string setting written as a number keeps the text as written wherever it is written: in a YAML file
    (``name: 007`` was '7', ``1e3`` was '1000.0'), in a list (``data.paths=[007, 1e3]`` was ['7', '1000.0']) and in
    a nested override; settings that are numbers stay numbers."""
    (tmp_path / "s.yaml").write_text("logging:\n  wandb:\n    name: 007\n    project: 1e3\n"
                                     "data:\n  paths: [007, 1e3, 0x1F, corpus]\n  weights: [1e0, 3, 0.5, 2]\n"
                                     "train:\n  lr: 1e-3\n")
    cfg = load_config(str(tmp_path / "s.yaml"))
    assert (cfg.logging.wandb.name, cfg.logging.wandb.project) == ("007", "1e3")
    assert cfg.data.paths == ["007", "1e3", "0x1F", "corpus"]
    assert cfg.data.weights == [1.0, 3.0, 0.5, 2.0] and cfg.train.lr == 1e-3  # numbers where numbers are meant
    cfg = load_config(None, ["data.paths=[007, 1e3]", "logging.wandb={name: 0x10, project: 010}"])
    assert cfg.data.paths == ["007", "1e3"]
    assert (cfg.logging.wandb.name, cfg.logging.wandb.project) == ("0x10", "010")
    # and the file's texts are what an override of the same key gives
    assert load_config(str(tmp_path / "s.yaml"), ["data.paths=[1e3]"]).data.paths == ["1e3"]


def test_yaml_booleans_in_string_settings(tmp_path: Path) -> None:
    """YAML 1.1 reads unquoted off/on/yes/no as booleans (and 007 as 7), which a string setting would turn into
    'False' ('7'): an override keeps the text as typed, a file's off/on goes where the setting takes it, anything
    else is an error that names the file and the key (train.py once refused ``model.activation_checkpointing=off``)."""
    for word in ("off", '"off"'):
        cfg = load_config(None, [f"model.activation_checkpointing={word}"])
        assert cfg.model.activation_checkpointing == "off"
        validate_config(cfg)
    assert load_config(None, ["data.tokenizer=no"]).data.tokenizer == "no"
    assert load_config(None, ["logging.wandb.name=007"]).logging.wandb.name == "007"  # not YAML's 7
    assert load_config(None, ["logging.wandb.name=1e3"]).logging.wandb.name == "1e3"  # not '1000.0'
    assert load_config(None, ['logging.wandb.name="quoted"']).logging.wandb.name == "quoted"
    assert load_config(None, ["train.compile=false"]).train.compile is False  # a real boolean stays one
    (tmp_path / "a.yaml").write_text("model:\n  activation_checkpointing: off\n")
    assert load_config(str(tmp_path / "a.yaml")).model.activation_checkpointing == "off"
    (tmp_path / "b.yaml").write_text("precision: no\n")
    with pytest.raises(ConfigError, match=r"b\.yaml: precision is a string but YAML read its value as the boolean"):
        load_config(str(tmp_path / "b.yaml"))


def test_checkpoint_async_is_an_alias_of_async_save(tmp_path):
    """``checkpoint.async`` (the issue's and torchtitan's spelling; a Python keyword, so not a field name) sets
    ``checkpoint.async_save``, in an override and in a YAML file; both in one file is an error naming both."""
    from config import ConfigError, load_config

    assert load_config(None, ["checkpoint.async=true"]).checkpoint.async_save is True
    assert load_config(None, []).checkpoint.async_save is False
    f = tmp_path / "c.yaml"
    f.write_text("checkpoint:\n  async: true\n")
    assert load_config(str(f), []).checkpoint.async_save is True
    f.write_text("checkpoint:\n  async: true\n  async_save: false\n")
    with pytest.raises(ConfigError, match="checkpoint.async and checkpoint.async_save are the same setting"):
        load_config(str(f), [])
