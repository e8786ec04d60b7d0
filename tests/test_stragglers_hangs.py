"""Stragglers and hangs named (issue 55, item 4), on 2 ranks forked by tests/dist_harness.py running train.py's main.

The faults are ``GPT_FAULTS`` (training/faults.py). The slowed rank sleeps 1.5 s in each step, tens of times a tiny
step's own work, so that its own time stays far above the factor even on a loaded machine (the other rank's wait
for it is taken out of its time, not added). The frozen rank sleeps for ever at the start of step 3: its peer's
next collective times out (parallel.timeout_s=5) whatever the machine's load, no race between sleeps.
"""
import queue
import time
from pathlib import Path

from tests.test_train_e2e import FAST, ROOT, records


def test_a_slowed_rank_is_named_by_the_straggler_line(tmp_path):
    from tests.dist_harness import run_world, train_main

    run_dir = tmp_path / "run"
    args = FAST + ["train.max_steps=4", f"logging.run_dir={run_dir}", "checkpoint.save_at_exit=false"]
    [(code, out, err), (code1, _, _)] = run_world(train_main, 2, args, str(ROOT), timeout=180,
                                                  env={"OMP_NUM_THREADS": "1",
                                                       "GPT_FAULTS": "slow:rank=1:step=1:seconds=1.5"})
    assert code == code1 == 0, err
    train = [r for r in records(run_dir) if "loss" in r]
    assert [r["slowest_rank"] for r in train] == [1, 1, 1, 1], train
    for r in train:
        assert r["step_time_max_s"] >= 1.5 and r["step_time_max_s"] > 1.5 * r["step_time_median_s"], r
        assert r["restarts"] == 0
    warnings = [line for line in out.splitlines() if "straggler" in line]
    assert len(warnings) == 1, out  # once per streak: after 3 logging intervals, not again at the 4th
    assert warnings[0].startswith("[train] WARNING: straggler: rank 1 on ") and "up to step 3" in warnings[0] \
        and "logging.straggler_factor=1.5" in warnings[0], warnings[0]


def _frozen_rank_worker(args, cwd):
    from parallel import comm
    from tests.dist_harness import train_main

    comm.ABSENT_GRACE_S = 2.0  # the roll call after a timeout: 10 s in a real job
    return train_main(args, cwd)


def _run_until_all_exit(fn, world, args, env, timeout):
    """Like dist_harness.run_world, but a rank may end by exiting (the frozen one does): {rank: result or exit code}."""
    import torch
    import torch.distributed as dist

    from tests import dist_harness

    ctx = dist_harness._context()
    store = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True, wait_for_workers=False)
    results = ctx.Queue()
    procs = [ctx.Process(target=dist_harness._worker, daemon=True,
                         args=(fn, r, world, store.port, args, env, results, 5.0)) for r in range(world)]
    for p in procs:
        p.start()
    out, deadline = {}, time.monotonic() + timeout
    try:
        while any(p.is_alive() for p in procs) or not results.empty():
            assert time.monotonic() < deadline, f"still running after {timeout} s: the job did not end"
            try:
                rank, status, payload = results.get(timeout=0.2)
            except queue.Empty:
                continue
            assert status == "ok", payload
            import io

            out[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
    return {r: out.get(r, procs[r].exitcode) for r in range(world)}


def test_a_frozen_rank_leaves_every_stack_and_is_named(tmp_path):
    """Rank 1 freezes as it starts step 3. Rank 0's next collective times out after parallel.timeout_s=5; it raises
    the alarm, both ranks write their Python stacks to <run_dir>/stacks/, rank 0 ends with one line naming rank 1,
    the collective and the step, and the frozen rank ends itself (exit 3) soon after."""
    run_dir = tmp_path / "run"
    args = FAST + ["train.max_steps=6", "parallel.timeout_s=5", f"logging.run_dir={run_dir}"]
    began = time.monotonic()
    out = _run_until_all_exit(_frozen_rank_worker, 2, (args, str(ROOT)),
                              {"OMP_NUM_THREADS": "1", "GPT_FAULTS": "freeze:rank=1:step=3"}, timeout=120)
    code, stdout, stderr = out[0]
    assert code == 3 and out[1] == 3, (out[1], stderr)
    errors = [line for line in stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1, stderr
    assert errors[0].startswith("error: ") and "failed on rank 0" in errors[0], errors[0]
    assert "rank(s) [1] did not arrive (collective #" in errors[0] and " in step 3" in errors[0], errors[0]
    assert f"Python stacks of every rank in {run_dir / 'stacks'}/" in errors[0], errors[0]
    stacks = {p.name: p.read_text() for p in Path(run_dir, "stacks").iterdir()}
    assert sorted(stacks) == ["rank0.txt", "rank1.txt"], sorted(stacks)
    assert stacks["rank1.txt"].startswith("rank 1 (pid ") and ", step 3: alarm from another rank" in \
        stacks["rank1.txt"], stacks["rank1.txt"][:500]
    assert 'faults.py", line' in stacks["rank1.txt"] and " in step\n" in stacks["rank1.txt"]  # where it is stuck
    assert "a collective timed out here" in stacks["rank0.txt"] and 'comm.py", line' in stacks["rank0.txt"], \
        stacks["rank0.txt"][:2000]
    print(f"[test_stragglers_hangs] the frozen job ended {time.monotonic() - began:.0f} s after it started")
