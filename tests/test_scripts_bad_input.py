"""Every Python script under ``scripts/`` (and ``python -m data.preprocess`` and ``python -m data.tokenizer``)
handles bad input the way train.py does: one line ``error: <what is wrong>`` on stderr and exit code 2, never a
traceback.

Each script is run as a user runs it (``python scripts/X.py ...`` from the repository root; below: how) four
times, through the argument it reads a file by (``--config``, ``--preset``, a checkpoint, run or trace directory,
a Hugging Face model directory, the data and tokenizer its config overrides name; for a script that writes, the
place it writes to): a path that does not exist, a directory where a file is expected or a file where a directory
is expected, a file of random bytes, and a malformed YAML/JSON config (or config override). A script that reads no
file at all (bench_layouts.py, bench_quant.py, bench_fp8_cast.py, and netemu.py, a library that needs root and
network namespaces to do anything) gets the four paths as stray arguments, which it must refuse the same way;
scripts that write somewhere get a path under a regular file for "missing" (a missing directory is theirs to make).
A few cases per script check option values too (``--world 0``, ``--steps 1``, ...). Every case must fail before
any real work (no namespace, rank, model or corpus is made), so the whole file takes seconds per script.

A case does not start a fresh interpreter (each imported torch anew: 3-4 CPU-s a case of a script that imports it,
230 CPU-s over the file on a 2-core AVX2 EPYC, 60 this way): ``_run`` runs it through tests/as_python.py's
``run_as_python``, forked from tests/dist_harness.py's forkserver and run there as ``python`` would run it.

``python -m data.tokenizer`` is called in-process (its ``main(argv)``, stdout and stderr captured at the file
descriptors, so that sentencepiece's own logging would show): an interpreter per case would cost seconds each.

Left out: ``scripts/gpu_check.sh`` (shell) and ``scripts/slurm/`` (the sbatch file, and local_slurm.py, the
throwaway SLURM the test suite starts; tests/test_slurm.py covers it).
"""
from __future__ import annotations

import os
import random
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

from tests.as_python import run_as_python

ROOT = Path(__file__).resolve().parents[1]
CASES = ("missing", "wrong_kind", "binary", "malformed")
TIMEOUT_S = 180  # a case takes seconds (an interpreter importing torch at most); a loaded machine gets slack
MALFORMED_OVERRIDE = "model.n_layers=[unclosed"
# the four cases of a script that takes train.py's key=value overrides (the data and tokenizer they name)
DATA_OVERRIDES = {"missing": ["data.paths=[!{absent}]"], "wrong_kind": ["data.tokenizer=!{dir}"],
                  "binary": ["data.tokenizer=!{binary}"], "malformed": ["!" + MALFORMED_OVERRIDE]}

