"""The shipped experiment configs: they load, validate, fit the layout they document, and are what they say.

Each YAML in configs/ documents its intended launch in its header::

    # world_size: 32
    # ranks_per_node: 8

and ``make_layout`` must accept the config at exactly that launch.
"""
import re
import subprocess
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from config import Config, load_config, to_dict, validate_config
from data.tokenizer import Tokenizer
from model.flops import parameter_count
from parallel.layout import make_layout

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
PLACEHOLDER = "/path/to/"

# name -> nominal parameter count (the 7B preset is the 6.7B GPT-3 / LLaMA-7B shape)
PRESETS = {"gpt_125m": 125e6, "gpt_350m": 350e6, "gpt_1.3b": 1.3e9, "gpt_7b": 6.7e9, "gpt_13b": 13e9,
           "gpt_175b": 175e9}


def header_int(path: Path, key: str) -> int:
    m = re.search(rf"^#\s*{key}:\s*(\d+)\s*$", path.read_text(), re.M)
    assert m, f"{path.name}: the header has no '# {key}: N' line"
    return int(m.group(1))


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def test_every_preset_is_shipped():
    names = {p.stem for p in CONFIGS}
    assert {"tiny", *PRESETS} <= names, f"missing configs: {sorted({'tiny', *PRESETS} - names)}"


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_config_loads_validates_and_fits_its_layout(path):
    cfg = load_config(str(path))
    validate_config(cfg)
    world, rpn = header_int(path, "world_size"), header_int(path, "ranks_per_node")
    layout = make_layout(cfg, world, rpn)
    assert layout.tp * layout.pp * layout.dp == world
    assert layout.ranks_per_node == min(rpn, world)


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_data_paths_exist_or_are_marked_placeholders(path):
    """A config either runs as-is (files present, tokenizer fits the vocabulary) or points at /path/to/... to edit."""
    cfg = load_config(str(path))
    for prefix in cfg.data.paths:
        if prefix.startswith(PLACEHOLDER):
            continue
        for ext in (".bin", ".idx"):
            assert (ROOT / (prefix + ext)).is_file(), f"{path.name}: data.paths entry {prefix}{ext} does not exist"
    if not cfg.data.tokenizer.startswith(PLACEHOLDER):
        tok = Tokenizer(str(ROOT / cfg.data.tokenizer))
        assert tok.vocab_size <= cfg.model.vocab_size, f"{path.name}: tokenizer larger than model.vocab_size"


def test_tiny_is_exactly_the_defaults():
    """tiny.yaml spells out every schema key, each at its default: the default job and the file cannot drift."""
    path = ROOT / "configs" / "tiny.yaml"
    defaults = _flat(to_dict(Config()))
    written = _flat(OmegaConf.to_container(OmegaConf.load(path)))
    assert sorted(written) == sorted(defaults), (
        f"tiny.yaml keys differ from the schema: missing {sorted(set(defaults) - set(written))}, "
        f"unknown {sorted(set(written) - set(defaults))}")
    loaded = _flat(to_dict(load_config(str(path))))
    diffs = {k: (loaded[k], v) for k, v in defaults.items() if loaded[k] != v}
    assert not diffs, f"tiny.yaml differs from the schema defaults (yaml, default): {diffs}"
    assert load_config(str(path)) == Config()


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_parameter_count_matches_its_name(name):
    cfg = load_config(str(ROOT / "configs" / f"{name}.yaml"))
    total = parameter_count(cfg.model)["total"]
    nominal = PRESETS[name]
    assert abs(total - nominal) <= 0.1 * nominal, f"{name}: {total / 1e9:.3f}B parameters, nominal {nominal / 1e9}B"


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_are_realistic(name):
    cfg = load_config(str(ROOT / "configs" / f"{name}.yaml"))
    assert cfg.model.seq_len == 2048 and cfg.precision == "bf16"
    assert cfg.model.vocab_size in (32000, 50304)
    assert cfg.train.global_batch_size * cfg.model.seq_len >= 2 ** 19  # >= 0.5M tokens per step
    assert 0 < cfg.train.warmup_steps < (cfg.train.decay_steps or cfg.train.max_steps) <= cfg.train.max_steps
    if cfg.model.n_layers * cfg.model.d_model ** 2 * 12 > 5e9:
        assert cfg.model.activation_checkpointing != "off", f"{name}: large models need activation checkpointing"
    if cfg.parallel.tp > 1:
        assert cfg.parallel.sequence_parallel, f"{name}: tp > 1 without sequence parallelism"


def test_sbatch_script_is_valid_bash():
    script = ROOT / "scripts" / "slurm" / "train.sbatch"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    for option in ("--ntasks-per-node=8", "--gpus-per-node=8", "--signal=B:USR1@180", "--requeue",
                   "--open-mode=append", "--cpus-per-task"):
        assert re.search(rf"^#SBATCH .*{re.escape(option)}", text, re.M), f"train.sbatch lacks #SBATCH {option}"
    assert "srun --kill-on-bad-exit=1" in text and "train.py" in text
