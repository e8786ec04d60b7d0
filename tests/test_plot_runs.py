"""scripts/plot_runs.py: plots runs' metrics.jsonl to a PNG, prints their last values, and rejects bad input
with one line and exit code 2 (matplotlib missing included). Synthetic run directories; nothing is trained."""
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
    torn = tmp_path / "torn"
    torn.mkdir()
    (torn / "metrics.jsonl").write_text(json.dumps(_train(1, 4.0)) + '\n{"step": 2, "loss": 3.\n')
    return {
        "missing": ([good, missing], [str(missing / "metrics.jsonl"), "no such file"]),
        "empty": ([good, empty], [str(empty / "metrics.jsonl"), "empty"]),
        "malformed": ([torn], [f"{torn / 'metrics.jsonl'}:2:", "malformed JSON"]),
        "unknown_metric": ([good, "--metrics", "loss", "nonesuch"],
                           ["'nonesuch'", str(good / "metrics.jsonl")]),
    }


@pytest.mark.parametrize("case", ["missing", "empty", "malformed", "unknown_metric"])
def test_bad_input_exits_2_with_one_line(case, runs, tmp_path):
    args, expected = _bad_inputs(tmp_path, runs[0])[case]
    out = tmp_path / "curves.png"
    r = _run(*args, "-o", out)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    for text in expected:
        assert text in r.stderr
    assert not out.exists() and r.stdout == ""


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