# script -> case -> argv. "{name}" is a path made by ``hostile_files``; the argument marked with "!" is the hostile
# one: the error line must name it (the first path in it, or the whole argument when it has none). An element
# "?text" is not an argument: the line must name text instead.
SCRIPTS: Dict[str, Dict[str, List[str]]] = {
    "bench_cluster.py": {
        "missing": ["--json", "!{absent}/results.json"],
        "wrong_kind": ["--json", "!{dir}"],
        "binary": ["--workdir", "!{binary}"],
        "malformed": ["--model", "!" + MALFORMED_OVERRIDE],
        "bad_row": ["--rows", "!no_such_row"],
        "repeat_0": ["!--repeat", "0"],
    },
    "bench_async_save.py": {
        "missing": ["--dir", "!{binary}/runs"],
        "wrong_kind": ["--dir", "!{binary}"],
        "binary": ["!{binary}"],
        "malformed": ["!" + MALFORMED_OVERRIDE],
        "unknown_key": ["model.no_such_key=1", "?model.no_such_key"],
        "saves_0": ["!--saves", "0"],
    },
    "bench_context_cluster.py": {
        "missing": ["--workdir", "!{binary}/runs"],
        "wrong_kind": ["--workdir", "!{binary}"],
        "binary": ["!--kv-heads", "3"],
        "malformed": ["--rows", "!cp3"],
        "steps_le_skip": ["!--steps", "3"],
        "seq_len_odd": ["!--seq-len", "1020"],
    },
    "bench_document_mask.py": {
        **DATA_OVERRIDES,
        "out_is_a_file": ["--out", "!{text}"],
        "repeated_seed": ["!--seeds", "1", "2", "1"],
        "seed_override": ["!train.seed=7"],
        "steps_0": ["!--steps", "0"],
        "time_steps_negative": ["!--time-steps", "-1"],
    },
    "bench_fp8.py": {
        "missing": ["--presets", "!{absent}.yaml"],
        "wrong_kind": ["--presets", "!{dir}"],
        "binary": ["--presets", "!{binary}"],
        "malformed": ["--presets", "!{yaml}"],
        "unknown_preset": ["--presets", "!no_such_preset"],
        "malformed_override": ["!" + MALFORMED_OVERRIDE, "--presets", "tiny"],
    },
    "bench_goodput.py": {
        "missing": ["--workdir", "!{binary}/runs"],
        "wrong_kind": ["--json", "!{dir}"],
        "binary": ["!{binary}"],
        "malformed": ["!" + MALFORMED_OVERRIDE],
        "unknown_key": ["model.no_such_key=1", "?model.no_such_key"],
        "steps_1": ["!--steps", "1"],
        "mtbf_0": ["!--mtbf-minutes", "0"],
        "unknown_mode": ["--modes", "!sync,nope"],
    },
    "bench_layouts.py": {
        "missing": ["!{absent}"],
        "wrong_kind": ["!{dir}"],
        "binary": ["!{binary}"],
        "malformed": ["--config", "!{yaml}"],
        "steps_1": ["!--steps", "1"],
        "ranks_per_node_0": ["!--ranks-per-node", "0"],
    },
    "bench_moe.py": {
        "missing": ["--config", "!{absent}.yaml"],
        "wrong_kind": ["--config", "!{dir}"],
        "binary": ["--config", "!{binary}"],
        "malformed": ["--config", "!{yaml}"],
        "dense_config": ["--config", "!configs/tiny.yaml"],
        "steps_0": ["!--steps", "0"],
        "balance_out_is_a_file": ["--balance", "--out", "!{text}"],
        "balance_rate_0": ["--balance", "--rates", "!0"],
        "balance_heldout_0": ["--balance", "!--heldout", "0"],
        "ep_elsewhere": ["--ep", "?scripts/bench_moe_cluster.py"],
    },
    "bench_moe_cluster.py": {
        "missing": ["--workdir", "!{binary}/runs"],
        "wrong_kind": ["--workdir", "!{binary}"],
        "binary": ["!--experts", "6"],
        "malformed": ["--rows", "!ep3"],
        "steps_le_skip": ["!--steps", "2"],
    },
    "bench_overhead.py": {
        "missing": ["--config", "!{absent}.yaml"],
        "wrong_kind": ["--config", "!{dir}"],
        "binary": ["--config", "!{binary}"],
        "malformed": ["--config", "!{yaml}"],
        "too_few_steps": ["!--steps", "5"],
    },
    "bench_probe.py": {
        "missing": ["--out", "!{absent}/probe.json", "--kinds", "all_gather", "--groups", "world", "--mib", "1",
                    "--iters", "2", "--rate", "1gbit"],
        "wrong_kind": ["--out", "!{dir}", "--kinds", "all_gather", "--groups", "world", "--mib", "1", "--iters",
                       "2", "--rate", "1gbit"],
        "binary": ["--out", "!{binary}/probe.json", "--kinds", "all_gather", "--groups", "world", "--mib", "1",
                   "--iters", "2", "--rate", "1gbit"],
        "malformed": ["--out", "{tmp}/probe.json", "--kinds", "!all_gather;all_reduce", "--groups", "world",
                      "--mib", "1", "--iters", "2", "--rate", "1gbit"],
        "not_under_torchrun": ["?RANK", "--out", "{tmp}/probe.json", "--kinds", "all_gather", "--groups", "world", "--mib",
                               "1", "--iters", "2", "--rate", "1gbit"],
    },
    "bench_fp8_cast.py": {
        "missing": ["!{absent}"],
        "wrong_kind": ["!{dir}"],
        "binary": ["!{binary}"],
        "malformed": ["--config", "!{yaml}"],
        "repeats_0": ["!--repeats", "0"],
    },
    "bench_quant.py": {
        "missing": ["!{absent}"],
        "wrong_kind": ["!{dir}"],
        "binary": ["!{binary}"],
        "malformed": ["--config", "!{yaml}"],
        "repeats_0": ["!--repeats", "0"],
        "threads_0": ["!--threads", "0"],
    },
    "bench_zero.py": {
        "missing": ["!{absent}"],
        "wrong_kind": ["!{dir}"],
        "binary": ["!{binary}"],
        "malformed": ["!" + MALFORMED_OVERRIDE],
        "unknown_key": ["model.no_such_key=1", "?model.no_such_key"],
        "world_0": ["!--world", "0"],
    },
    "comm_trace.py": {
        "missing": ["!{absent}"],
        "wrong_kind": ["!{text}"],
        "binary": ["!{trace_binary}"],
        "malformed": ["!{trace_malformed}"],
        "no_rank_files": ["!{dir}"],
    },
    "compare_optimizers.py": {
        **DATA_OVERRIDES,
        "out_is_a_file": ["--out", "!{text}"],
        "repeated_seed": ["!--seeds", "1", "2", "1"],
        "seed_override": ["!train.seed=7"],
        "steps_0": ["!--steps", "0"],
        "unknown_row": ["--rows", "!sgd"],
    },
    "convergence_fp8.py": {
        **DATA_OVERRIDES,
        "out_is_a_file": ["--out", "!{text}"],
        "repeated_seed": ["!--seeds", "1", "2", "1"],
        "seed_override": ["!train.seed=7"],
    },
    "convergence_zeropp.py": {
        **DATA_OVERRIDES,
        "out_is_a_file": ["--out", "!{text}"],
        "repeated_seed": ["!--seeds", "1", "2", "1"],
        "seed_override": ["!train.seed=7"],
    },
    "estimate_memory.py": {
        "missing": ["--world", "4", "--config", "!{absent}.yaml"],
        "wrong_kind": ["--world", "4", "--config", "!{dir}"],
        "binary": ["--world", "4", "--config", "!{binary}"],
        "malformed": ["--world", "4", "--config", "!{yaml}"],
        "world_0": ["!--world", "0"],
        "impossible_layout": ["--world", "3", "--config", "configs/gpt_7b.yaml", "?world size 3"],
    },
    "export_hf.py": {
        "missing": ["--checkpoint", "!{absent}", "--output", "{tmp}/export"],
        "wrong_kind": ["--checkpoint", "!{text}", "--output", "{tmp}/export"],
        "binary": ["--checkpoint", "!{ckpt_binary}", "--output", "{tmp}/export"],
        "malformed": ["--checkpoint", "!{ckpt_malformed}", "--output", "{tmp}/export"],
    },
    "fsdp2_peer.py": {
        **DATA_OVERRIDES,
    },
    "generate.py": {
        "missing": ["--checkpoint", "!{absent}"],
        "wrong_kind": ["--checkpoint", "!{text}"],
        "binary": ["--checkpoint", "!{ckpt_binary}"],
        "malformed": ["--checkpoint", "!{ckpt_malformed}"],
    },
    "import_hf.py": {
        "missing": ["--model", "!{absent}", "--output", "{tmp}/imported"],
        "wrong_kind": ["--model", "!{text}", "--output", "{tmp}/imported"],
        "binary": ["--model", "!{hf_binary}", "--output", "{tmp}/imported"],
        "malformed": ["--model", "!{hf_malformed}", "--output", "{tmp}/imported"],
    },
    "make_sample_corpus.py": {
        "missing": ["--output-dir", "!{text}/sample"],
        "wrong_kind": ["--output-dir", "!{text}"],
        "binary": ["--output-dir", "!{binary}"],
        "malformed": ["!--output-dir"],
    },
    "memory_fp8.py": {
        "missing": ["!{absent}"],
        "wrong_kind": ["!{dir}"],
        "binary": ["!{binary}"],
        "malformed": ["!" + MALFORMED_OVERRIDE],
        "world_0": ["!--world", "0"],
    },
    "netemu.py": {
        "missing": ["!{absent}"],
        "wrong_kind": ["!{dir}"],
        "binary": ["!{binary}"],
        "malformed": ["--config", "!{yaml}"],
    },
    "plain_gpt.py": {
        "missing": ["--preset", "!{absent}.yaml"],
        "wrong_kind": ["--preset", "!{dir}"],
        "binary": ["--preset", "!{binary}"],
        "malformed": ["--preset", "!{yaml}"],
        "steps_0": ["!--steps", "0"],
    },
    "plan.py": {
        "missing": ["--gpus", "8", "--config", "!{absent}.yaml"],
        "wrong_kind": ["--gpus", "8", "--config", "!{dir}"],
        "binary": ["--gpus", "8", "--config", "!{binary}"],
        "malformed": ["--gpus", "8", "--config", "!{yaml}"],
        "calibrate_binary": ["--gpus", "8", "--calibrate", "!{binary}"],
        "unknown_gpu": ["--gpus", "8", "--gpu", "!b200"],
        "not_whole_nodes": ["--gpus", "12", "?not divisible by --gpus-per-node"],
        "impossible_layout": ["--gpus", "3", "--config", "configs/gpt_7b.yaml", "?world size 3"],
    },
    "plan_check.py": {
        "missing": ["--cluster-only", "--bench-json", "!{absent}.json"],
        "wrong_kind": ["--cluster-only", "--bench-json", "!{dir}"],
        "binary": ["--cluster-only", "--bench-json", "!{binary}"],
        "malformed": ["--cluster-only", "--bench-json", "!{text}"],
        "json_is_a_dir": ["--json", "!{dir}"],
    },
    "plot_runs.py": {
        "missing": ["!{absent}", "-o", "{tmp}/curves.png"],
        "wrong_kind": ["!{text}", "-o", "{tmp}/curves.png"],
        "binary": ["!{run_binary}", "-o", "{tmp}/curves.png"],
        "malformed": ["!{run_malformed}", "-o", "{tmp}/curves.png"],
        "output_under_a_file": ["{run_good}", "-o", "!{text}/plots/curves.png"],
    },
    "profile_step.py": {
        "missing": ["--preset", "!{absent}.yaml"],
        "wrong_kind": ["--preset", "!{dir}"],
        "binary": ["--preset", "!{binary}"],
        "malformed": ["--preset", "!{yaml}"],
        "trace_dir_missing": ["--preset", "tiny", "--device", "cpu", "--trace", "!{absent}/trace.json"],
    },
    "-m data.preprocess": {
        "missing": ["--input", "!{absent}.jsonl", "--output-prefix", "{tmp}/out", "--tokenizer", "{tokenizer}"],
        "wrong_kind": ["--input", "!{dir_jsonl}", "--output-prefix", "{tmp}/out", "--tokenizer", "{tokenizer}"],
        "binary": ["--input", "!{jsonl_binary}", "--output-prefix", "{tmp}/out", "--tokenizer", "{tokenizer}"],
        "malformed": ["--input", "!{jsonl_malformed}", "--output-prefix", "{tmp}/out", "--tokenizer",
                      "{tokenizer}"],
        "binary_tokenizer": ["--input", "{jsonl_good}", "--output-prefix", "{tmp}/out", "--tokenizer",
                             "!{binary}"],
    },
}


