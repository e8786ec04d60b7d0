"""Every ``python ...``, ``python -m ...`` and ``torchrun ...`` line of README.md and docs/ works as written, or is
an explicit template.

Where the lines come from: the fenced code blocks of README.md and docs/**/*.md whose info string is empty or a
shell (``bash``, ``sh``, ``shell``, ``console``), backslash continuations joined. A line may chain commands with
``&&``, ``;`` or ``||``; each is handled on its own (``pip install ...``, ``bash ...``, ``apt-get ...`` are left to
the reader, except that a path they name must exist). A new or edited example is covered without touching this
file.

**Templates** (docs/testing.md explains them to readers): a command that cannot run here -- it needs GPUs, a
cluster, root, the network, minutes of CPU, or the reader's own paths -- is marked visibly, by a trailing comment
that starts with ``# template`` on its line, or by a block whose first line is such a comment (every command of
the block). A command that can only be a template (``torchrun --nnodes M`` with M > 1, a ``configs/gpt_*.yaml``
preset, ``sudo``, ``--device cuda``, ``device=cuda``) and is not marked fails the first test below.

What happens to each command:

* ``python train.py ...`` / ``torchrun --nproc-per-node N train.py ...`` (not a template): **run** on this
  machine, shortened to 2 steps (or to the line's ``zero.quant_error_interval``, so that the sampling it asks
  for happens once; a run that resumes a run directory of its block goes 2 steps further). Appended to the
  line's own overrides, and only ever shortening the run: ``train.max_steps``, ``train.eval_iters=1``,
  ``logging.wandb.mode=disabled`` and, when the line names none, ``logging.run_dir`` (a fresh directory). A later
  dotlist value wins, so the line may set none of these but the step count and the directories; a run reaches
  its last step, writes a finite loss and the record of an interval the line sets, and its saved
  ``config.yaml`` holds every value the line gives. The first ``python train.py`` line runs as a subprocess,
  the ``torchrun`` line with the fewest ranks (the first of them) as ``python -m torch.distributed.run
  --standalone`` (a free rendezvous port); the others run ``train.main`` on N ranks forked with torchrun's
  environment by tests/dist_harness.py (the launch is the same for every line; a fresh interpreter costs ~3
  CPU-s), except a line that sets environment variables (``VAR=value python train.py ...``), which runs as
  written.
* the same as a template, and ``sbatch ... scripts/slurm/train.sbatch CONFIG [key=value ...]``: **validated** --
  everything train.py checks before any process group exists, at the line's own launch (``--nnodes M
  --nproc-per-node N``; sbatch: ``--nodes`` x ``--ntasks-per-node``, 8 by default): the --config file check,
  load_config, validate_config, make_layout and the data and tokenizer check (unless the data is a
  ``/path/to/`` placeholder).
* ``python scripts/X.py ...``, ``python -m package.module ...`` (not a template): **run** as written in the
  block's directory; it must exit 0 without a traceback. It runs as ``python`` would run it (its sys.argv, a
  fresh interpreter's sys.path, the environment, exit status, tracebacks) in a process forked from
  tests/dist_harness.py's forkserver, which has torch imported, with the project's modules dropped
  (tests/as_python.py's ``run_as_python``: ~3 CPU-s less a line), except a line that sets
  environment variables, which runs as a subprocess.
* the same as a template: the script exists and every ``--option`` the line gives appears in its source.
* ``python -m pytest ...``: never run (this test is part of the suite); the paths it names exist and ``-n``
  has pytest-xdist.

**Blocks are scripts**: the commands of one block run top to bottom in one fresh directory, so a line may use
what an earlier line of its block made (a tokenizer, a preprocessed corpus, a run directory, an import). A block
whose commands equal an earlier block's (the README's recipes repeat blocks of docs/) runs once. The directory
links the repository's code (``train.py``, ``config/``, the packages, ``scripts/``, ``configs/``, the
requirements files) as a reader's checkout has it, and holds the stand-ins for the reader's own files:
``my_corpus.jsonl`` (the bundled corpus, uncompressed) and ``path/to/llama`` (a tiny random Llama saved by
transformers, with the bundled sentencepiece tokenizer).

A command that fails shows its file, line, exit code and the tail of its output.
"""
from __future__ import annotations

import gzip
import importlib.util
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional, Tuple

import pytest
import yaml

