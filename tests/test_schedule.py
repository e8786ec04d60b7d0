"""Tests for parallel/schedule.py (pure) and the executed pipeline of parallel/pipeline.py (gloo)."""

from __future__ import annotations

from collections import Counter
from typing import List

import pytest

from parallel.schedule import (Action, Message, forward_schedule, link_orders, needs, sends, simulate,
                               train_schedule)
from tests.dist_harness import run_world

CASES = [(pp, 1, m) for pp in (1, 2, 3, 4, 6) for m in (1, 2, 3, 4, 5, 8, 13)] + \
        [(pp, vp, m) for pp in (2, 3, 4) for vp in (2, 3, 4) for m in (pp, 2 * pp, 3 * pp)]


def _all(pp: int, vp: int, m: int) -> List[List[Action]]:
    return [train_schedule(pp, vp, m, r) for r in range(pp)]


def _warmup(pp: int, vp: int, r: int, m: int) -> int:
    """SPEC §2 / schedule docstring: pp - r - 1 for 1F1B; 2 (pp - r - 1) + (vp - 1) pp interleaved."""
    return pp - r - 1 if vp == 1 else 2 * (pp - r - 1) + (vp - 1) * pp


@pytest.mark.parametrize("pp, vp, m", CASES)
def test_every_action_exactly_once_and_backward_after_forward(pp: int, vp: int, m: int) -> None:
    for r, actions in enumerate(_all(pp, vp, m)):
        expected = [(k, c, b) for k in "FB" for c in range(vp) for b in range(m)]
        assert sorted(actions) == sorted(Action(*a) for a in expected)
        assert len(actions) == len(set(actions)) == 2 * vp * m
        pos = {a: i for i, a in enumerate(actions)}
        for c in range(vp):
            for b in range(m):
                assert pos[Action("F", c, b)] < pos[Action("B", c, b)], (r, c, b)


@pytest.mark.parametrize("pp, vp, m", CASES)
def test_simulation_completes_and_bounds_memory(pp: int, vp: int, m: int) -> None:
    res = simulate(_all(pp, vp, m), pp, vp)
    peaks = res["max_in_flight"]
    assert len(peaks) == pp
    for r in range(pp):
        if vp == 1:
            assert peaks[r] <= pp - r
            assert peaks[r] == min(pp - r, m)
        else:
            assert peaks[r] == min(_warmup(pp, vp, r, m) + 1, vp * m)


@pytest.mark.parametrize("pp, vp, m", CASES)
def test_warmup_count_follows_the_formula(pp: int, vp: int, m: int) -> None:
    total = vp * m
    for r, actions in enumerate(_all(pp, vp, m)):
        leading = next((i for i, a in enumerate(actions) if a.kind == "B"), len(actions))
        warm = min(_warmup(pp, vp, r, m), total)
        # warm-up forwards, then the steady state starts with one more forward (when any remain)
        assert leading == min(warm + 1, total), (r, actions)
        # steady state strictly alternates F, B until the forwards run out
        steady = actions[warm:warm + 2 * (total - warm)]
        assert [a.kind for a in steady] == ["F", "B"] * (total - warm)
        assert all(a.kind == "B" for a in actions[warm + 2 * (total - warm):])


def test_1f1b_by_hand() -> None:
    F, B = (lambda mb: Action("F", 0, mb)), (lambda mb: Action("B", 0, mb))
    assert train_schedule(4, 1, 6, 1) == [F(0), F(1), F(2), B(0), F(3), B(1), F(4), B(2), F(5), B(3), B(4), B(5)]
    assert train_schedule(4, 1, 6, 3) == [F(0), B(0), F(1), B(1), F(2), B(2), F(3), B(3), F(4), B(4), F(5), B(5)]
    assert train_schedule(4, 1, 2, 0) == [F(0), F(1), B(0), B(1)]
    assert train_schedule(1, 1, 3, 0) == [F(0), B(0), F(1), B(1), F(2), B(2)]


def test_interleaved_by_hand() -> None:
    """pp=2, vp=2, 4 micro-batches, rank 0: forwards walk chunk 0 for mbs 0-1, chunk 1 for 0-1, then 2-3;
    backwards walk chunks in reverse; warm-up 2 (pp-r-1) + (vp-1) pp = 4."""
    F, B = (lambda c, mb: Action("F", c, mb)), (lambda c, mb: Action("B", c, mb))
    assert train_schedule(2, 2, 4, 0) == [
        F(0, 0), F(0, 1), F(1, 0), F(1, 1),
        F(0, 2), B(1, 0), F(0, 3), B(1, 1), F(1, 2), B(0, 0), F(1, 3), B(0, 1),
        B(1, 2), B(1, 3), B(0, 2), B(0, 3)]
    assert forward_schedule(2, 2, 4, 1) == [F(0, 0), F(0, 1), F(1, 0), F(1, 1), F(0, 2), F(0, 3), F(1, 2), F(1, 3)]


def test_interleaved_needs_divisible_microbatches() -> None:
    with pytest.raises(ValueError, match="divisible"):
        train_schedule(2, 2, 3, 0)
    with pytest.raises(ValueError, match="divisible"):
        forward_schedule(4, 2, 6, 0)