def hostile_files(tmp: Path) -> Dict[str, str]:
    """The paths the cases name. Random bytes are seeded (the same every run) and hold a NUL and bytes that are
    not UTF-8."""
    noise = b"\x00\xff\xfe" + random.Random(0).randbytes(4093)
    (tmp / "noise.bin").write_bytes(noise)
    (tmp / "notes.txt").write_text("a text file, not a directory\n")
    (tmp / "empty_dir").mkdir()
    (tmp / "corpus.jsonl").mkdir()  # a directory where a .jsonl file is expected
    (tmp / "malformed.yaml").write_text("model: [unclosed\n")
    layouts = {  # directory -> {file name: content}
        "ckpt_binary": {"meta.json": noise, "manifest.json": noise},
        "ckpt_malformed": {"meta.json": b'{"config": {"model": [unclosed', "manifest.json": b'{"files": [unclosed'},
        "hf_binary": {"config.json": noise},
        "hf_malformed": {"config.json": b'{"model_type": "llama", "hidden_size": [unclosed'},
        "trace_binary": {"rank0.jsonl": noise},
        "trace_malformed": {"rank0.jsonl": b'["mark", "forward_backward", 1.0]\n{"model": [unclosed\n'
                                           b'["mark", "step", 2.0]\n'},
        "run_binary": {"metrics.jsonl": noise},
        "run_malformed": {"metrics.jsonl": b'{"step": 1, "loss": [unclosed\n{"step": 2, "loss": 3.0}\n'},
        "run_good": {"metrics.jsonl": b'{"step": 1, "loss": 4.0}\n{"step": 2, "loss": 3.0}\n'},
    }
    for name, files in layouts.items():
        (tmp / name).mkdir()
        for file, content in files.items():
            (tmp / name / file).write_bytes(content)
    (tmp / "bad.jsonl").write_bytes(b'{"text": "fine"}\n{"text": [unclosed\n{"text": "fine"}\n')
    (tmp / "noise.jsonl").write_bytes(noise)
    (tmp / "good.jsonl").write_text('{"text": "Some text."}\n')
    return {"tmp": str(tmp), "absent": str(tmp / "absent" / "nothing_here"), "dir": str(tmp / "empty_dir"),
            "text": str(tmp / "notes.txt"), "binary": str(tmp / "noise.bin"), "yaml": str(tmp / "malformed.yaml"),
            "dir_jsonl": str(tmp / "corpus.jsonl"), "jsonl_binary": str(tmp / "noise.jsonl"),
            "jsonl_malformed": str(tmp / "bad.jsonl"), "jsonl_good": str(tmp / "good.jsonl"),
            "tokenizer": str(ROOT / "data" / "sample" / "tokenizer.model"),
            **{name: str(tmp / name) for name in layouts}}


