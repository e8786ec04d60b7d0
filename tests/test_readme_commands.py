"""Every ``python train.py ...`` and ``torchrun ... train.py ...`` line in README.md's code blocks works as written.

The lines are read from README.md itself (backslash continuations joined, ``# comments`` dropped), so a new or
edited example is covered without touching this file. Each one is handled in one of two ways:

* **run**, on this machine: every single-machine line of the tiny default model. The first ``torchrun
  --nproc-per-node N`` line runs as ``python -m torch.distributed.run --standalone --nproc-per-node N`` (a free
  rendezvous port chosen by the OS); the others run ``train.main`` on N ranks forked with torchrun's environment
  by tests/dist_harness.py (the launch is the same for every line; N fresh interpreters cost ~3 CPU-s each).
  Appended to the README's own overrides, and only ever shortening the run: ``train.max_steps`` (1, or the
  line's ``zero.quant_error_interval``, so that the sampling it asks for happens once), ``train.eval_iters=1``,
  ``logging.run_dir`` (a fresh directory; checkpoints go under it) and ``logging.wandb.mode=disabled``. A later
  dotlist value wins, so the test checks that the README line sets none of these but the step count and the
  directories, and that the run's saved ``config.yaml`` holds every value the README line gives; a run reaches
  its last step, writes a finite loss, and writes the record of an interval the line sets.
  The lines run in a scratch directory that links ``train.py``, ``scripts/``, ``configs/`` and ``data/`` from
  the repository and gives the README's stand-ins for the reader's own files real contents: ``my_corpus`` and
  ``tok.model`` are the bundled sample corpus and tokenizer, ``path/to/llama`` a tiny random Llama saved by
  transformers, and ``ckpt/llama`` what the README's own ``scripts/import_hf.py`` line makes of it.
* **validated** only: a line with a ``--config configs/gpt_*.yaml`` preset (a real model: one step on 2 CPU
  cores would take hours) and a multi-node line (``--nnodes M`` > 1). Everything train.py checks before any
  process group exists is run in-process, at the line's own launch: the --config file check, load_config,
  validate_config, make_layout at world size M x N with N ranks per node (1 x 1 for ``python``) and the data
  and tokenizer check.

A command that fails shows its exit code and the tail of its output.
"""
from __future__ import annotations

import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional

import pytest
import yaml

from tests.test_configs import _flat  # a nested mapping as dotted keys

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
TIMEOUT_S = 300  # per command; a 4-rank 1-step run takes ~10 s on 2 idle cores, ~25 s on a busy machine
APPENDED = {"train.max_steps", "train.eval_iters", "logging.run_dir", "logging.wandb.mode"}
README_MAY_SET = {"train.max_steps", "logging.run_dir", "checkpoint.dir"}  # what the appended keys may override
# An interval the line sets whose event happens only at multiples of it (validation and the final save happen at
# the last step anyway): the run goes that many steps, and the record it writes must be there.
INTERVAL_RECORDS = {"zero.quant_error_interval": "quant_error"}
MAX_STEPS = 20


class Command(NamedTuple):
    line: str  # as README.md shows it (continuations joined, comment and commands chained before it dropped)
    launcher: str  # python | torchrun
    nnodes: int
    nproc: int
    args: List[str]  # after train.py

    @property
    def config(self) -> Optional[str]:
        return self.args[self.args.index("--config") + 1] if "--config" in self.args else None

    @property
    def overrides(self) -> List[str]:
        if "--config" not in self.args:
            return list(self.args)
        at = self.args.index("--config")
        return self.args[:at] + self.args[at + 2:]

    @property
    def validate_only(self) -> bool:
        return self.nnodes > 1 or bool(self.config and re.fullmatch(r"configs/gpt_.*\.yaml", self.config))


def code_lines(text: str) -> List[str]:
    """The lines of the fenced code blocks, continuations joined."""
    lines = []
    for block in re.findall(r"^```[^\n]*\n(.*?)^```", text, re.S | re.M):
        lines += re.sub(r"\\\n\s*", " ", block).splitlines()
    return lines


