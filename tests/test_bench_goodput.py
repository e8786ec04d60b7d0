"""scripts/bench_goodput.py's arithmetic on synthetic metrics records (no run): the save stall read from the gaps
between records, the wall time lost per fault, goodput, the fault schedule; and its bad input (one line, exit 2)."""
import json
import sys

import pytest

from tests.test_train_e2e import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import bench_goodput as bg  # noqa: E402

sys.path.remove(str(ROOT / "scripts"))

STEP = 2.0


def run_records(steps, t0=100.0, restarts=0, saves=(), stall=3.0, overhead=0.1):
    """Records of consecutive steps of one attempt: each step STEP s plus ``overhead``; a save after the steps in
    ``saves`` holds the loop ``stall`` s more."""
    out, t = [], t0
    for s in steps:
        t += STEP + overhead
        out.append({"step": s, "time": t, "step_time_s": STEP, "restarts": restarts, "loss": 1.0})
        if s in saves:
            t += stall
    return out


def test_save_stall_is_the_gap_less_the_step_and_the_usual_overhead():
    records = run_records(range(1, 21), saves=(5, 10, 15, 20))
    seen = {s: next(r["time"] for r in records if r["step"] == s) + 0.5 for s in (5, 10, 15, 20)}
    stalls, base = bg.save_stalls(records, seen)
    assert base == pytest.approx(0.1)
    assert stalls == pytest.approx({5: 3.0, 10: 3.0, 15: 3.0})  # 20: the last step, no next record


def test_a_save_belongs_to_the_attempt_that_logged_its_step_before_it_was_seen():
    """Step 6 saved in attempt 0 (then the group was killed before its write was published), redone without a save
    in attempt 1: only attempt 0's gap after step 6 is its stall; attempt 1's is an ordinary step."""
    first = run_records(range(1, 9), saves=(6,), stall=1.0)
    second = run_records(range(5, 11), t0=first[-1]["time"] + 30, restarts=1)
    seen = {6: first[5]["time"] + 0.2}
    stalls, base = bg.save_stalls(first + second, seen)
    assert stalls == pytest.approx({6: 1.0}) and base == pytest.approx(0.1)


def test_lost_time_per_fault_counts_the_step_in_flight_the_restart_and_the_redone_steps():
    """Step 10 logged at t10; killed 1 s into step 11; restarted from the checkpoint at step 8 after 20 s; steps 9
    and 10 redone, step 11 logged at t10 + 1 + 20 + 3 steps: lost = that - t10 - one step = 1 + 20 + 2 steps."""
    before = run_records(range(1, 11), overhead=0.0)
    t10 = before[-1]["time"]
    kill = t10 + 1.0
    after = run_records(range(9, 16), t0=kill + 20.0, restarts=1, overhead=0.0)
    [e] = bg.fault_losses(before + after, [kill], STEP, end=after[-1]["time"])
    assert e["from_step"] == 10 and e["recovered"] and e["faults"] == 1
    assert e["lost_s"] == pytest.approx(1.0 + 20.0 + 2 * STEP)


def test_a_fault_during_the_recovery_joins_its_episode_and_a_fault_before_step_1_counts_from_the_kill():
    before = run_records(range(1, 5), overhead=0.0)
    k1 = before[-1]["time"] + 0.5
    k2 = k1 + 10.0  # while the group restarts: no step logged since k1
    after = run_records(range(3, 8), t0=k2 + 15.0, restarts=2, overhead=0.0)
    episodes = bg.fault_losses(before + after, [k2, k1], STEP, end=after[-1]["time"])
    assert [e["faults"] for e in episodes] == [2]
    assert episodes[0]["lost_s"] == pytest.approx(0.5 + 10.0 + 15.0 + 2 * STEP)  # steps 3 and 4 redone
    [early] = bg.fault_losses(run_records(range(1, 4), t0=50.0, restarts=1, overhead=0.0), [40.0], STEP, end=60.0)
    assert early["from_step"] == 0 and early["lost_s"] == pytest.approx(52.0 - 40.0 - STEP)  # kill to step 1, less it


def test_an_unrecovered_fault_counts_up_to_the_end():
    before = run_records(range(1, 5), overhead=0.0)
    [e] = bg.fault_losses(before, [before[-1]["time"] + 1.0], STEP, end=before[-1]["time"] + 30.0)
    assert not e["recovered"] and e["lost_s"] == pytest.approx(30.0 - STEP)