def _expand(argv: List[str], paths: Dict[str, str]) -> Tuple[List[str], str]:
    """(the arguments, what the error line must name: the hostile argument's first path, else the argument)."""
    args, needle = [], None
    for arg in argv:
        if arg.startswith("?"):
            needle = arg[1:]
            continue
        hostile = "!" in arg
        arg = arg.replace("!", "")
        if hostile and needle is None:
            found = re.search(r"\{(\w+)\}", arg)
            needle = paths[found.group(1)] if found else arg
        args.append(arg.format(**paths))
    assert needle is not None, argv
    return args, needle


def _run(script: str, argv: List[str], paths: Dict[str, str]) -> Tuple[List[str], str, subprocess.CompletedProcess]:
    """``python scripts/SCRIPT ARGS`` from the repository root (the module docstring says how it is run)."""
    args, needle = _expand(argv, paths)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                                                            "MASTER_PORT", "GPT_COMM_TRACE")}
    command = [*script.split(), *args] if script.startswith("-m ") else [f"scripts/{script}", *args]
    r, late = run_as_python(command, ROOT, env, TIMEOUT_S)
    if late:
        r.stderr = f"still running after {TIMEOUT_S} s (it did not stop at the bad input)\n{r.stderr}"
    return args, needle, r


def _problem(script: str, case: str, args: List[str], needle: str, r: subprocess.CompletedProcess) -> str:
    """What is wrong with the script's answer to one case ("" when it is one error line and exit code 2)."""
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    what = f"{script} {case} ({' '.join(args)}): "
    if "Traceback" in r.stderr + r.stdout:
        return what + "a traceback: " + " | ".join(lines[-3:])
    if r.returncode != 2:
        return what + f"exit code {r.returncode}, not 2: " + " | ".join(lines[-3:])
    if len(lines) != 1:
        return what + f"{len(lines)} lines on stderr, not 1: " + " | ".join(lines[:4])
    if not re.match(r"^([\w.]+\.py: )?error: \S", lines[0]):
        return what + f"the line is not 'error: ...': {lines[0]}"
    if needle not in lines[0]:
        return what + f"the line does not name {needle!r}: {lines[0]}"
    return ""


