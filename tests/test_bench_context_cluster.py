"""scripts/bench_context_cluster.py's arithmetic, without the cluster: the overlap read from a communication trace,
the formula column against the ledger's bytes, the table of synthetic results. (The cluster itself is
tests/test_bench_cluster.py's; the script's bad input is tests/test_scripts_bad_input.py's.)"""
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import bench_context_cluster as bcc  # noqa: E402


def _trace():
    """Two measured steps of one rank: a ring step posted at 1.0 and waited for from 3.0 to 4.0 (send, then recv),
    then a synchronous all-gather from 12.0 to 13.0; a p2p of another group that does not count."""
    return [["mark", "forward_backward", 0.0],
            ["call", "p2p send", "cp", None, 1.0, 1.01, True], ["call", "p2p recv", "cp", None, 1.01, 1.02, True],
            ["call", "p2p send", "pp", None, 2.0, 2.01, True], ["wait", "p2p send", "pp", None, 2.5, 9.0, True],
            ["wait", "p2p send", "cp", None, 3.0, 3.5, True], ["wait", "p2p recv", "cp", None, 3.5, 4.0, True],
            ["mark", "forward_backward", 10.0],
            ["call", "all_gather", "cp", 0, 12.0, 13.0, False],
            ["mark", "forward_backward", 20.0]]


def test_overlap_is_the_share_of_time_in_flight_not_blocked():
    got = bcc.rank_overlap(_trace(), skip=0)
    assert got == pytest.approx({"in_flight": (3.0 + 1.0) / 2, "blocked": (1.0 + 1.0) / 2})
    assert bcc.rank_overlap(_trace(), skip=1) == pytest.approx({"in_flight": 1.0, "blocked": 1.0})
    assert bcc.rank_overlap(_trace(), skip=2) is None  # one step start left: no whole step
    assert bcc._union([(0, 2), (1, 3), (5, 6)]) == 4
    with pytest.raises(ValueError, match="do not pair up"):
        bcc.rank_overlap([e for e in _trace() if e[:2] != ["wait", "p2p recv"]], skip=0)


def test_formula_is_volumes_cp_bytes_as_the_ledger_counted_them():
    """At seq 1024, cp 4 (p2p) and bf16 rank 0's ledger counted 100663296 bytes on the cp group a step (a
    4-rank run of this model on one machine); cp 1 sends none."""
    args = bcc.parse_args([])
    bcc.configure(args)
    assert bcc.formula_bytes(bcc.row_for("cp4"), args, 4) == 100663296
    assert bcc.formula_bytes(bcc.row_for("cp4_ag"), args, 4) == 100663296
    assert bcc.formula_bytes(bcc.row_for("cp2"), args, 4) == 100663296 / 3  # (cp-1) hops of the same local tokens
    assert bcc.formula_bytes(bcc.row_for("cp1"), args, 4) == 0
    # a2a (parallel/ulysses.py), by hand: 512 local tokens x 64 per head x 2 bytes = 65536 B per head; cp 4 with
    # 4 heads and 4 KV heads: forward q 3 + k, v 2 x 3 + the output 3, backward 3 + 3 + 2 x 3 = 24 heads' worth
    # per layer and micro-batch; 4 layers x 4 micro-batches (8 sequences of 2, one batch shard)
    assert bcc.formula_bytes(bcc.row_for("cp4_a2a"), args, 4) == 24 * 65536 * 16


def test_table_of_synthetic_results():
    ok = {"row": "cp4", "what": bcc.row_for("cp4").what, "step_time_s": 2.0, "tokens_per_s": 4096.0, "cp_bytes": 2**20,
          "formula": 2**20, "wire_bytes": 3 * 2**20, "overlap": {"in_flight": 1.0, "blocked": 0.25, "overlap": 0.75}}
    base = dict(ok, row="cp1", what=bcc.row_for("cp1").what, cp_bytes=0, formula=0, overlap=None)
    lines = bcc.table([ok, base, {"row": "cp2", "what": bcc.row_for("cp2").what, "error": "boom"}]).splitlines()
    assert lines[2] == "| cp4 | ring across nodes (p2p) | 2.000 | 4,096 | 1.00 | 1.00 | 3.00 | 1.000 | 0.250 | 0.75 |"
    assert lines[3].endswith("| 0.00 | 0.00 | 3.00 | - | - | - |") and "error: boom" in lines[4]