def parse(line: str) -> List[Command]:
    """The train.py commands of one README line (a line may chain commands with &&)."""
    tokens = shlex.split(line, comments=True)
    segments, current = [], []
    for t in tokens:
        if t in ("&&", ";", "||"):
            segments.append(current)
            current = []
        else:
            current.append(t)
    segments.append(current)
    commands = []
    for seg in segments:
        if "train.py" not in seg or seg[0] not in ("python", "torchrun"):
            continue
        at = seg.index("train.py")
        launcher_args, nnodes, nproc = seg[1:at], 1, 1
        if seg[0] == "python":
            assert not launcher_args, f"README line {line!r}: python options before train.py"
        else:
            it = iter(launcher_args)
            for opt in it:
                if opt in ("--nproc-per-node", "--nproc_per_node"):
                    nproc = int(next(it))
                elif opt == "--nnodes":
                    nnodes = int(next(it))
                elif opt != "...":  # the README's stand-in for a cluster's rendezvous options
                    raise AssertionError(f"README line {line!r}: torchrun option {opt} is unknown to this test")
            assert nnodes > 1 or "..." not in launcher_args, f"README line {line!r}: '...' in a one-machine line"
        commands.append(Command(" ".join(seg), seg[0], nnodes, nproc, seg[at + 1:]))
    return commands


def readme_commands() -> List[Command]:
    return [c for line in code_lines(README.read_text()) for c in parse(line)]


COMMANDS = readme_commands()


def test_the_readme_has_the_commands_this_test_expects():
    """The extraction finds the examples (a broken regex must not make the test below vacuous)."""
    assert len(COMMANDS) >= 14
    assert any(c.launcher == "python" and not c.args for c in COMMANDS)  # the very first command
    assert sum(c.launcher == "torchrun" and not c.validate_only for c in COMMANDS) >= 9
    assert any(c.nnodes > 1 for c in COMMANDS) and any(c.config == "configs/gpt_125m.yaml" for c in COMMANDS)
    assert parse("torchrun --nnodes 4 --nproc-per-node 8 ... train.py a=1 b=2   # x") == [
        Command("torchrun --nnodes 4 --nproc-per-node 8 ... train.py a=1 b=2", "torchrun", 4, 8, ["a=1", "b=2"])]
    assert parse("pip install x && python train.py --config c.yaml k=v") == [
        Command("python train.py --config c.yaml k=v", "python", 1, 1, ["--config", "c.yaml", "k=v"])]


# ---- the scratch directory: the repository's files and the README's stand-ins for the reader's ----------------

@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("readme")
    for name in ("train.py", "scripts", "configs", "data"):
        (d / name).symlink_to(ROOT / name)
    for ext in (".bin", ".idx"):
        (d / f"my_corpus{ext}").symlink_to(ROOT / "data" / "sample" / f"sample_text_document{ext}")
        (d / f"my_bpe_corpus{ext}").symlink_to(ROOT / "data" / "sample" / f"bpe_text_document{ext}")
    (d / "tok.model").symlink_to(ROOT / "data" / "sample" / "tokenizer.model")
    return d


def _import_line() -> str:
    lines = [line for line in code_lines(README.read_text()) if re.match(r"python scripts/import_hf\.py ", line)]
    assert len(lines) == 1, f"README.md should show one scripts/import_hf.py line, found {lines}"
    return lines[0]


@pytest.fixture(scope="module")
def llama_import(scratch) -> Path:
    """path/to/llama: a tiny random Llama (the bundled tokenizer's vocabulary), imported by the README's line."""
    transformers = pytest.importorskip("transformers")
    import torch

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=128, tie_word_embeddings=False))
    target = scratch / "path" / "to" / "llama"
    model.save_pretrained(str(target))
    (target / "tokenizer.model").symlink_to(ROOT / "data" / "sample" / "tokenizer.model")
    p = _run(shlex.split(_import_line(), comments=True), scratch)
    assert p.returncode == 0, _tail(p)
    return scratch / "ckpt" / "llama"


def _env() -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
           and not k.startswith("SLURM_")}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _run(argv: List[str], cwd: Path) -> subprocess.CompletedProcess:
    """Run a README command (``python`` is this interpreter); on timeout kill its whole process group."""
    if argv[0] == "python":
        argv = [sys.executable, *argv[1:]]
    elif argv[0] == "torchrun":
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", *argv[1:]]
    proc = subprocess.Popen(argv, cwd=cwd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"{' '.join(argv)} did not finish in {TIMEOUT_S} s:\n{out[-2000:]}\n{err[-3000:]}")
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


FIRST_TORCHRUN = next(c for c in COMMANDS if c.launcher == "torchrun" and not c.validate_only)