def test_every_script_is_covered():
    """A new script under scripts/ must be added here (with its four cases)."""
    scripts = sorted(p.name for p in (ROOT / "scripts").glob("*.py") if not p.name.startswith("_"))
    assert sorted(s for s in SCRIPTS if s.endswith(".py")) == scripts
    missing = {s: [c for c in CASES if c not in cases] for s, cases in SCRIPTS.items()}
    assert not any(missing.values()), missing


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_bad_input_is_one_line_and_exit_code_2(script, tmp_path):
    paths = hostile_files(tmp_path)
    before = {p: p.read_bytes() if p.is_file() else None for p in sorted(tmp_path.rglob("*"))}
    cases = SCRIPTS[script]
    with ThreadPoolExecutor(2) as pool:  # two at a time
        answers = list(pool.map(lambda case: (case, *_run(script, cases[case], paths)), cases))
    problems = [p for p in (_problem(script, case, args, needle, r) for case, args, needle, r in answers) if p]
    assert not problems, "\n".join(problems)
    after = {p: p.read_bytes() if p.is_file() else None for p in sorted(tmp_path.rglob("*"))}
    assert after == before, "a failed case wrote or changed files: " + ", ".join(
        str(p) for p in set(after) ^ set(before) or [p for p in after if after[p] != before.get(p)])