def test_goodput_and_a_mode_row():
    assert bg.goodput(40, 5.0, 400.0) == pytest.approx(0.5)
    records = run_records(range(1, 21), saves=(10, 20), overhead=0.0)
    kill = records[11]["time"] + 1.0  # after step 12, 1 s into step 13: the restart redoes 11-12 from step 10
    records = [r for r in records if r["time"] < kill] + run_records(range(11, 21), t0=kill + 9.0, restarts=1,
                                                                     saves=(20,), overhead=0.0)
    mode = {"name": "sync", "start": 90.0, "end": records[-1]["time"] + 4.0, "records": records,
            "saves": {10: records[9]["time"] + 0.1, 20: records[-1]["time"] + 0.1},
            "kills": [{"time": kill}], "log": "[checkpoint] interval auto: every 7 steps (Young/Daly: ...)"}
    row = bg.summarize(mode, STEP)
    assert row["steps"] == 20 and row["saves"] == 2 and row["faults"] == 1 and row["auto_intervals"] == [7]
    assert row["stall_median_s"] == pytest.approx(3.0)
    assert row["lost_s_per_fault"] == pytest.approx(1.0 + 9.0 + 2 * STEP)
    assert row["goodput"] == pytest.approx(20 * STEP / (mode["end"] - 90.0))
    assert bg.reference_step_s(records) == pytest.approx(STEP)
    assert "| sync | 20 |" in bg.table([row])


def test_the_fault_free_step_leaves_out_first_steps_and_steps_with_a_write_in_flight():
    records = run_records(range(1, 11), overhead=0.0)  # step s ends at 100 + 2 s
    records[0] = {**records[0], "step_time_s": 9.0}  # the first step of the attempt: warm-up
    for r in records[4:6]:  # steps 5 and 6, during the write of step 4's checkpoint
        r["step_time_s"] = 3.0
    saves, published = {4: 108.2, 8: 116.1}, {4: 111.9}  # step 8's write never published: no window
    assert bg.write_windows(saves, published) == [(108.2, 111.9)]
    assert bg.clean_steps(records, bg.write_windows(saves, published)) == [STEP] * 7
    assert bg.reference_step_s(records) == pytest.approx(STEP)  # a mode's own median: every step but the first
    assert sorted(bg.clean_steps(records)) == [STEP] * 7 + [3.0, 3.0]


def test_the_fault_schedule_is_seeded_and_exponential():
    a = bg.schedule(3, 180.0, 1e6)
    assert a == bg.schedule(3, 180.0, 1e6) and a != bg.schedule(4, 180.0, 1e6)
    gaps = [y.at_s - x.at_s for x, y in zip(a, a[1:])]
    assert 160 < sum(gaps) / len(gaps) < 200 and {f.rank for f in a} == {0, 1, 2, 3}
    assert not any(f.freeze for f in a) and all(f.at_s <= 600 for f in bg.schedule(3, 180.0, 600))
    assert 0.4 < sum(f.freeze for f in bg.schedule(3, 180.0, 1e6, freeze_fraction=0.5)) / len(a) < 0.6


def test_torn_and_foreign_lines_are_skipped():
    text = "\n".join([json.dumps({"step": 1, "loss": 2.0, "time": 1.0, "step_time_s": 1.0}),
                      json.dumps({"step": 1, "val_loss": 2.0}), '{"step": 2, "lo'])
    assert [r["step"] for r in bg.parse_records(text)] == [1]


@pytest.mark.parametrize("argv,names", [
    (["--steps", "1"], "--steps"), (["--mtbf-minutes", "0"], "--mtbf-minutes"), (["--modes", "sync,nope"], "nope"),
    (["--modes", "sync,sync"], "--modes"), (["--freeze-fraction", "2"], "--freeze-fraction"),
    (["checkpoint.interval=5"], "checkpoint.interval=5"), (["model.no_such_key=1"], "model.no_such_key"),
    (["--json", "{tmp}"], "{tmp}")])
def test_bad_input_is_one_line_and_exit_2(argv, names, capsys, monkeypatch, tmp_path):
    from _cli import run

    argv = [a.format(tmp=tmp_path) for a in argv]
    monkeypatch.setattr(sys, "argv", ["bench_goodput.py", *argv])
    assert run(bg.main) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and names.format(tmp=tmp_path) in err[0], err