def _run_forked(argv: List[str], nproc: int, cwd: Path) -> subprocess.CompletedProcess:
    """A ``torchrun --nproc-per-node N train.py ...`` line on N ranks forked by tests/dist_harness.py with
    torchrun's environment, instead of N fresh interpreters (~3 CPU-s each to import torch and the project).
    The README's first torchrun line runs under torchrun itself (``_run``), so the launch as written is covered
    once; every other line differs from it only in what train.py does with its arguments. Rank 0's output is
    the result's; a traceback on any rank is put into its stderr."""
    from tests.dist_harness import run_world, train_main

    args = argv[argv.index("train.py") + 1:]
    ranks = run_world(train_main, nproc, args, str(cwd), timeout=TIMEOUT_S, env={"OMP_NUM_THREADS": "1"})
    code = next((c for c, _, _ in ranks if c != 0), 0)
    err = ranks[0][2] + "".join(e for _, _, e in ranks[1:] if "Traceback" in e)
    return subprocess.CompletedProcess(["(forked ranks)", *argv], code, ranks[0][1], err)


def _tail(p: subprocess.CompletedProcess) -> str:
    return f"exit {p.returncode}: {' '.join(p.args)}\n--- stdout\n{p.stdout[-2000:]}\n--- stderr\n{p.stderr[-4000:]}"


def _key(override: str) -> str:
    return override.split("=", 1)[0]




# ---- the test ------------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("cmd", COMMANDS, ids=[c.line for c in COMMANDS])
def test_readme_command_works_as_written(cmd: Command, scratch, request, monkeypatch, tmp_path):
    if cmd.validate_only:
        _validate(cmd, scratch, monkeypatch)
        return
    own = [_key(o) for o in cmd.overrides]
    assert not (set(own) & APPENDED) - README_MAY_SET, f"the test's overrides would replace the README's {own}"
    if "ckpt/llama" in cmd.line:
        request.getfixturevalue("llama_import")
    intervals = {_key(o): int(o.split("=", 1)[1]) for o in cmd.overrides if _key(o) in INTERVAL_RECORDS}
    steps = max([1, *intervals.values()])
    assert steps <= MAX_STEPS, f"{intervals}: this test would run {steps} steps; keep README intervals small"
    run_dir = tmp_path / "run"
    argv = [cmd.launcher]
    if cmd.launcher == "torchrun":
        argv += ["--nproc-per-node", str(cmd.nproc)]
    argv += ["train.py", *cmd.args, f"train.max_steps={steps}", "train.eval_iters=1", f"logging.run_dir={run_dir}",
             "logging.wandb.mode=disabled"]
    if cmd.launcher == "torchrun" and cmd != FIRST_TORCHRUN:
        p = _run_forked(argv, cmd.nproc, scratch)
    else:
        p = _run(argv, scratch)
    assert p.returncode == 0, _tail(p)
    assert f"stopped at step {steps} (max_steps)" in p.stdout, _tail(p)
    assert f"[train] world={cmd.nproc} " in p.stdout, _tail(p)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in records if "loss" in r][-1]
    assert last["step"] == steps and math.isfinite(last["loss"]), records
    for key, every in intervals.items():  # what the line's interval asks for did happen
        assert every < 1 or any(INTERVAL_RECORDS[key] in r for r in records), (key, records)
    # the run used the README's settings: each value it gives is in the config the run saved
    saved = _flat(yaml.safe_load((run_dir / "config.yaml").read_text()))
    for o in cmd.overrides:
        key, value = o.split("=", 1)
        if key in README_MAY_SET:
            continue
        assert key in saved and yaml.safe_load(value) == saved[key], (o, saved.get(key))
    assert "Traceback" not in p.stderr, _tail(p)


def _validate(cmd: Command, scratch: Path, monkeypatch) -> None:
    """What train.py checks before any process group exists, at the command's own launch."""
    import train
    from config import load_config, validate_config
    from parallel.layout import make_layout
    from training.trainer import check_data

    monkeypatch.chdir(scratch)
    if cmd.config:
        train.check_config_file(cmd.config)
    cfg = load_config(cmd.config, cmd.overrides)
    validate_config(cfg)
    layout = make_layout(cfg, cmd.nnodes * cmd.nproc, cmd.nproc)
    assert layout.world_size == cmd.nnodes * cmd.nproc
    if not any(prefix.startswith("/path/to/") for prefix in cfg.data.paths):
        check_data(cfg)