from tests.test_configs import _flat  # a nested mapping as dotted keys

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SHELL_INFO = {"", "bash", "sh", "shell", "console"}
TIMEOUT_S = 300  # per command; a 4-rank 2-step run takes ~10 s on 2 idle cores, ~25 s on a busy machine
APPENDED = {"train.max_steps", "train.eval_iters", "logging.run_dir", "logging.wandb.mode"}
LINE_MAY_SET = {"train.max_steps", "logging.run_dir", "checkpoint.dir"}  # of the keys the test appends
STEPS = 2
# An interval the line sets whose event happens only at multiples of it (validation and the final save happen at
# the last step anyway): the run goes that many steps, and the record it writes must be there.
INTERVAL_RECORDS = {"zero.quant_error_interval": "quant_error"}
MAX_STEPS = 20
REPO_FILE = re.compile(r"^(?:configs|scripts|data|tests|docs|model|parallel|fp8|kernels|training)/[\w./-]*\.(?:py|sh|"
                       r"yaml|yml|md|json|model|gz|sbatch|txt)$")
ENV_ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=")


class Command(NamedTuple):
    page: str  # README.md, docs/zero.md, ...
    lineno: int  # of the line's first physical line in the page
    line: str  # the command as the page shows it (continuations joined, comment and chained commands dropped)
    template: bool
    kind: str  # train | script | pytest | sbatch | other
    argv: List[str]  # after the environment assignments and sudo
    env: Dict[str, str]
    sudo: bool

    @property
    def where(self) -> str:
        return f"{self.page}:{self.lineno}: {self.line}"

    # ---- train.py lines ----
    def launch(self) -> Tuple[str, int, int, List[str]]:
        """(launcher, nnodes, nproc per node, train.py's arguments) of a train.py line."""
        a = self.argv
        at = a.index("train.py")
        if a[0] == "python":
            assert at == 1, f"{self.where}: python options before train.py"
            return "python", 1, 1, a[at + 1:]
        nnodes, nproc, it = 1, 1, iter(a[1:at])
        for opt in it:
            if opt in ("--nproc-per-node", "--nproc_per_node"):
                nproc = int(next(it))
            elif opt == "--nnodes":
                nnodes = int(next(it))
            elif opt != "...":  # the docs' stand-in for a cluster's rendezvous options
                raise AssertionError(f"{self.where}: torchrun option {opt} is unknown to this test")
        assert nnodes > 1 or "..." not in a[1:at], f"{self.where}: '...' in a one-machine line"
        return "torchrun", nnodes, nproc, a[at + 1:]

    # ---- sbatch lines ----
    def sbatch(self) -> Tuple[int, int, List[str]]:
        """(nodes, tasks per node, train.py's arguments) of ``sbatch ... scripts/slurm/train.sbatch CONFIG ...``."""
        a = self.argv
        at = a.index("scripts/slurm/train.sbatch")
        opts, nodes, per_node = a[1:at], 1, 8  # train.sbatch's header: --nodes=1, --ntasks-per-node=8
        for i, opt in enumerate(opts):
            key, _, value = opt.partition("=")
            if key in ("--nodes", "-N", "--ntasks-per-node"):
                n = int(value or opts[i + 1])
                nodes, per_node = (n, per_node) if key != "--ntasks-per-node" else (nodes, n)
        rest = a[at + 1:]
        assert rest, f"{self.where}: train.sbatch needs a config"
        return nodes, per_node, ["--config", *rest]

    def must_be_template(self) -> Optional[str]:
        """Why this command cannot run here, or None."""
        if self.sudo:
            return "it needs root"
        if "device=cuda" in self.argv or "--device cuda" in " ".join(self.argv):
            return "it needs a GPU"
        if self.kind == "train":
            _, nnodes, _, args = self.launch()
            if nnodes > 1:
                return "it needs several machines"
            if any(re.fullmatch(r"configs/gpt_.*\.yaml", x) for x in args):
                return "a preset's real model: one step on 2 CPU cores takes hours"
        if self.kind == "script" and self.argv[0] == "torchrun":
            return "this test runs torchrun lines of train.py only"
        return None


def _split_comment(line: str) -> Tuple[List[str], str]:
    """The line's words (shell quoting removed) and its trailing comment (a ``#`` that starts a word, outside
    quotes, starts it)."""
    quote, at = None, len(line)
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            at = i
            break
    return shlex.split(line[:at]), line[at:].lstrip("#").strip()


def _is_template_comment(comment: str) -> bool:
    return comment.lower().startswith("template")


