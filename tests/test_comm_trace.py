"""The communication trace's bad input: ``scripts/comm_trace.py`` skips a torn last line with a warning and reports a
bad trace file (garbage, random bytes, JSON of the wrong shape), a missing or misplaced directory, or one without
rank files as one line and exit code 2; ``GPT_COMM_TRACE`` naming a regular file or an unwritable place stops
train.py at start-up with one line and exit code 2, before anything is trained. Synthetic traces; the only
training process is train.py's failed start."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from parallel import comm
from parallel.launch import LaunchError

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "comm_trace.py"


def _events(steps: int = 5) -> list:
    """A rank's trace in parallel/comm.py's format: per step a mark, an async all-gather with its wait, a mark and
    a synchronous all-reduce."""
    out, t = [], 100.0
    for seq in range(steps):
        out += [["mark", "forward_backward", t], ["call", "all_gather", "world", 2 * seq, t + 0.01, t + 0.02, True],
                ["wait", "all_gather", "world", 2 * seq, t + 0.05, t + 0.08, True], ["mark", "step", t + 0.1],
                ["call", "all_reduce", "world", 2 * seq + 1, t + 0.11, t + 0.15, False]]
        t += 0.2
    return out + [["mark", "forward_backward", t]]


def _write_trace(directory: Path, tail: bytes = b"", ranks: int = 2) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for r in range(ranks):
        (directory / f"rank{r}.jsonl").write_bytes(b"".join(json.dumps(e).encode() + b"\n" for e in _events())
                                                   + (tail if r == ranks - 1 else b""))
    return directory


def _run(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env=env)


def _one_error_line(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr + r.stdout, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    return lines[0]


def test_a_good_trace_is_summed(tmp_path):
    r = _run(_write_trace(tmp_path / "trace"), "--skip", "1", "--cores", "1")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert "rank0: 4 steps" in r.stdout and "rank1: 4 steps" in r.stdout and "idle cores:" in r.stdout


@pytest.mark.parametrize("torn", [b'["call", "all_gather", "wor', b'["mark", "forward_backward", 10', b"\xe2\x82"])
def test_a_torn_last_line_is_skipped_with_a_warning(tmp_path, torn):
    """What a rank killed mid-write leaves: the events before the torn line are summed, as without it."""
    good = _run(_write_trace(tmp_path / "good"), "--skip", "1")
    r = _run(_write_trace(tmp_path / "torn", torn), "--skip", "1")
    assert r.returncode == 0, r.stderr
    assert r.stdout == good.stdout
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("comm_trace.py: warning: "), r.stderr
    assert f"{tmp_path / 'torn' / 'rank1.jsonl'}:{len(_events()) + 1}:" in lines[0] and "torn last line" in lines[0]


BAD_LINES = {  # a line before the last that is not a trace event -> what the error says about it
    "garbage": (b"this is not json", "malformed JSON line"),
    "object": (b'{"kind": "mark"}', "not a trace event"),
    "number": (b"42", "not a trace event"),
    "unknown_kind": (b'["send", 1, 2]', "not a trace event"),
    "short_event": (b'["call", "all_gather", "world"]', "'call' event has 3 fields"),
    "time_not_a_number": (b'["mark", "step", "soon"]', "is a time"),
    "binary": (b"\x00\x9f\x92\x96 binary", "binary data"),
}


@pytest.mark.parametrize("case", sorted(BAD_LINES))
def test_a_bad_line_names_the_file_and_line(tmp_path, case):
    line, says = BAD_LINES[case]
    trace = _write_trace(tmp_path / "trace")
    events = [json.dumps(e).encode() for e in _events()]
    (trace / "rank1.jsonl").write_bytes(b"\n".join(events[:3] + [line] + events[3:]) + b"\n")
    error = _one_error_line(_run(trace))
    assert f"{trace / 'rank1.jsonl'}:4:" in error and says in error, error


def test_random_bytes_and_empty_files_are_named(tmp_path):
    trace = _write_trace(tmp_path / "trace")
    (trace / "rank1.jsonl").write_bytes(os.urandom(4096))
    assert str(trace / "rank1.jsonl") in _one_error_line(_run(trace))
    (trace / "rank1.jsonl").write_bytes(b"")
    assert f"{trace / 'rank1.jsonl'}: empty file" in _one_error_line(_run(trace))


def test_a_bad_directory_is_one_line_exit_2(tmp_path):
    assert "no such directory" in _one_error_line(_run(tmp_path / "absent"))
    (tmp_path / "file").write_text("x")
    assert "is not a directory" in _one_error_line(_run(tmp_path / "file"))
    (tmp_path / "empty").mkdir()
    assert "no rank*.jsonl in" in _one_error_line(_run(tmp_path / "empty"))  # was exit code 1
    assert "--cores" in _one_error_line(_run(_write_trace(tmp_path / "t"), "--cores", "0"))


# ---- GPT_COMM_TRACE is checked at start-up ------------------------------------------------------------------


def test_check_trace_makes_the_directory_and_leaves_no_file(tmp_path, monkeypatch):
    monkeypatch.setattr(comm, "_trace", comm._Trace(None))
    comm.check_trace()  # unset: nothing to check
    directory = tmp_path / "a" / "trace"
    monkeypatch.setattr(comm, "_trace", comm._Trace(str(directory)))
    comm.check_trace()
    assert directory.is_dir() and list(directory.iterdir()) == []
    (directory / "rank0.jsonl").write_text('["mark", "step", 1.0]\n')  # a rank file already there: kept as is
    monkeypatch.setenv("RANK", "0")
    comm.check_trace()
    assert (directory / "rank0.jsonl").read_text() == '["mark", "step", 1.0]\n'


@pytest.mark.parametrize("case", ["regular_file", "under_a_file", "rank_file_is_a_directory"])
def test_check_trace_refuses_a_place_it_cannot_write(tmp_path, monkeypatch, case):
    (tmp_path / "file").write_text("x")
    (tmp_path / "d" / "rank0.jsonl").mkdir(parents=True)
    directory = {"regular_file": tmp_path / "file", "under_a_file": tmp_path / "file" / "trace",
                 "rank_file_is_a_directory": tmp_path / "d"}[case]
    monkeypatch.setattr(comm, "_trace", comm._Trace(str(directory)))
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(LaunchError, match=f"GPT_COMM_TRACE={directory}"):
        comm.check_trace()


@pytest.mark.parametrize("case", ["regular_file", "under_a_file"])
def test_train_stops_at_start_up_on_a_bad_gpt_comm_trace(tmp_path, case):
    """Was a traceback from the first step's mark, after the run directory and its config were written."""
    (tmp_path / "somefile").write_text("not a directory\n")
    trace = tmp_path / "somefile" if case == "regular_file" else tmp_path / "somefile" / "trace"
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "SLURM_PROCID")}
    env["GPT_COMM_TRACE"] = str(trace)
    r = subprocess.run([sys.executable, "train.py", "train.max_steps=1", f"logging.run_dir={run_dir}",
                        "logging.wandb.mode=disabled"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=env)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr + r.stdout, r.stderr[-3000:]
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: GPT_COMM_TRACE={trace}"), r.stderr
    assert not run_dir.exists()  # nothing trained, nothing written
    assert (tmp_path / "somefile").read_text() == "not a directory\n"