def test_run_reports_input_errors_and_keeps_the_traceback_of_a_bug(monkeypatch, capsys, tmp_path):
    """scripts/_cli.py's run(): the project's input errors and file errors are one line and exit code 2 (the file
    named); argparse's usage errors too; anything else (a bug) is raised as it was, traceback and all."""
    import argparse

    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import _cli
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    from config import ConfigError

    monkeypatch.setattr(argparse.ArgumentParser, "error", argparse.ArgumentParser.error)  # run() replaces it

    def raising(e):
        def main():
            raise e
        return main

    for e, says in [(_cli.InputError("--steps must be at least 1, got 0"), "--steps must be at least 1, got 0"),
                    (ConfigError("invalid config:\n  - one\n  - two"), "invalid config: - one - two"),
                    (FileNotFoundError(2, "No such file or directory", str(tmp_path / "x")),
                     f"{tmp_path / 'x'}: No such file or directory")]:
        assert _cli.run(raising(e)) == 2
        assert capsys.readouterr().err == f"error: {says}\n"
    for bug in (ZeroDivisionError("division by zero"), KeyError("step"), ValueError("a bug"), OSError("no file")):
        with pytest.raises(type(bug)):
            _cli.run(raising(bug))

    def parse(argv):
        argparse.ArgumentParser(prog="x.py").parse_args(argv)

    with pytest.raises(SystemExit) as info:
        _cli.run(parse, ["--nope"])
    assert info.value.code == 2
    assert capsys.readouterr().err == "error: unrecognized arguments: --nope (usage: x.py --help)\n"
    assert _cli.run(lambda argv: None, []) == 0 and _cli.run(lambda: 3) == 3