def _classify(words: List[str]) -> Tuple[str, List[str], Dict[str, str], bool]:
    env = {}
    while words and ENV_ASSIGNMENT.match(words[0]):
        key, _, value = words[0].partition("=")
        env[key] = value
        words = words[1:]
    sudo = bool(words) and words[0] == "sudo"
    if sudo:
        words = words[1:]
    if not words:
        return "other", words, env, sudo
    if words[0] in ("python", "python3"):
        words = ["python", *words[1:]]
        if words[1:3] == ["-m", "pytest"]:
            return "pytest", words, env, sudo
        if len(words) > 1 and words[1] == "train.py" and not {"-h", "--help"} & set(words):
            return "train", words, env, sudo
        return "script", words, env, sudo
    if words[0] == "torchrun":
        return ("train" if "train.py" in words else "script"), words, env, sudo
    if words[0] == "sbatch" and "scripts/slurm/train.sbatch" in words:
        return "sbatch", words, env, sudo
    return "other", words, env, sudo


class Block(NamedTuple):
    page: str
    lineno: int
    commands: List[Command]

    @property
    def key(self) -> tuple:
        return tuple((c.line, c.template) for c in self.commands)

    @property
    def runs(self) -> bool:
        return any(_runs(c) for c in self.commands)

    @property
    def acts(self) -> bool:
        """Something of it runs or is validated."""
        return any(_runs(c) or c.kind in ("train", "sbatch") for c in self.commands)


def _runs(c: Command) -> bool:
    return not c.template and c.kind in ("train", "script")


def fenced_blocks(text: str) -> List[Tuple[str, int, List[Tuple[int, str]]]]:
    """(info string, line number of the opening fence, [(line number, physical line)]) of each fenced block."""
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = re.match(r"^(\s*)(```+|~~~+)\s*(.*)$", lines[i])
        if not m:
            i += 1
            continue
        fence, info, body, j = m.group(2), m.group(3).strip(), [], i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            body.append((j + 1, lines[j]))
            j += 1
        out.append((info, i + 1, body))
        i = j + 1
    return out


def logical_lines(body: List[Tuple[int, str]]) -> List[Tuple[int, str]]:
    """Backslash continuations joined; each with the number of its first line."""
    out, current, start = [], "", None
    for n, line in body:
        if start is None:
            start = n
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        out.append((start, " ".join((current + line).split())))
        current, start = "", None
    if start is not None:
        out.append((start, " ".join(current.split())))
    return out


def page_blocks(path: Path) -> List[Block]:
    page = path.relative_to(ROOT).as_posix()
    blocks = []
    for info, at, body in fenced_blocks(path.read_text()):
        if info.split(" ")[0].lower() not in SHELL_INFO:
            continue
        lines = [(n, line) for n, line in logical_lines(body) if line.strip()]
        first = lines[0][1] if lines else ""
        block_template = first.startswith("#") and _is_template_comment(first.lstrip("#").strip())
        commands = []
        for n, line in lines:
            words, comment = _split_comment(line)
            template = block_template or _is_template_comment(comment)
            segment: List[str] = []
            for w in [*words, "&&"]:
                if w not in ("&&", ";", "||"):
                    segment.append(w)
                    continue
                if segment:
                    kind, argv, env, sudo = _classify(segment)
                    shown = " ".join(s if re.fullmatch(r"[^\s'\"]+", s) else shlex.quote(s) for s in segment)
                    commands.append(Command(page, n, shown, template, kind, argv, env, sudo))
                segment = []
        blocks.append(Block(page, at, commands))
    return blocks


def all_blocks() -> List[Block]:
    return [b for p in PAGES for b in page_blocks(p)]


BLOCKS = all_blocks()
COMMANDS = [c for b in BLOCKS for c in b.commands]


def _unique(blocks: List[Block]) -> List[Block]:
    seen, out = set(), []
    for b in blocks:
        if b.commands and b.key not in seen:
            seen.add(b.key)
            out.append(b)
    return out


RUN_BLOCKS = _unique([b for b in BLOCKS if b.acts])
FIRST = {launcher: min((c for b in RUN_BLOCKS for c in b.commands if _runs(c) and c.kind == "train"
                        and c.launch()[0] == launcher), key=lambda c: c.launch()[2], default=None)
         for launcher in ("python", "torchrun")}
"""The line of each launcher that runs as written: the first with the fewest ranks (a fresh interpreter each)."""


