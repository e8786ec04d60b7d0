"""Loading: defaults < YAML file < command-line dotlist through omegaconf's structured configs, and the way back
(dict, YAML, ``--help`` lines)."""
from __future__ import annotations

import dataclasses
import functools
import io
import os
import typing
from typing import List, Optional

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from config.schema import CHOICES, MAX_CONFIG_BYTES, Config, ConfigError


ALIASES = {"checkpoint.async": "checkpoint.async_save"}
"""Keys accepted under another name: ``async`` is a Python keyword, so the field is ``async_save``."""


def _aliases(layer) -> None:
    """Rename each alias in one layer (a YAML file or one override) to its field; both in one layer is an error."""
    for alias, key in ALIASES.items():
        section, _, name = alias.rpartition(".")
        node = OmegaConf.select(layer, section)
        if node is None or not isinstance(node, DictConfig) or name not in node:
            continue
        if key.rpartition(".")[2] in node:
            raise ConfigError(f"{alias} and {key} are the same setting: give one of them")
        value = node[name]
        del node[name]
        OmegaConf.update(layer, key, value)


def load_config(yaml_path: Optional[str] = None, overrides: Optional[List[str]] = None) -> Config:
    """Defaults < YAML < dotlist overrides, type-checked by omegaconf, then returned as dataclasses."""
    base = OmegaConf.structured(Config)
    layers = []
    try:
        if yaml_path is not None:
            check_config_size(yaml_path)
            with open(yaml_path, encoding="utf-8") as f:  # read once: omegaconf's values, and YAML's nodes
                text = f.read()
            layers.append(OmegaConf.load(io.StringIO(text)))
            _numbers_as_written(layers[0], yaml.compose(text, Loader=yaml.SafeLoader), "")
        if overrides:
            bad = [o for o in overrides if "=" not in o]
            if bad:
                raise ConfigError(f"overrides must look like key=value, got {bad}")
            for o in overrides:  # one at a time: a malformed value (``key=[x``) is named with its override
                try:
                    layer = OmegaConf.from_dotlist([o])
                except yaml.YAMLError as e:
                    reason = " ".join(str(getattr(e, "problem", None) or e).split())
                    raise ConfigError(f"override {o!r} is not a valid YAML value ({reason})") from None
                key, text = o.split("=", 1)
                key = key.strip()
                if key in _string_keys() and isinstance(OmegaConf.select(layer, key), (bool, int, float)):
                    # a string setting is the text as typed: ``off`` (not YAML 1.1's False), ``007`` (not 7)
                    OmegaConf.update(layer, key, text.strip())
                else:  # in a list or a mapping (``data.paths=[007, 1e3]``): numbers as written too
                    _numbers_as_written(layer, yaml.compose(text, Loader=yaml.SafeLoader), key)
                layers.append(layer)
        if yaml_path is not None:
            _string_booleans(layers[0], yaml_path)
        for layer in layers:
            _aliases(layer)
        merged = OmegaConf.merge(base, *layers)
        cfg = OmegaConf.to_object(merged)
    except FileNotFoundError as e:
        raise ConfigError(f"config file not found: {yaml_path}") from e
    except OmegaConfBaseException as e:
        where = f" in {yaml_path}" if yaml_path else ""
        raise ConfigError(f"invalid config{where}: {_omegaconf_message(e)}") from None
    except yaml.YAMLError as e:  # omegaconf's loader: a duplicated key, an alias (anchors expand to any size), ...
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = " ".join(str(getattr(e, "problem", None) or e).split()).split(" See https")[0]
        raise ConfigError(f"invalid config in {yaml_path}{at}: {problem}") from None
    assert isinstance(cfg, Config)
    return cfg


def check_config_size(path: str) -> None:
    """A config file larger than ``MAX_CONFIG_BYTES`` is refused before YAML reads it (one line)."""
    try:
        size = os.path.getsize(path)
    except OSError:
        return  # missing or unreadable: the loader names it
    if size > MAX_CONFIG_BYTES:
        raise ConfigError(f"config file {path} is {size / 2**20:.1f} MiB; a config is at most "
                          f"{MAX_CONFIG_BYTES // 2**20} MiB (config.MAX_CONFIG_BYTES): is it the right file?")


