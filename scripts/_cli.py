"""How every script under ``scripts/`` reports bad input: one line ``error: <what is wrong>`` on stderr and exit
code 2, never a traceback (the convention of ``train.py``). Each script ends with::

    if __name__ == "__main__":
        from _cli import run  # scripts/ is sys.path[0] when a script runs

        sys.exit(run(main))

:func:`run` calls ``main`` and turns the project's input errors into that line: ``config.ConfigError``,
``data.indexed.DataError``, ``training.checkpoint.CheckpointError``, ``model.hf.HFError``,
``parallel.launch.LaunchError``, :class:`InputError` (a script's own), a missing, unreadable or misplaced
file (``FileNotFoundError``, ``IsADirectoryError``, ``NotADirectoryError``, ``PermissionError``,
``FileExistsError``, any ``OSError`` naming a file), text that is not UTF-8, malformed JSON or YAML and
omegaconf's errors. Anything else is a bug and keeps its traceback. argparse's usage errors (a missing or
unknown option, a value of the wrong type) become the same one line, still with exit code 2.

The checks the scripts share: :func:`config_file` (``--config``, read exactly as train.py reads it),
:func:`load_config` (that, then the overrides, a malformed one named),
:func:`preset` (``--preset NAME``: ``configs/NAME.yaml`` or a YAML path), :func:`output_file` /
:func:`output_dir` (a place a script writes to, checked before any work) and :func:`at_least`.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # the application runs from the repository root (like Megatron-LM)
# One module under both names: a script imports it as ``_cli`` (scripts/ is sys.path[0]) or as ``scripts._cli``
# (with the root on sys.path); two copies would have two InputError classes, and one would not be caught.
for _name in ("_cli", "scripts._cli"):
    sys.modules.setdefault(_name, sys.modules[__name__])


class InputError(ValueError):
    """Bad input found by a script itself (an option's value, a file's content): one line, exit code 2."""


# (module, class) of the project's input errors; looked up only in modules already imported (one that is not
# imported cannot have raised), so that a script failing early does not import torch for this
_PROJECT_ERRORS: Tuple[Tuple[str, str], ...] = (
    ("config", "ConfigError"),
    ("data.indexed", "DataError"),
    ("training.safe_load", "CheckpointError"),  # training.checkpoint.CheckpointError
    ("model.hf", "HFError"),
    ("parallel.launch", "LaunchError"),
    ("yaml", "YAMLError"),
    ("omegaconf.errors", "OmegaConfBaseException"),
)
_OS_ERRORS = (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError, FileExistsError)


def input_error_types() -> Tuple[type, ...]:
    types: List[type] = [InputError, UnicodeDecodeError, json.JSONDecodeError, *_OS_ERRORS]
    for module, name in _PROJECT_ERRORS:
        cls = getattr(sys.modules.get(module), name, None)
        if isinstance(cls, type):
            types.append(cls)
    return tuple(types)


def is_input_error(e: BaseException) -> bool:
    if isinstance(e, OSError) and e.filename is not None:  # e.g. a read-only file system, a full disk
        return True
    return isinstance(e, input_error_types())


def message(e: BaseException) -> str:
    """What is wrong, on one line, naming the file where the exception knows it."""
    if isinstance(e, OSError) and e.filename is not None:
        text = f"{os.fsdecode(e.filename)}: {e.strerror or e}"
        if e.filename2 is not None:
            text += f" ({os.fsdecode(e.filename2)})"
    elif isinstance(e, UnicodeDecodeError):
        text = f"not UTF-8 text (byte {e.start}: {e.reason})"
    elif isinstance(e, json.JSONDecodeError):
        text = f"malformed JSON ({e.msg} at line {e.lineno}, column {e.colno})"
    elif type(e).__module__.startswith("yaml"):
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        name = f" {mark.name}" if mark is not None and mark.name and not mark.name.startswith("<") else ""
        text = f"malformed YAML{name}{where}: {getattr(e, 'problem', None) or e}"
    else:
        text = str(e) or type(e).__name__
    return " ".join(text.split())


def _usage_error(self: argparse.ArgumentParser, text: str):
    """argparse's error(): the usage and the message as one line (exit code 2, as argparse's own)."""
    self.exit(2, f"error: {' '.join(text.split())} (usage: {self.prog} --help)\n")


def run(main: Callable[..., Optional[int]], argv: Optional[Sequence[str]] = None) -> int:
    """``main(argv)`` (``main()`` without argv) with bad input as ``error: ...`` on stderr and exit code 2."""
    argparse.ArgumentParser.error = _usage_error  # type: ignore[method-assign]  # this process is the script's
    try:
        code = main() if argv is None else main(list(argv))
    except BrokenPipeError:  # the reader of stdout went away (``| head``): stop quietly, as a shell tool does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except Exception as e:  # noqa: BLE001 - re-raised unless it is bad input
        if not is_input_error(e):
            raise
        print(f"error: {message(e)}", file=sys.stderr, flush=True)
        return 2
    return 0 if code is None else int(code)


# ---- shared checks ------------------------------------------------------------------------------------


def config_file(path: str, option: str = "--config") -> str:
    """``path`` as train.py checks its ``--config`` (a readable UTF-8 YAML mapping, not a directory), then
    loaded by ``config.load_config`` (a missing file: "config file not found"); ConfigError naming it."""
    from config import ConfigError, load_config
    from train import check_config_file

    try:
        check_config_file(path)
        load_config(path, [])
    except ConfigError as e:
        text = str(e)
        raise ConfigError(text.replace("--config ", f"{option} ", 1) if option != "--config" else text) from None
    return path


def load_config(path: Optional[str], overrides: Sequence[str] = (), option: str = "--config"):
    """``config.load_config(path, overrides)`` after :func:`config_file`; an override that is not valid YAML
    (``model.n_layers=[2``) is a ConfigError naming it (omegaconf lets yaml's own error through)."""
    from config import ConfigError
    from config import load_config as load

    if path:
        config_file(path, option)
    try:
        return load(path, list(overrides))
    except Exception as e:  # noqa: BLE001 - only yaml's errors are translated
        if not type(e).__module__.startswith("yaml"):
            raise
        from omegaconf import OmegaConf

        for override in overrides:
            try:
                OmegaConf.from_dotlist([override])
            except Exception as bad:  # noqa: BLE001
                if type(bad).__module__.startswith("yaml"):
                    raise ConfigError(f"override {override!r} is not valid YAML: "
                                      f"{getattr(bad, 'problem', None) or message(bad)}") from None
        raise ConfigError(f"invalid overrides {list(overrides)}: {message(e)}") from None


def preset(name: str, option: str = "--preset") -> str:
    """The YAML file of ``--preset NAME``: ``configs/NAME.yaml``, or ``NAME`` itself when it is a path (it has a
    directory part or a .yaml/.yml suffix); checked as :func:`config_file`."""
    if os.sep in name or (os.altsep and os.altsep in name) or name.endswith((".yaml", ".yml")):
        path = name
    else:
        path = str(ROOT / "configs" / f"{name}.yaml")
        if not os.path.isfile(path):
            known = sorted(p.stem for p in (ROOT / "configs").glob("*.yaml"))
            raise InputError(f"{option} {name}: no such preset (configs/{name}.yaml); the presets are "
                             f"{', '.join(known)}, or give a YAML file's path")
    if not os.path.exists(path):
        raise InputError(f"{option} {name}: no such file")
    return config_file(path, option)


def _existing_ancestor(path: Path) -> Path:
    p = path.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def output_dir(path: str, option: str) -> Path:
    """A directory a script writes into (created later, parents included): it is a directory or can be made
    one (no regular file in the way)."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise InputError(f"{option} {path} is a file, not a directory")
    base = _existing_ancestor(p)
    if not base.is_dir():
        raise InputError(f"{option} {path} cannot be created: {base} is a file, not a directory")
    return p


def output_file(path: str, option: str, make_parents: bool = False) -> Path:
    """A file a script writes at its end, checked before the work that leads to it: not a directory, and its
    directory exists (or, with ``make_parents``, can be made)."""
    p = Path(path)
    if p.is_dir():
        raise InputError(f"{option} {path} is a directory; give a file name")
    parent = p.absolute().parent
    if not make_parents and not parent.is_dir():
        why = "is a file" if parent.exists() else "does not exist"
        raise InputError(f"{option} {path}: its directory {parent} {why}")
    if make_parents:
        base = _existing_ancestor(parent)
        if not base.is_dir():
            raise InputError(f"{option} {path} cannot be written: {base} is a file, not a directory")
    return p


def check_run_data(cfg) -> None:
    """The data and tokenizer a config names, read as its runs will read them: from the repository root (where
    the scripts start train.py), so relative paths mean the same; DataError (one line) otherwise."""
    from training.trainer import check_data  # torch and the model: only once the options are checked

    here = os.getcwd()
    os.chdir(ROOT)
    try:
        check_data(cfg)
    finally:
        os.chdir(here)


def parsed_lines(lines: List[bytes], parse, path, error, torn: str, on_warning):
    """Each non-blank line of a JSON-lines file (``lines``), decoded by ``parse`` (a ValueError saying what is
    wrong). A bad last line after good ones is what a writer killed mid-line leaves: skipped, with ``on_warning``
    of ``torn`` (formatted with ``e``, the reason, and ``n``, the good lines before it); a bad line anywhere else
    raises ``error`` naming the file and line."""
    filled = [i for i, line in enumerate(lines) if line.strip()]
    n = 0
    for i in filled:
        try:
            item = parse(lines[i])
        except ValueError as e:
            if i == filled[-1] and n:
                on_warning(f"warning: {path}:{i + 1}: " + torn.format(e=e, n=n))
                return
            raise error(f"{path}:{i + 1}: {e}") from None
        n += 1
        yield item


def json_line(line: bytes):
    """One line of a JSON-lines file (a trace, metrics.jsonl) decoded; ValueError saying what is wrong with it
    (binary data, malformed JSON): the reader names the file and line."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"binary data, not a JSON line (byte {e.start + 1} of the line is not UTF-8)") from None
    if "\x00" in text:
        raise ValueError("binary data, not a JSON line (NUL bytes)")
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("malformed JSON line (nested too deeply)") from None
    except ValueError as e:
        raise ValueError(f"malformed JSON line ({e})") from None


def at_least(value: float, least: float, option: str) -> None:
    if value < least:
        raise InputError(f"{option} must be at least {least}, got {value}")


def run_trainer(cmd: Sequence[str], name: str, cwd: Path, env: Optional[dict] = None) -> None:
    """One trainer run of a benchmark or convergence script: train.py's bad input (exit code 2) becomes this
    script's InputError (its one line, named by the run); any other failure ends the script with its stderr."""
    p = subprocess.run(list(cmd), cwd=cwd, capture_output=True, text=True, env=env)
    if p.returncode == 2:
        errors = [line for line in p.stderr.splitlines() if line.startswith("error")]
        raise InputError(f"{name}: {errors[-1] if errors else p.stderr.strip()[-300:]}")
    if p.returncode != 0:
        raise SystemExit(f"{name} failed (exit {p.returncode}):\n{p.stderr[-3000:]}")


def metrics_records(run_dir: Path) -> List[dict]:
    """A finished run's metrics.jsonl, one dict a line."""
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]