# ---- the fast checks: what each command is, templates marked, paths and options that exist --------------------

def test_the_docs_have_the_commands_this_test_expects():
    """The extraction finds the examples (a broken parser must not make the tests below vacuous)."""
    readme = [c for c in COMMANDS if c.page == "README.md" and c.kind != "other"]
    assert readme[0].line == "python train.py" and readme[0].kind == "train" and not readme[0].template
    assert readme[1].line == "python -m pytest -n 2" and readme[1].kind == "pytest"  # .ci/run runs it
    trains = [c for c in COMMANDS if c.kind == "train"]
    assert len(trains) >= 20, len(trains)
    assert sum(_runs(c) and c.launch()[0] == "torchrun" for c in trains) >= 9
    assert sum(_runs(c) and c.kind == "script" for c in COMMANDS) >= 5
    assert any(c.template and c.launch()[1] > 1 for c in trains)
    assert any(c.kind == "sbatch" for c in COMMANDS) and {p.name for p in PAGES} >= {"README.md", "testing.md"}
    words, comment = _split_comment('torchrun --nnodes 4 --nproc-per-node 8 ... train.py a=1 "b c"   # template: x')
    assert words == ["torchrun", "--nnodes", "4", "--nproc-per-node", "8", "...", "train.py", "a=1", "b c"]
    assert _is_template_comment(comment)
    assert _classify(["A=1", "sudo", "python", "scripts/x.py"]) == ("script", ["python", "scripts/x.py"], {"A": "1"},
                                                                     True)
    assert logical_lines([(1, "a \\"), (2, "  b"), (3, "c")]) == [(1, "a b"), (3, "c")]


@pytest.mark.parametrize("cmd", COMMANDS, ids=[c.where[:150] for c in COMMANDS])
def test_every_command_runs_or_is_a_template(cmd: Command):
    why = cmd.must_be_template()
    assert cmd.template or why is None, f"{cmd.where}: mark it '# template' ({why})"
    for word in cmd.argv:
        for part in re.split(r"[=\[\],]", word):
            if REPO_FILE.match(part):
                assert (ROOT / part).exists(), f"{cmd.where}: {part} does not exist"
    if cmd.kind == "pytest":
        assert "-n" not in cmd.argv or importlib.util.find_spec("xdist"), f"{cmd.where}: -n needs pytest-xdist"
    if cmd.kind == "script" and cmd.template:
        _check_script_options(cmd)
    if cmd.kind == "train":
        launcher, nnodes, nproc, args = cmd.launch()
        own = [_key(o) for o in args if "=" in o]
        assert not (set(own) & APPENDED) - LINE_MAY_SET, f"{cmd.where}: this test would replace the line's {own}"


def _check_script_options(cmd: Command) -> None:
    """A template script line: the script exists, and so does every --option it gives."""
    a = cmd.argv
    if a[0] == "torchrun":  # torchrun [its options] script.py [the script's options]
        at = next(i for i, w in enumerate(a) if w.endswith(".py"))
        a = ["python", *a[at:]]
    if a[1] == "-m":
        source = ROOT / (a[2].replace(".", "/") + ".py")
        options = a[3:]
    else:
        source = ROOT / a[1]
        options = a[2:]
    assert source.is_file(), f"{cmd.where}: {source.relative_to(ROOT)} does not exist"
    text = source.read_text()
    # options a shared helper beside the script adds to its parser (scripts/_seeds.py's --seeds)
    for helper in re.findall(r"^(?:import|from) (_\w+)", text, flags=re.M):
        if (source.parent / f"{helper}.py").is_file():
            text += (source.parent / f"{helper}.py").read_text()
    for opt in options:
        if opt.startswith("-") and not re.fullmatch(r"-\d.*", opt):
            name = opt.split("=", 1)[0]
            assert f'"{name}"' in text or f"'{name}'" in text, f"{cmd.where}: {source.name} has no option {name}"


# ---- the scratch directory: the repository's files and the docs' stand-ins for the reader's --------------------

@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory) -> Dict[str, Path]:
    """Made once: my_corpus.jsonl, and path/to/llama when a block needs it (``llama()``)."""
    d = tmp_path_factory.mktemp("stand_ins")
    corpus = d / "my_corpus.jsonl"
    with gzip.open(ROOT / "data" / "sample" / "corpus.jsonl.gz", "rb") as f:
        corpus.write_bytes(f.read())
    return {"my_corpus.jsonl": corpus, "dir": d}