def _keys_of(*types) -> frozenset:
    """Dotted keys of the schema's settings whose type is one of ``types``."""

    def walk(cls: type, prefix: str):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            t = hints[f.name]
            if dataclasses.is_dataclass(t):
                yield from walk(t, f"{prefix}{f.name}.")
            elif t in types:
                yield prefix + f.name

    return frozenset(walk(Config, ""))


@functools.lru_cache(maxsize=None)
def _string_keys() -> frozenset:
    """Dotted keys of the string settings (``str`` or ``Optional[str]``), from the schema (once)."""
    return _keys_of(str, Optional[str])


@functools.lru_cache(maxsize=None)
def _string_list_keys() -> frozenset:
    """Dotted keys of the list-of-strings settings (``List[str]`` or ``Optional[List[str]]``: data.paths)."""
    return _keys_of(List[str], Optional[List[str]])


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _numbers_as_written(layer, node, prefix: str) -> None:
    """In place: where YAML made a number of a string setting's value (``name: 007`` -> 7, ``1e3`` -> 1000.0, in a
    file, in a list ``paths: [007, 1e3]`` or a nested override), the text as written, read off the YAML nodes
    (``node``: the composed document of the keys under ``prefix``). Booleans are ``_string_booleans``' business."""
    for key in sorted(_string_keys() | _string_list_keys()):
        if prefix and key != prefix and not key.startswith(prefix + "."):
            continue
        at = node
        for part in (key[len(prefix):].lstrip(".").split(".") if key != prefix else []):
            if not isinstance(at, yaml.MappingNode):
                at = None
                break
            at = next((v for k, v in at.value if isinstance(k, yaml.ScalarNode) and k.value == part), None)
        value = OmegaConf.select(layer, key, default=None)
        if isinstance(at, yaml.ScalarNode) and _is_number(value):
            OmegaConf.update(layer, key, at.value, merge=False)
        elif isinstance(at, yaml.SequenceNode) and value is not None and not isinstance(value, (str, int, float)):
            items = list(value)
            fixed = [n.value if isinstance(n, yaml.ScalarNode) and _is_number(v) else v
                     for n, v in zip(at.value, items)]
            if fixed != items:
                OmegaConf.update(layer, key, fixed, merge=False)


def _string_booleans(layer, yaml_path: str) -> None:
    """A string setting written unquoted as ``off`` / ``on`` / ``yes`` / ``no`` / ``true`` / ``false`` in a YAML file
    reaches us as a boolean (YAML 1.1), and would become the string 'False'. Where the setting takes 'off' / 'on'
    (``model.activation_checkpointing: off``) that is what was meant; anywhere else the word is unknown: an error
    that asks for quotes."""
    for key in sorted(_string_keys()):
        value = OmegaConf.select(layer, key, default=None)
        if not isinstance(value, bool):
            continue
        word = "on" if value else "off"
        if word in CHOICES.get(key, ()):
            OmegaConf.update(layer, key, word)
        else:
            raise ConfigError(f"invalid config in {yaml_path}: {key} is a string but YAML read its value as the "
                              f"boolean {value}; write it in quotes ({key.rsplit('.', 1)[-1]}: \"...\")")


def _omegaconf_message(e: OmegaConfBaseException) -> str:
    key = getattr(e, "full_key", None)
    msg = str(e).splitlines()[0]
    return f"{key}: {msg}" if key and key not in msg else msg


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def describe(cls: type = Config, prefix: str = "") -> List[str]:
    """One line per field: dotted key, type, default, docstring (for --help)."""
    docs = _field_docs(cls)
    lines = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(hints[f.name]):
            lines.extend(describe(hints[f.name], key + "."))
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        tname = getattr(hints[f.name], "__name__", str(hints[f.name]).replace("typing.", ""))
        lines.append(f"  {key} ({tname}, default {default!r}): {docs.get(f.name, '')}")
    return lines


def _field_docs(cls: type) -> dict:
    """Attribute docstrings (the string literal under each field) read from the source."""
    import ast
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = nxt.value.value  # type: ignore[union-attr]
    return docs