@pytest.mark.parametrize("name,value", [
    ("GPT_COMPILE_BACKEND", "bogus"), ("GPT_CPU_FP8_GEMM", "bogus"), ("GPT_CPU_FP8_GEMM", "FP32"),
    ("GPT_CPU_FP8_GEMM", ""), ("GPT_CPU_GEMM", "fast"), ("FP8_PACKED", "yes"), ("ZEROPP_TRITON", "true"),
    ("ZEROPP_REFERENCE", "2")])
def test_environment_switches_are_checked_at_start_up(monkeypatch, capsys, tmp_path, name, value):
    """A bad value of an environment switch the run reads later is one line naming it, exit 2, before the run
    directory exists (it was a traceback at the first step that read it, after the run directory and lock)."""
    import train
    from fp8.linear import cpu_fp32
    from parallel.cpu_gemm import upcasts

    monkeypatch.setenv(name, value)
    cpu_fp32.cache_clear()  # (read once per process: this worker may have read the good value already)
    upcasts.cache_clear()
    try:
        code = train.main([f"logging.run_dir={tmp_path / 'run'}", "train.max_steps=1", "logging.wandb.mode=disabled"])
    finally:
        cpu_fp32.cache_clear()
        upcasts.cache_clear()
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and name in lines[0] and repr(value) in lines[0], lines
    assert not (tmp_path / "run").exists()


# python -m data.tokenizer: case -> (argv, what the one line must name: the input and the problem). "{name}" is a
# path of ``hostile_files`` or of ``_tokenizer_files``.
SPM_OUT = ["--model-prefix", "{tmp}/out/tok"]
HF_OUT = ["--huggingface", "{tmp}/out/bpe"]
TOKENIZER_CASES: Dict[str, Tuple[List[str], List[str]]] = {
    "missing": (["--input", "{absent}.jsonl", *SPM_OUT, "--vocab-size", "300"], ["{absent}.jsonl", "not found"]),
    "wrong_kind": (["--input", "{dir_jsonl}", *SPM_OUT, "--vocab-size", "300"], ["{dir_jsonl}", "is a directory"]),
    "binary": (["--input", "{jsonl_binary}", *SPM_OUT, "--vocab-size", "300"], ["{jsonl_binary}", "not UTF-8"]),
    "binary_hf": (["--input", "{jsonl_binary}", *HF_OUT, "--vocab-size", "300"], ["{jsonl_binary}", "not UTF-8"]),
    "binary_gzip": (["--input", "{gz_binary}", *SPM_OUT, "--vocab-size", "300"], ["{gz_binary}", "not a gzip"]),
    "binary_no_suffix": (["--input", "{binary}", *SPM_OUT, "--vocab-size", "300"],
                         ["{binary}", "unsupported extension"]),
    "malformed": (["--input", "{jsonl_malformed}", *SPM_OUT, "--vocab-size", "300"],
                  ["{jsonl_malformed}", "line 2: invalid JSON"]),
    "text_not_a_string": (["--input", "{jsonl_number}", *HF_OUT, "--vocab-size", "300"],
                          ["{jsonl_number}", "record 1", "not a string"]),
    "empty": (["--input", "{jsonl_empty}", *SPM_OUT, "--vocab-size", "300"], ["{jsonl_empty}", "no text"]),
    "empty_hf": (["--input", "{jsonl_empty}", *HF_OUT, "--vocab-size", "300"], ["{jsonl_empty}", "no text"]),
    "vocab_size_0": (["--input", "{jsonl_good}", *SPM_OUT, "--vocab-size", "0"],
                     ["--vocab-size 0", "too small", "at least 260"]),
    "vocab_size_negative": (["--input", "{jsonl_good}", *SPM_OUT, "--vocab-size", "-5"],
                            ["--vocab-size -5", "at least 260"]),
    "vocab_size_0_hf": (["--input", "{jsonl_good}", *HF_OUT, "--vocab-size", "0"], ["--vocab-size 0", "at least 257"]),
    "vocab_size_huge": (["--input", "{jsonl_good}", *SPM_OUT, "--vocab-size", str(10**12)],
                        [f"--vocab-size {10**12}", "ceiling of 4194304"]),
    # (the tokenizers library aborted the process: "memory allocation of 72567767433232 bytes failed")
    "vocab_size_huge_hf": (["--input", "{jsonl_good}", *HF_OUT, "--vocab-size", str(10**12)],
                           [f"--vocab-size {10**12}", "ceiling of 4194304"]),
    "vocab_size_not_an_integer": (["--input", "{jsonl_good}", *SPM_OUT, "--vocab-size", "1e3"],
                                  ["--vocab-size", "'1e3'"]),
    "vocab_size_above_the_corpus": (["--input", "{jsonl_good}", *SPM_OUT, "--vocab-size", "100000"],
                                    ["{jsonl_good}", "Vocabulary size too high (100000)"]),
    "no_vocab_size": (["--input", "{jsonl_good}", *SPM_OUT], ["--vocab-size"]),
    "prefix_without_a_name": (["--input", "{jsonl_good}", "--model-prefix", "{tmp}/out/", "--vocab-size", "300"],
                              ["{tmp}/out/", "no file name"]),
    "prefix_under_a_file": (["--input", "{jsonl_good}", "--model-prefix", "{text}/tok", "--vocab-size", "300"],
                            ["{text}", "is a file"]),
    "output_dir_is_a_file": (["--input", "{jsonl_good}", "--huggingface", "{text}", "--vocab-size", "300"],
                             ["--huggingface {text}", "is a file"]),
    "model_type_with_hf": (["--input", "{jsonl_good}", *HF_OUT, "--vocab-size", "300", "--model-type", "bpe"],
                           ["--model-type"]),
}