def _llama(stand_ins: Dict[str, Path]) -> Path:
    """A tiny random Llama (the bundled tokenizer's vocabulary), saved as transformers saves one."""
    target = stand_ins["dir"] / "llama"
    if target.exists():
        return target
    transformers = pytest.importorskip("transformers")
    import torch

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=128, tie_word_embeddings=False))
    model.save_pretrained(str(target))
    shutil.copy(ROOT / "data" / "sample" / "tokenizer.model", target / "tokenizer.model")
    return target


def _scratch(tmp_path: Path, block: Block, stand_ins: Dict[str, Path]) -> Path:
    d = tmp_path / "scratch"
    d.mkdir()
    for entry in ROOT.iterdir():  # the repository's code as a reader's checkout has it, nothing a run writes
        if entry.suffix in (".py", ".txt") or entry.name in ("scripts", "configs") or (entry / "__init__.py").is_file():
            (d / entry.name).symlink_to(entry)
    (d / "my_corpus.jsonl").symlink_to(stand_ins["my_corpus.jsonl"])
    if any("path/to/llama" in c.line for c in block.commands):
        (d / "path" / "to").mkdir(parents=True)
        (d / "path" / "to" / "llama").symlink_to(_llama(stand_ins))
    return d


def _env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
           and not k.startswith("SLURM_")}
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra or {})
    return env


