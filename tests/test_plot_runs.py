"""scripts/plot_runs.py: plots runs' metrics.jsonl to a PNG, prints their last values, and rejects bad input
with one line and exit code 2 (matplotlib missing included). A torn last record (a writer killed mid-line) is
skipped with a warning, and runs without validation records plot by default. Synthetic run directories; nothing
is trained."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "plot_runs.py"
sys.path.insert(0, str(ROOT / "scripts"))

import plot_runs  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _train(step, loss, **extra):
    return {"step": step, "loss": loss, "lr": 1e-4 * step, "grad_norm": 1.0 / step, "tokens_per_s": 1000.0 + step,
            "mfu": None, "comm": {"by_kind": {}, "by_link": {"intra": 0, "inter": 0}, "total": 0}, **extra}


def _write_run(run_dir: Path, records) -> Path:
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run_dir


@pytest.fixture
def runs(tmp_path):
    """Two runs in the trainer's format. ``base`` was resumed from step 2: steps 3 and 4 appear twice and the
    later records (loss 2.5 / 2.25, val_loss 2.4) are the ones that count."""
    base = _write_run(tmp_path / "base", [
        _train(1, 4.0), _train(2, 3.0), {"step": 2, "val_loss": 3.1},
        _train(3, 9.0), _train(4, 9.5), {"step": 4, "val_loss": 9.9},  # the run that died after step 4
        _train(3, 2.5), {"step": 3, "quant_error": {"weights": 1e-3, "gradients": None}},
        _train(4, 2.25), {"step": 4, "val_loss": 2.4},
    ])
    fp8 = _write_run(tmp_path / "fp8", [
        _train(1, 4.1, fp8={"mu": 1.0, "overflow_fraction": 0.0, "mu_changes": 0}), _train(2, 3.2),
        {"step": 2, "val_loss": 3.3}, _train(3, 2.75), _train(4, 2.125), _train(5, 2.0),
    ])
    return base, fp8


def _run(*args, env=None):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=120)


def _table(stdout):
    """The stdout table as {run: [last step, loss, val_loss]}."""
    lines = stdout.splitlines()
    assert lines[0].split() == ["run", "last", "step", "loss", "val_loss"]
    return {line.split()[0]: line.split()[1:] for line in lines[1:] if not line.startswith("wrote ")}


def _check_png(path: Path):
    data = path.read_bytes()
    assert len(data) > 1000 and data[:8] == PNG_MAGIC
    import matplotlib.image

    height, width = matplotlib.image.imread(str(path)).shape[:2]
    return width, height


def test_plots_runs_and_prints_last_values(runs, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "curves.png"
    r = _run(*runs, "-o", out)
    assert r.returncode == 0, r.stderr
    width, height = _check_png(out)
    assert width > 200 and height > 200
    assert _table(r.stdout) == {"base": ["4", "2.2500", "2.4000"], "fp8": ["5", "2.0000", "3.3000"]}
    assert f"wrote {out}" in r.stdout

    # more metrics: one subplot each, so the figure grows taller
    out5 = tmp_path / "sub" / "five.png"
    r = _run(*runs, "--metrics", "loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "-o", out5)
    assert r.returncode == 0, r.stderr
    width5, height5 = _check_png(out5)
    assert width5 == width and height5 > 2 * height


def test_labels_and_nested_metric(runs, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "fp8.png"
    r = _run(*runs, "--labels", "baseline", "FP8-LM", "--metrics", "loss", "fp8.mu", "-o", out)
    assert r.returncode == 0, r.stderr
    _check_png(out)
    assert set(_table(r.stdout)) == {"baseline", "FP8-LM"}

    r = _run(*runs, "--labels", "only-one", "-o", out)
    assert r.returncode == 2 and "--labels has 1 names for 2 runs" in r.stderr


def test_repeated_steps_keep_last_record(runs):
    base = plot_runs.load_run(runs[0], ["loss", "val_loss", "quant_error.weights", "mfu"])
    assert base["loss"] == {1: 4.0, 2: 3.0, 3: 2.5, 4: 2.25}
    assert base["val_loss"] == {2: 3.1, 4: 2.4}
    assert base["quant_error.weights"] == {3: 1e-3}
    assert base["mfu"] == {}  # null values are skipped
    assert list(base["step"]) == [1, 2, 3, 4]


def _bad_inputs(tmp_path, good):
    missing = tmp_path / "no_metrics"
    missing.mkdir()
    empty = _write_run(tmp_path / "empty", [])
    (empty / "metrics.jsonl").write_text("\n")
    middle = tmp_path / "middle"
    middle.mkdir()  # a malformed line with records after it is no torn write: the file is damaged
    (middle / "metrics.jsonl").write_text(json.dumps(_train(1, 4.0)) + '\n{"step": 2, "loss": 3.\n'
                                          + json.dumps(_train(3, 2.0)) + "\n")
    binary = tmp_path / "binary"
    binary.mkdir()  # e.g. a PNG saved over it: not UTF-8 from the first line on
    (binary / "metrics.jsonl").write_bytes(PNG_MAGIC + bytes(range(256)) * 4 + b"\n"
                                           + json.dumps(_train(1, 4.0)).encode())
    nul = tmp_path / "nul"
    nul.mkdir()
    (nul / "metrics.jsonl").write_bytes(b"\x00" * 64 + b"\n" + json.dumps(_train(1, 4.0)).encode() + b"\n")
    torn_only = tmp_path / "torn_only"
    torn_only.mkdir()  # killed while writing its first record: nothing to plot
    (torn_only / "metrics.jsonl").write_text('{"step": 1, "lo')
    no_val = _write_run(tmp_path / "no_val", [_train(1, 4.0), _train(2, 3.0)])
    return {
        "missing": ([good, missing], [str(missing / "metrics.jsonl"), "no such file"]),
        "empty": ([good, empty], [str(empty / "metrics.jsonl"), "empty"]),
        "malformed": ([middle], [f"{middle / 'metrics.jsonl'}:2:", "malformed JSON"]),
        "binary": ([good, binary], [f"{binary / 'metrics.jsonl'}:1:", "binary data"]),
        "nul_bytes": ([nul], [f"{nul / 'metrics.jsonl'}:1:", "binary data"]),
        "torn_only_record": ([torn_only], [f"{torn_only / 'metrics.jsonl'}:1:", "malformed JSON"]),
        "unknown_metric": ([good, "--metrics", "loss", "nonesuch"],
                           ["'nonesuch'", str(good / "metrics.jsonl")]),
        "val_loss_asked_for": ([no_val, "--metrics", "loss", "val_loss"],
                               ["'val_loss'", str(no_val / "metrics.jsonl")]),
    }


@pytest.mark.parametrize("case", ["missing", "empty", "malformed", "binary", "nul_bytes", "torn_only_record",
                                  "unknown_metric", "val_loss_asked_for"])
def test_bad_input_exits_2_with_one_line(case, runs, tmp_path):
    args, expected = _bad_inputs(tmp_path, runs[0])[case]
    out = tmp_path / "curves.png"
    r = _run(*args, "-o", out)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    for text in expected:
        assert text in r.stderr
    assert not out.exists() and r.stdout == ""


@pytest.mark.parametrize("case", ["under_a_file", "deeper_under_a_file", "a_directory", "unknown_format"])
def test_bad_output_exits_2_with_one_line(case, runs, tmp_path):
    """-o that cannot be written (a regular file where a directory of its path must be, an existing directory, a
    suffix matplotlib has no format for): one line naming it, exit 2, nothing written (was a FileExistsError
    traceback for -o somefile/plots)."""
    if case == "unknown_format":
        pytest.importorskip("matplotlib")
    somefile = tmp_path / "somefile"
    somefile.write_text("not a directory\n")
    out = {"under_a_file": somefile / "plots.png", "deeper_under_a_file": somefile / "a" / "plots.png",
           "a_directory": tmp_path, "unknown_format": tmp_path / "curves.nosuchformat"}[case]
    before = sorted(tmp_path.rglob("*"))
    r = _run(*runs, "-o", out)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "error: " in r.stderr and str(out) in r.stderr and r.stdout == ""
    assert sorted(tmp_path.rglob("*")) == before and somefile.read_text() == "not a directory\n"


def test_missing_matplotlib_exits_2(runs, tmp_path):
    """A fake ``matplotlib`` first on PYTHONPATH that fails to import stands in for one not installed."""
    fake = tmp_path / "fake" / "matplotlib"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('raise ImportError("No module named matplotlib (fake)")\n')
    paths = [str(fake.parent)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
    out = tmp_path / "curves.png"
    r = _run(*runs, "-o", out, env=env)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "pip install matplotlib" in r.stderr
    assert not out.exists()


# ---- what a killed writer leaves, and runs without validation (issue 17) ------------------------------------

GOOD = [_train(1, 4.0), _train(2, 3.0), {"step": 2, "val_loss": 3.1}, _train(3, 2.5, note="ééé")]
TORN = {  # the bytes a writer killed part-way through its next line leaves after GOOD
    "mid_number": b'{"step": 4, "loss": 2.2',
    "mid_utf8_char": json.dumps(_train(4, 2.25, note="ééé"), ensure_ascii=False).encode()[:-3],  # half an é
    "with_newline": b'{"step": 4, "loss": 2.\n',
    "nul_tail": b"\x00" * 4096,  # a file system that lost the data of the last block, not its size
}


def _good_bytes() -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in GOOD).encode()


@pytest.mark.parametrize("tail", list(TORN))
def test_torn_last_record_is_skipped_with_a_warning(tail, tmp_path):
    pytest.importorskip("matplotlib")
    assert TORN["mid_utf8_char"].decode("utf-8", errors="replace").endswith("\ufffd")  # cut inside a character
    clean = _write_run(tmp_path / "clean", GOOD)
    torn = tmp_path / "torn"
    torn.mkdir()
    (torn / "metrics.jsonl").write_bytes(_good_bytes() + TORN[tail])
    metrics = ["loss", "val_loss", "lr"]
    warnings = []
    assert plot_runs.load_run(torn, metrics, warnings.append) == plot_runs.load_run(clean, metrics, warnings.append)
    assert len(warnings) == 1 and f"{torn / 'metrics.jsonl'}:5:" in warnings[0] and "torn last record" in warnings[0]

    out, ref = tmp_path / "torn.png", tmp_path / "clean.png"
    r = _run(torn, "--labels", "run", "-o", out)
    assert r.returncode == 0, r.stderr
    r_ref = _run(clean, "--labels", "run", "-o", ref)
    assert r_ref.returncode == 0 and r_ref.stderr == "", r_ref.stderr
    assert _table(r.stdout) == _table(r_ref.stdout) == {"run": ["3", "2.5000", "3.1000"]}
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("plot_runs.py: warning: "), r.stderr
    assert "torn last record" in lines[0] and f"{torn / 'metrics.jsonl'}:5:" in lines[0], r.stderr
    import matplotlib.image

    assert (matplotlib.image.imread(str(out)) == matplotlib.image.imread(str(ref))).all()  # the same picture


def test_default_plot_of_runs_without_validation_records(tmp_path):
    """train.eval_interval=0 (or a run stopped before its first validation) writes no val_loss: the default
    invocation plots the loss panel with a note, the same picture as asking for loss alone."""
    pytest.importorskip("matplotlib")
    a = _write_run(tmp_path / "a", [_train(1, 4.0), _train(2, 3.0)])
    b = _write_run(tmp_path / "b", [_train(1, 4.5), _train(2, 3.5), _train(3, 3.25)])
    out, ref = tmp_path / "default.png", tmp_path / "loss.png"
    r = _run(a, b, "-o", out)
    assert r.returncode == 0, r.stderr
    assert _table(r.stdout) == {"a": ["2", "3.0000", "-"], "b": ["3", "3.2500", "-"]}
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("plot_runs.py: note: no run has val_loss records"), r.stderr
    r_ref = _run(a, b, "--metrics", "loss", "-o", ref)
    assert r_ref.returncode == 0 and r_ref.stderr == "", r_ref.stderr
    import matplotlib.image

    assert (matplotlib.image.imread(str(out)) == matplotlib.image.imread(str(ref))).all()

    # one run with validation records: both panels, no note
    c = _write_run(tmp_path / "c", [_train(1, 4.0), {"step": 1, "val_loss": 4.2}])
    r = _run(a, c, "-o", tmp_path / "both.png")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert _table(r.stdout) == {"a": ["2", "3.0000", "-"], "c": ["1", "4.0000", "4.2000"]}
    assert _check_png(tmp_path / "both.png")[1] > _check_png(out)[1]