def _tokenizer_files(tmp: Path) -> Dict[str, str]:
    """The inputs of TOKENIZER_CASES that ``hostile_files`` does not make."""
    (tmp / "noise.jsonl.gz").write_bytes((tmp / "noise.bin").read_bytes())
    (tmp / "empty.jsonl").write_bytes(b"")
    (tmp / "number.jsonl").write_text('{"text": 5}\n')
    return {"gz_binary": str(tmp / "noise.jsonl.gz"), "jsonl_empty": str(tmp / "empty.jsonl"),
            "jsonl_number": str(tmp / "number.jsonl")}


def test_tokenizer_bad_input_is_one_line_and_exit_code_2(tmp_path, capfd):
    """``python -m data.tokenizer``'s every bad input (it was a 10-26-line traceback, exit code 1): one line naming
    the input and the problem, exit code 2, nothing written."""
    from data.tokenizer import main

    paths = {**hostile_files(tmp_path), **_tokenizer_files(tmp_path)}
    before = {p: p.read_bytes() if p.is_file() else None for p in sorted(tmp_path.rglob("*"))}
    problems = []
    for case, (argv, names) in TOKENIZER_CASES.items():
        args = [arg.format(**paths) for arg in argv]
        try:
            code = main(args)
        except SystemExit as e:  # argparse's usage errors
            code = e.code
        out, err = capfd.readouterr()
        names = [name.format(**paths) for name in names]
        answer = subprocess.CompletedProcess(["-m data.tokenizer", *args], code, out, err)
        problem = _problem("-m data.tokenizer", case, args, names[0], answer)
        missing = [name for name in names[1:] if name not in err]
        problems += [problem] if problem else [f"{case}: the line does not name {missing}: {err}"] if missing else []
    assert not problems, "\n".join(problems)
    after = {p: p.read_bytes() if p.is_file() else None for p in sorted(tmp_path.rglob("*"))}
    assert after == before, "a failed case wrote or changed files: " + ", ".join(
        str(p) for p in set(after) ^ set(before) or [p for p in after if after[p] != before.get(p)])