def _run(argv: List[str], cwd: Path, env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
    """Run a command (``python`` is this interpreter); on timeout kill its whole process group."""
    if argv[0] == "python":
        argv = [sys.executable, *argv[1:]]
    elif argv[0] == "torchrun":
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", *argv[1:]]
    proc = subprocess.Popen(argv, cwd=cwd, env=_env(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"{' '.join(argv)} did not finish in {TIMEOUT_S} s:\n{out[-2000:]}\n{err[-3000:]}")
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def _run_forked(args: List[str], nproc: int, cwd: Path) -> subprocess.CompletedProcess:
    """``train.py args`` on N ranks forked by tests/dist_harness.py with torchrun's environment, instead of N
    fresh interpreters (~3 CPU-s each to import torch and the project). The ``FIRST`` python and torchrun
    lines run as written (``_run``), so each launch is covered once; every other line differs from them only in
    what train.py does with its arguments. Rank 0's output is the result's; a traceback on any rank is put into
    its stderr."""
    from tests.dist_harness import run_world, train_main

    ranks = run_world(train_main, nproc, args, str(cwd), timeout=TIMEOUT_S, env={"OMP_NUM_THREADS": "1"})
    code = next((c for c, _, _ in ranks if c != 0), 0)
    err = ranks[0][2] + "".join(e for _, _, e in ranks[1:] if "Traceback" in e)
    return subprocess.CompletedProcess(["(forked ranks)", "train.py", *args], code, ranks[0][1], err)


def _run_script(cmd: Command, cwd: Path) -> subprocess.CompletedProcess:
    """A script line (``python scripts/X.py ...``, ``python -m module ...``) as ``python`` runs it, in a process forked
    from the preloaded forkserver (tests/as_python.py's ``run_as_python``) instead of a fresh
    interpreter; a line that sets environment variables runs as a subprocess (they reach a fresh interpreter only:
    what torch reads at its import, say)."""
    from tests.as_python import run_as_python

    if cmd.env or cmd.argv[0] != "python":
        return _run(cmd.argv, cwd, cmd.env)
    p, late = run_as_python(cmd.argv[1:], cwd, _env(), TIMEOUT_S)
    if late:
        raise AssertionError(f"{cmd.where}: did not finish in {TIMEOUT_S} s:\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
    return p


def _tail(cmd: Command, p: subprocess.CompletedProcess) -> str:
    return (f"{cmd.where}\nexit {p.returncode}: {' '.join(map(str, p.args))}\n--- stdout\n{p.stdout[-2000:]}\n"
            f"--- stderr\n{p.stderr[-4000:]}")


def _key(override: str) -> str:
    return override.split("=", 1)[0]


# ---- the test: each block, top to bottom, in a fresh directory -------------------------------------------------

@pytest.mark.parametrize("block", [pytest.param(b, marks=pytest.mark.slow) if b.runs else b for b in RUN_BLOCKS],
                         ids=[f"{b.page}:{b.lineno}" for b in RUN_BLOCKS])
def test_doc_block_works_as_written(block: Block, stand_ins, monkeypatch, tmp_path):
    scratch = _scratch(tmp_path, block, stand_ins)
    steps_reached: Dict[Path, int] = {}  # run directory -> the step its last run of this block stopped at
    for n, cmd in enumerate(block.commands):
        if cmd.kind == "sbatch":
            nodes, per_node, args = cmd.sbatch()
            _validate(cmd, args, nodes, per_node, scratch, monkeypatch)
        elif cmd.kind == "train" and cmd.template:
            _, nnodes, nproc, args = cmd.launch()
            _validate(cmd, args, nnodes, nproc, scratch, monkeypatch)
        elif cmd.kind == "train":
            _train(cmd, scratch, tmp_path / f"run{n}", steps_reached)
        elif _runs(cmd):
            p = _run_script(cmd, scratch)
            assert p.returncode == 0 and "Traceback" not in p.stderr, _tail(cmd, p)


def _train(cmd: Command, scratch: Path, fresh_run_dir: Path, steps_reached: Dict[Path, int]) -> None:
    launcher, _, nproc, args = cmd.launch()
    overrides = [a for a in args if "=" in a and not a.startswith("-")]
    given = {_key(o): o.split("=", 1)[1] for o in overrides}
    intervals = {k: int(v) for k, v in given.items() if k in INTERVAL_RECORDS}
    run_dir = Path(given["logging.run_dir"]) if "logging.run_dir" in given else fresh_run_dir
    run_dir = run_dir if run_dir.is_absolute() else scratch / run_dir
    ckpt_dir = Path(given.get("checkpoint.dir", run_dir / "checkpoints"))
    ckpt_dir = ckpt_dir if ckpt_dir.is_absolute() else scratch / ckpt_dir
    more = max([STEPS, *intervals.values()])
    assert more <= MAX_STEPS, f"{cmd.where}: {intervals}: this test would run {more} steps; keep intervals small"
    steps = steps_reached.get(ckpt_dir, 0) + more
    appended = [f"train.max_steps={steps}", "train.eval_iters=1", "logging.wandb.mode=disabled"]
    if "logging.run_dir" not in given:
        appended.append(f"logging.run_dir={run_dir}")
    argv = [*args, *appended]
    if cmd is FIRST[launcher] or cmd.env:  # a line's environment variables reach a fresh interpreter only
        p = _run([launcher, *(["--nproc-per-node", str(nproc)] if launcher == "torchrun" else []), "train.py", *argv],
                 scratch, cmd.env)
    else:
        p = _run_forked(argv, nproc, scratch)
    assert p.returncode == 0, _tail(cmd, p)
    assert f"stopped at step {steps} (max_steps)" in p.stdout, _tail(cmd, p)
    assert f"[train] world={nproc} " in p.stdout, _tail(cmd, p)
    assert "Traceback" not in p.stderr, _tail(cmd, p)
    steps_reached[ckpt_dir] = steps
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in records if "loss" in r][-1]
    assert last["step"] == steps and math.isfinite(last["loss"]), (cmd.where, records)
    for key, every in intervals.items():  # what the line's interval asks for did happen
        assert every < 1 or any(INTERVAL_RECORDS[key] in r for r in records), (cmd.where, key, records)
    # the run used the line's settings: each value it gives is in the config the run saved
    saved = _flat(yaml.safe_load((run_dir / "config.yaml").read_text()))
    for key, value in given.items():
        if key not in LINE_MAY_SET:
            assert key in saved and yaml.safe_load(value) == saved[key], (cmd.where, key, value, saved.get(key))


def _validate(cmd: Command, args: List[str], nnodes: int, per_node: int, scratch: Path, monkeypatch) -> None:
    """What train.py checks before any process group exists, at the command's own launch."""
    import train
    from config import load_config, validate_config
    from parallel.layout import make_layout
    from training.trainer import check_data

    monkeypatch.chdir(scratch)
    config = args[args.index("--config") + 1] if "--config" in args else None
    overrides = [a for a in args if "=" in a and not a.startswith("-")]
    try:
        if config:
            train.check_config_file(config)
        cfg = load_config(config, overrides)
        validate_config(cfg)
        layout = make_layout(cfg, nnodes * per_node, per_node)
        assert layout.world_size == nnodes * per_node
        if not any(prefix.startswith("/path/to/") for prefix in cfg.data.paths):
            check_data(cfg)
    except Exception as e:
        raise AssertionError(f"{cmd.where}: {type(e).__name__}: {e}") from e