def _expected_messages(pp: int, vp: int, m: int) -> Counter:
    """Every message of one training step, derived from the virtual-stage chain: v lives on rank v % pp."""
    V = pp * vp
    msgs = Counter()
    for b in range(m):
        for v in range(V - 1):
            msgs[(v % pp, (v + 1) % pp, Message("A", v + 1, b))] += 1
        for v in range(1, V):
            msgs[(v % pp, (v - 1) % pp, Message("G", v - 1, b))] += 1
    return msgs


@pytest.mark.parametrize("pp, vp, m", [c for c in CASES if c[0] > 1])
def test_link_orders_lists_every_message_once_in_send_order(pp: int, vp: int, m: int) -> None:
    schedules = _all(pp, vp, m)
    orders = link_orders(schedules, pp, vp)
    got = Counter((src, dst, msg) for (src, dst), msgs in orders.items() for msg in msgs)
    assert got == _expected_messages(pp, vp, m)
    # order on each link = the order in which the sender runs the producing actions
    for (src, dst), msgs in orders.items():
        produced = []
        for a in schedules[src]:
            v = a.chunk * pp + src
            if a.kind == "F" and v < pp * vp - 1 and (src + 1) % pp == dst:
                produced.append(Message("A", v + 1, a.mb))
            if a.kind == "B" and v > 0 and (src - 1) % pp == dst:
                produced.append(Message("G", v - 1, a.mb))
        assert msgs == produced, (src, dst)


def test_sends_and_needs_pair_up() -> None:
    pp, vp = 3, 2
    for r in range(pp):
        for c in range(vp):
            v = c * pp + r
            f, b = Action("F", c, 7), Action("B", c, 7)
            assert sends(f, pp, vp, r) == ([] if v == pp * vp - 1 else [((r + 1) % pp, Message("A", v + 1, 7))])
            assert needs(f, pp, vp, r) == ([] if v == 0 else [((r - 1) % pp, Message("A", v, 7))])
            assert sends(b, pp, vp, r) == ([] if v == 0 else [((r - 1) % pp, Message("G", v - 1, 7))])
            assert needs(b, pp, vp, r) == ([] if v == pp * vp - 1 else [((r + 1) % pp, Message("G", v, 7))])


def test_forward_only_schedule_simulates() -> None:
    for pp, vp, m in [(4, 1, 5), (2, 2, 4), (3, 3, 6)]:
        schedules = [forward_schedule(pp, vp, m, r) for r in range(pp)]
        res = simulate(schedules, pp, vp)
        assert res["max_in_flight"] == [vp * m] * pp  # nothing is ever released without backwards


def test_broken_schedule_deadlocks_in_the_simulator() -> None:
    pp, vp, m = 4, 1, 4
    schedules = _all(pp, vp, m)
    # rank 0 does all its backwards before its forwards: it waits for gradients that need its activations
    schedules[0] = [a for a in schedules[0] if a.kind == "B"] + [a for a in schedules[0] if a.kind == "F"]
    with pytest.raises(RuntimeError, match="deadlock"):
        simulate(schedules, pp, vp)
    # two middle ranks consuming micro-batches in opposite orders also deadlock
    schedules = _all(pp, vp, m)
    schedules[2] = list(reversed([a for a in schedules[2] if a.kind == "F"])) + \
        [a for a in schedules[2] if a.kind == "B"]
    with pytest.raises(RuntimeError, match="deadlock"):
        simulate(schedules, pp, vp)


def test_simulator_rejects_backward_before_forward_on_last_stage() -> None:
    pp, vp, m = 2, 1, 3
    schedules = _all(pp, vp, m)
    schedules[-1] = [a for a in schedules[-1] if a.kind == "B"] + [a for a in schedules[-1] if a.kind == "F"]
    with pytest.raises((RuntimeError, ValueError, AssertionError)):
        simulate(schedules, pp, vp)


# ---- executed: PipelineRunner on gloo ------------------------------------------------------------------

def pipeline_worker(configs: List[List[str]]) -> list:
    from tests.parallel_utils import train_worker

    return [train_worker(overrides, 1) for overrides in configs]


def _peak(pp: int, vp: int, r: int, m: int) -> int:
    return min(_warmup(pp, vp, r, m) + 1, vp * m)


def test_pipeline_runner_in_flight_pp2_and_interleaved() -> None:
    configs = [["parallel.pp=2"], ["parallel.pp=2", "parallel.virtual_stages=2"]]
    results = run_world(pipeline_worker, 2, configs, timeout=180)
    m = 8 // 2  # tiny_config: global batch 8, micro batch 2, dp 1
    for r, per_config in enumerate(results):
        assert per_config[0]["max_in_flight"] == _peak(2, 1, r, m) <= 2
        assert per_config[1]["max_in_flight"] == _peak(2, 2, r, m)
    # every rank reports the same loss
    for i in range(2):
        assert results[0][i]["losses"] == results[1][i]["losses"]


def test_pipeline_runner_in_flight_pp4() -> None:
    results = run_world(pipeline_worker, 4, [["parallel.pp=4"]], timeout=180)
    for r, per_config in enumerate(results):
        assert per_config[0]["max_in_flight"] == min(4 - r, 4) <= 4
        assert per_config[0]["losses"] == results[0][0]["losses"]
