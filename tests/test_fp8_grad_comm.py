"""Tests for fp8/grad_comm.py: FP8 gradients reduced over data parallelism with a shared scale, and mu
(FP8-LM §2.1, SPEC §4).

Every reduction is checked against a reference the test computes itself, in float64, from the
*dequantized inputs* each rank fed in (``q / s``), never from the code under test:

* the shared scale ``s'`` of a tensor is the MIN of the ranks' scales over the ranks where the tensor is
  not all zero (1 where it is zero everywhere); the result scale is ``N s'``;
* each rank's input re-cast to ``s'`` is ``fp8(q * s' / s)`` (exact when the scales are powers of two);
* a rank of the reduce-scatter holds the float64 sum over ranks of the re-cast inputs on its shard
  (elements ``rank*S .. (rank+1)*S``); the all-reduce's FP8 output is that sum's saturating FP8 cast
  (``clamp(+-max).to(fp8)``), on every rank;
* overflow counts the elements inside tensors whose reduced sum is beyond the format maximum or not
  finite (a sum exactly at the maximum loses nothing and is not counted: the data hold such sums);
  numel counts the elements inside tensors (padding excluded).

The test data keep every value on a grid where the fp32 sum of at most 4 FP8 values is exact (a
tensor's magnitudes span at most 2**6, ranks' magnitudes at most 2**3), so the comparisons are exact.

Layouts (``data`` is flat of length N*S, tensor i at ``bounds[i]``, zero padding):
  flat   -- tensors packed back to back (ZeRO stage 0 / DDP), some spanning a shard boundary;
  whole  -- each tensor inside one shard (FP8-LM's whole-tensor ZeRO), padding after each shard's tensors,
            one tensor empty.
Tensor 2 is all zero on the even ranks (it must not drag the shared scale down to 1), tensor 4 is all
zero on every rank (shared scale 1), tensor 0 has a few elements where every rank sits at its amax with
the same sign and the same scale (the sum saturates).
"""

from __future__ import annotations

import math
from typing import Dict, List, Tuple

import pytest
import torch

from tests.dist_harness import run_world

E5M2, E4M3 = torch.float8_e5m2, torch.float8_e4m3fn
SIZES = [9, 13, 6, 11, 1, 7]
RANK_FACTOR = [1.0, 3.3, 0.45, 1.7]  # ranks' magnitudes differ (by less than 2**3): min picks different ranks
CONFIGS = {  # name -> (format, power_of_two, mu)
    "e5m2_pow2": (E5M2, True, 1.0),
    "e5m2_any": (E5M2, False, 1.0),
    "e4m3_pow2": (E4M3, True, 0.75),
}
HOT = (0, 4, 8)  # elements of tensor 0 where every rank is at +amax
E2E_STEPS, E2E_INTERVAL = 28, 3


def _fmax(dtype) -> float:
    return float(torch.finfo(dtype).max)


# ---- layouts and inputs (pure functions of rank / world size: the parent rebuilds nothing it is not given) ----

def _layout(kind: str, n: int) -> Tuple[List[int], List[Tuple[int, int]], int]:
    """(sizes, bounds, S)."""
    if kind == "flat":
        sizes = list(SIZES)
        bounds, lo = [], 0
        for k in sizes:
            bounds.append((lo, lo + k))
            lo += k
        s = -(-lo // n)
        return sizes, bounds, s
    sizes = list(SIZES) + [0]  # one empty tensor
    shard_of = [i % n for i in range(len(sizes))]
    load = [sum(k for k, r in zip(sizes, shard_of) if r == j) for j in range(n)]
    s = max(load) + 2  # every shard ends with padding
    fill = [0] * n
    bounds = []
    for k, r in zip(sizes, shard_of):
        lo = r * s + fill[r]
        bounds.append((lo, lo + k))
        fill[r] += k
    return sizes, bounds, s


def _grads(rank: int, sizes: List[int], salt: int) -> List[torch.Tensor]:
    """A rank's fp32 gradients: tensor i has magnitudes amax * u, u in [1/64, 1] (or 0), random signs."""
    out = []
    for i, k in enumerate(sizes):
        g = torch.Generator().manual_seed(100 * salt + 10 * i + rank)
        amax = 2.0 ** (3 * i - 7) * (1.0 if i == 0 else RANK_FACTOR[(rank + i) % 4]) * 1.37
        u = torch.exp2(-6 * torch.rand(k, generator=g, dtype=torch.float64))
        sign = torch.where(torch.rand(k, generator=g) < 0.5, -1.0, 1.0).double()
        x = amax * u * sign
        x[torch.rand(k, generator=g) < 0.15] = 0.0
        if k:
            x[0] = amax  # the amax itself is present
        if i == 0:
            x[list(HOT)] = amax
        if i == 2 and rank % 2 == 0 or i == 4:
            x.zero_()
        out.append(x.float())
    return out


def _cast(g, mu, fmt, power_of_two):
    """(q, s, saturated or None): cast_gradient's first two results are the API; a third is its count."""
    from fp8.grad_comm import cast_gradient

    r = cast_gradient(g, mu, fmt, power_of_two=power_of_two)
    return r[0], r[1], (int(r[2]) if len(r) > 2 else None)


def _pack(grads, bounds, n, s_len, fmt, mu, power_of_two):
    data = torch.zeros(n * s_len, dtype=fmt)
    scales = torch.ones(len(grads), dtype=torch.float32)
    saturated = 0
    for i, (g, (lo, hi)) in enumerate(zip(grads, bounds)):
        q, s, sat = _cast(g, mu, fmt, power_of_two)
        data[lo:hi], scales[i] = q, s
        saturated += sat or 0
    return data, scales, saturated


def _group(rank: int, size: int):
    from parallel.comm import Group, Ledger

    return Group(name="dp", pg=None, ranks=list(range(size)), rank=rank, link="intra", ledger=Ledger())


def _reduce_both(data, scales, bounds, rank, n) -> Dict[str, object]:
    """reduce_scatter_fp8 and all_reduce_fp8 of the same input, each on a fresh group (its own ledger)."""
    from fp8.grad_comm import all_reduce_fp8, reduce_scatter_fp8

    g1, g2 = _group(rank, n), _group(rank, n)
    res = reduce_scatter_fp8(data.clone(), scales.clone(), bounds, g1)
    out, rscale, ov, nm = all_reduce_fp8(data.clone(), scales.clone(), bounds, g2)
    return {"data": data, "scales": scales, "bounds": list(bounds),
            "sum": res.sum.clone(), "shared": res.shared_scale.clone(), "rscale": res.result_scale.clone(),
            "overflow": int(res.overflow), "numel": int(res.numel), "fp8": res.fp8().clone(),
            "ar_out": out.clone(), "ar_rscale": rscale.clone(), "ar_overflow": int(ov), "ar_numel": int(nm),
            "rs_ledger": g1.ledger.snapshot(), "ar_ledger": g2.ledger.snapshot()}


# ---- the worker (module level for the forkserver) ----------------------------------------------------------

def _nonfinite_cases(rank: int, n: int, out: Dict[str, object]) -> None:
    """One rank's gradient holds NaN / +inf; the other ranks' are finite."""
    bounds = [(0, 6), (6, 16)]
    s_len = -(-16 // n)
    for case in ("nan", "inf_small", "inf_big"):
        grads = [torch.linspace(-1e-3, 2e-3, 6), torch.linspace(-3e-3, 1e-3, 10)]
        if case == "inf_big" and rank == 0:
            grads[1] = torch.full((10,), 2.0 ** 17)  # scale < 1: the shared scale of tensor 1 is < 1
        grads[1][5] = 0.0
        if rank == 1:
            grads[1][5] = float("nan") if case == "nan" else float("inf")
        data, scales, saturated = _pack(grads, bounds, n, s_len, E5M2, 1.0, True)
        r = _reduce_both(data, scales, bounds, rank, n)
        r["saturated"] = saturated
        r["index"] = 6 + 5
        out[f"nonfinite/{case}"] = r


def _e2e_loop(rank: int, n: int, steps: int, interval: int) -> Dict[str, object]:
    """mu starts at 2**20 (every element saturates); each step: cast with mu, reduce, AutoScale.update."""
    import torch.distributed as dist

    from fp8.grad_comm import AutoScale, reduce_scatter_fp8

    gen = torch.Generator().manual_seed(7)
    base = torch.randn(16, generator=gen).clamp(-2.5, 2.5)
    base[0] = 3.1  # every rank's amax, same element, same sign
    factor = 1.0 + 0.1 * rank
    grads = [base * factor, torch.cat([base, -base[:8]]) * factor * 2.0 ** -10]
    bounds = [(0, 16), (16, 40)]
    s_len = -(-40 // n)
    auto = AutoScale(2.0 ** 20, 1e-5, interval)
    record = []
    for _ in range(steps):
        mu = auto.mu
        data, scales, saturated = _pack(grads, bounds, n, s_len, E5M2, mu, True)
        res = reduce_scatter_fp8(data, scales, bounds, _group(rank, n))
        counts = torch.tensor([res.overflow, saturated, res.numel], dtype=torch.int64)
        dist.all_reduce(counts)  # outside the group under test: not in any ledger
        reduced_over, cast_sat, numel = (int(v) for v in counts)
        auto.update(reduced_over + cast_sat, numel)
        record.append((mu, reduced_over, cast_sat, numel))
    return {"record": record, "final_mu": auto.mu, "changes": auto.changes}


def world(n_expected: int) -> Dict[str, object]:
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    assert n == n_expected
    out: Dict[str, object] = {}
    for kind in ("flat", "whole"):
        sizes, bounds, s_len = _layout(kind, n)
        for salt, (name, (fmt, p2, mu)) in enumerate(CONFIGS.items()):
            grads = _grads(rank, sizes, salt)
            data, scales, _ = _pack(grads, bounds, n, s_len, fmt, mu, p2)
            r = _reduce_both(data, scales, bounds, rank, n)
            r["S"] = s_len
            out[f"{kind}/{name}"] = r
    _nonfinite_cases(rank, n, out)
    if n == 2:
        out["e2e"] = _e2e_loop(rank, n, E2E_STEPS, E2E_INTERVAL)
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=["dp2", "dp4"])
def dp_world(request):
    return request.param, run_world(world, request.param, request.param, timeout=120)


# ---- references (float64, from the dequantized inputs) ---------------------------------------------------

def _reference(ranks: List[Dict[str, object]]) -> Dict[str, torch.Tensor]:
    """shared scale, the re-cast inputs' float64 sum (whole flat length), and the exact mean of q/s."""
    n = len(ranks)
    bounds = ranks[0]["bounds"]
    fmt = ranks[0]["data"].dtype
    m = _fmax(fmt)
    T = len(bounds)
    shared = torch.ones(T, dtype=torch.float64)
    for i, (lo, hi) in enumerate(bounds):
        offers = [float(r["scales"][i]) for r in ranks if bool((r["data"][lo:hi].float() != 0).any())]
        if offers:
            shared[i] = min(offers)
    total = torch.zeros(ranks[0]["data"].numel(), dtype=torch.float64)
    mean = torch.zeros_like(total)
    for r in ranks:
        q = r["data"].float().double()
        for i, (lo, hi) in enumerate(bounds):
            s = float(r["scales"][i])
            recast = (q[lo:hi] * (shared[i].item() / s)).clamp(-m, m).float().to(fmt).float().double()
            total[lo:hi] += recast
            mean[lo:hi] += q[lo:hi] / s
    return {"shared": shared, "sum": total, "mean": mean / n, "max": torch.tensor(m)}


def _inside(bounds, lo_s: int, hi_s: int) -> torch.Tensor:
    """Mask over [lo_s, hi_s) of the elements that belong to a tensor."""
    mask = torch.zeros(hi_s - lo_s, dtype=torch.bool)
    for lo, hi in bounds:
        a, b = max(lo, lo_s), min(hi, hi_s)
        if a < b:
            mask[a - lo_s:b - lo_s] = True
    return mask


def _eq(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual.double(), expected.double(), rtol=0, atol=0, equal_nan=True, msg=what)


def _cases(ranks, prefix=""):
    return [k for k in ranks[0] if k.startswith(prefix) and "/" in k and not k.startswith("nonfinite")]


# ---- 1. reduce-scatter ---------------------------------------------------------------------------------

def test_reduce_scatter_sum_equals_float64_sum_of_recast_inputs(dp_world) -> None:
    n, ranks = dp_world
    for case in _cases(ranks):
        rs = [r[case] for r in ranks]
        ref = _reference(rs)
        S = rs[0]["S"]
        assert rs[0]["data"].numel() == n * S
        for rank, r in enumerate(rs):
            assert r["sum"].dtype == torch.float32 and r["sum"].numel() == S, case
            _eq(r["sum"], ref["sum"][rank * S:(rank + 1) * S], f"{case} rank {rank}: fp32 sum of the shard")


def test_reduce_scatter_with_power_of_two_scales_is_the_exact_mean(dp_world) -> None:
    n, ranks = dp_world
    for case in _cases(ranks):
        if "pow2" not in case:
            continue
        rs = [r[case] for r in ranks]
        ref = _reference(rs)
        S = rs[0]["S"]
        for rank, r in enumerate(rs):
            value = torch.zeros(S, dtype=torch.float64)
            for i, (lo, hi) in enumerate(r["bounds"]):
                a, b = max(lo, rank * S), min(hi, (rank + 1) * S)
                if a < b:
                    value[a - rank * S:b - rank * S] = r["sum"][a - rank * S:b - rank * S].double() / float(
                        r["rscale"][i])
            expected = ref["mean"][rank * S:(rank + 1) * S]
            assert bool((expected.float().double() == expected).all()), "test data: mean must be fp32-exact"
            _eq(value, expected, f"{case} rank {rank}: sum / result_scale vs mean of q/s")


def test_shared_and_result_scales(dp_world) -> None:
    n, ranks = dp_world
    for case in _cases(ranks):
        rs = [r[case] for r in ranks]
        ref = _reference(rs)
        for rank, r in enumerate(rs):
            assert r["shared"].dtype == torch.float32
            _eq(r["shared"], ref["shared"], f"{case} rank {rank}: shared scale = min over non-zero ranks")
            _eq(r["rscale"], n * ref["shared"], f"{case} rank {rank}: result scale = N * shared")
            _eq(r["ar_rscale"], n * ref["shared"], f"{case} rank {rank}: all-reduce result scale")
            assert torch.equal(r["shared"], rs[0]["shared"]) and torch.equal(r["rscale"], rs[0]["rscale"])
        # the data are built so the checks above are not vacuous
        assert ref["shared"][4] == 1.0  # zero on every rank
        zero_ranks = [float(r["scales"][2]) for k, r in enumerate(rs) if k % 2 == 0]
        assert ref["shared"][2] > max(zero_ranks), "a zero tensor's scale must not be the min"
        if "pow2" in case:  # scales differ between ranks, so the min picks one
            assert len({float(r["scales"][1]) for r in rs}) > 1


def test_reduce_scatter_counts_overflow_and_numel_per_shard(dp_world) -> None:
    n, ranks = dp_world
    for case in _cases(ranks):
        rs = [r[case] for r in ranks]
        ref = _reference(rs)
        S, bounds, m = rs[0]["S"], rs[0]["bounds"], float(ref["max"])
        total_over = 0
        for rank, r in enumerate(rs):
            inside = _inside(bounds, rank * S, (rank + 1) * S)
            shard = ref["sum"][rank * S:(rank + 1) * S]
            want_over = int((inside & ~(shard.abs() <= m)).sum())
            assert r["overflow"] == want_over, (case, rank)
            assert r["numel"] == int(inside.sum()), (case, rank)
            total_over += want_over
        assert sum(r["overflow"] for r in rs) == total_over
        assert sum(r["numel"] for r in rs) == sum(hi - lo for lo, hi in bounds)
        assert total_over >= len(HOT), f"{case}: the hot elements must saturate"


# ---- 2. all-reduce -------------------------------------------------------------------------------------

def test_all_reduce_is_the_saturating_fp8_cast_of_the_sum_on_every_rank(dp_world) -> None:
    n, ranks = dp_world
    for case in _cases(ranks):
        rs = [r[case] for r in ranks]
        ref = _reference(rs)
        fmt, m = rs[0]["data"].dtype, float(ref["max"])
        expected = ref["sum"].clamp(-m, m).float().to(fmt)  # plain torch saturating cast
        for rank, r in enumerate(rs):
            out = r["ar_out"]
            assert out.dtype == fmt and out.numel() == rs[0]["data"].numel()
            assert torch.equal(out.view(torch.uint8), rs[0]["ar_out"].view(torch.uint8)), f"{case}: rank {rank}"
            _eq(out.float(), expected.float(), f"{case} rank {rank}: FP8 all-reduce output")
            for i, (lo, hi) in enumerate(r["bounds"]):  # read with its result scale: the DP mean
                _eq(out[lo:hi].float().double() / float(r["ar_rscale"][i]),
                    expected[lo:hi].float().double() / (n * ref["shared"][i]), f"{case} rank {rank} tensor {i}")
            # ReduceResult.fp8() is the shard of the same cast
            S = rs[0]["S"]
            _eq(r["fp8"].float(), expected[rank * S:(rank + 1) * S].float(), f"{case} rank {rank}: fp8()")
        want_over = int((_inside(rs[0]["bounds"], 0, expected.numel()) & ~(ref["sum"].abs() <= m)).sum())
        assert want_over > 0
        assert sum(r["ar_overflow"] for r in rs) == want_over, case
        assert sum(r["ar_numel"] for r in rs) == sum(hi - lo for lo, hi in rs[0]["bounds"]), case


# ---- 3. NaN / inf --------------------------------------------------------------------------------------

def _nonfinite(ranks, case):
    rs = [r[f"nonfinite/{case}"] for r in ranks]
    j = rs[0]["index"]
    S = rs[0]["sum"].numel()
    owner = j // S
    return rs, j, S, owner


def test_nan_gradient_counts_as_overflow_and_stays_nan(dp_world) -> None:
    n, ranks = dp_world
    rs, j, S, owner = _nonfinite(ranks, "nan")
    assert math.isnan(float(rs[owner]["sum"][j - owner * S]))
    assert rs[owner]["overflow"] >= 1
    for r in rs:
        assert math.isnan(float(r["ar_out"][j].float()))
    assert sum(r["ar_overflow"] for r in rs) >= 1
    # the finite elements are still the reference sum
    ref = _reference(rs)
    for rank, r in enumerate(rs):
        _eq(r["sum"], ref["sum"][rank * S:(rank + 1) * S], f"rank {rank}: sum around a NaN")


@pytest.mark.parametrize("case", ["inf_small", "inf_big"])
def test_inf_gradient_counts_as_overflow_and_stays_non_finite(dp_world, case) -> None:
    """+inf in rank 1's gradient. ``inf_big``: rank 0's gradient of that tensor is large (scale 1/4), so the
    shared scale is 1/4 and a saturated (clamped to max) inf would be re-cast to max/4, inside the range."""
    n, ranks = dp_world
    rs, j, S, owner = _nonfinite(ranks, case)
    saturated = sum(r["saturated"] for r in rs)  # cast_gradient's own count, where it has one
    assert rs[owner]["overflow"] + saturated >= 1, "the inf is not counted as overflow anywhere"
    assert sum(r["ar_overflow"] for r in rs) + saturated >= 1
    got = float(rs[owner]["sum"][j - owner * S])
    assert not math.isfinite(got), (
        f"+inf gradient reduced to the finite {got} (read as {got / float(rs[owner]['rscale'][1])})")
    for r in rs:
        assert not math.isfinite(float(r["ar_out"][j].float()))


# ---- 6. bytes --------------------------------------------------------------------------------------------

def test_ledger_bytes_are_one_per_element(dp_world) -> None:
    n, ranks = dp_world
    for case in _cases(ranks):
        for r in (x[case] for x in ranks):
            S, T = r["S"], len(r["bounds"])
            a2a = (n - 1) * S  # (N-1)/N of N*S one-byte elements
            scales = round(2 * (n - 1) / n * 4 * T)  # fp32 MIN all-reduce of the T scales
            bf16_rs = (n - 1) / n * 2 * n * S
            assert r["rs_ledger"]["by_kind"] == {"all_to_all": a2a, "all_reduce": scales}, case
            assert 2 * r["rs_ledger"]["by_kind"]["all_to_all"] == bf16_rs
            assert r["ar_ledger"]["by_kind"] == {"all_to_all": a2a, "all_reduce": scales,
                                                 "all_gather": (n - 1) * S}, case
            assert r["rs_ledger"]["by_group"] == {"dp": a2a + scales}
            assert r["ar_ledger"]["by_link"] == {"intra": a2a + scales + (n - 1) * S, "inter": 0}


# ---- cast_gradient on its own ---------------------------------------------------------------------------

def test_cast_gradient_convention() -> None:
    """value = q / s is mu * g to FP8 precision; zeros get scale 1; power-of-two scales are powers of two."""
    g = torch.linspace(-3.0, 5.0, 33) * 1e-3
    for fmt, rel in ((E5M2, 2.0 ** -3), (E4M3, 2.0 ** -4)):
        for mu in (1.0, 0.5, 0.25):
            for p2 in (False, True):
                q, s, _ = _cast(g, mu, fmt, p2)
                assert q.dtype == fmt and s.dtype == torch.float32 and s.dim() == 0
                assert bool((q.float().abs() <= _fmax(fmt)).all())
                value, want = q.float().double() / float(s), g.double() * mu
                assert bool(((value - want).abs() <= rel * want.abs() + 1e-30).all()), (fmt, mu, p2)
                if p2:
                    assert math.log2(float(s)) == int(math.log2(float(s)))
        q, s, _ = _cast(torch.zeros(5), 4.0, fmt, True)
        assert float(s) == 1.0 and bool((q.float() == 0).all())


def test_cast_gradient_tiny_tensor_with_large_mu_stays_finite() -> None:
    """A finite gradient must not turn into NaN: here ``s * mu`` (5.7e34 * 2**20) overflows fp32, so
    ``x * (s * mu)`` is inf for the non-zero elements and 0 * inf = NaN for the zero one."""
    g = torch.tensor([1e-30, 0.0, -5e-31])
    q, s, _ = _cast(g, 2.0 ** 20, E5M2, False)
    assert not bool(q.float().isnan().any()), f"finite gradient cast to {q.float().tolist()} (scale {float(s)})"
    assert float(q[1].float()) == 0.0


# ---- 4. AutoScale --------------------------------------------------------------------------------------

def test_autoscale_halves_only_above_threshold() -> None:
    from fp8.grad_comm import AutoScale

    a = AutoScale(8.0, 1e-5, 100)
    assert a.update(1, 1000) == 4.0 and a.mu == 4.0 and a.changes == 1
    assert a.last_fraction == pytest.approx(1e-3)
    assert a.update(0, 1000) == 4.0 and a.changes == 1 and a.last_fraction == 0.0
    assert a.update(1, 1000) == 2.0 and a.changes == 2
    b = AutoScale(8.0, 1e-3, 100)  # exactly at the threshold is not above it
    assert b.update(1, 1000) == 8.0 and b.changes == 0
    assert b.update(2, 1000) == 4.0 and b.changes == 1


def test_autoscale_doubles_after_exactly_interval_clean_steps() -> None:
    from fp8.grad_comm import AutoScale

    a = AutoScale(1.0, 1e-5, 4)
    assert [a.update(0, 1000) for _ in range(8)] == [1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 2.0, 4.0]
    assert a.changes == 2
    b = AutoScale(1.0, 1e-5, 4)  # an overflow resets the clean count
    mus = [b.update(0, 1000) for _ in range(3)] + [b.update(5, 1000)] + [b.update(0, 1000) for _ in range(4)]
    assert mus == [1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.5, 1.0]
    assert b.changes == 2 and b.clean == 0


def test_autoscale_state_dict_resumes_identically() -> None:
    import copy
    import io

    from fp8.grad_comm import AutoScale

    steps = [(0, 100), (0, 100), (3, 100), (0, 100), (0, 100),  # saved here: clean = 2
             (0, 100), (0, 100), (0, 100), (1, 100), (0, 100), (0, 100), (0, 100), (0, 100), (0, 100)]
    a = AutoScale(2.0 ** 10, 1e-5, 4)
    for o, k in steps[:5]:
        a.update(o, k)
    buf = io.BytesIO()
    torch.save(copy.deepcopy(a.state_dict()), buf)
    b = AutoScale(3.0, 1e-5, 4)  # same config, other initial mu: everything comes from the state
    b.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
    assert b.mu == a.mu and b.clean == a.clean == 2 and b.changes == a.changes == 1
    for o, k in steps[5:]:
        assert b.update(o, k) == a.update(o, k)
        assert (b.mu, b.clean, b.changes, b.last_fraction) == (a.mu, a.clean, a.changes, a.last_fraction)
    assert a.changes == 4  # halve, double (2 restored + 2 clean), halve, double


# ---- 5. end to end: injected overflow drives mu --------------------------------------------------------

@pytest.fixture(scope="module")
def dp2_world():
    return 2, run_world(world, 2, 2, timeout=120)


def test_injected_overflow_halves_mu_then_clean_steps_double_it(dp2_world) -> None:
    """2 ranks, both with their amax at the same element, same sign. With power-of-two scales and mu >= 1
    the two re-cast amax values sum beyond the maximum (3.1 -> 49152 and 3.41 -> 57344 at mu 1); at mu = 1/2
    every element is at most max/2 on each rank (sums 24576 + 28672 < max): clean."""
    n, ranks = dp2_world
    r0 = ranks[0]["e2e"]
    assert all(r["e2e"]["record"] == r0["record"] for r in ranks)
    record = r0["record"]
    mus = [mu for mu, *_ in record]
    expected = [2.0 ** k for k in range(20, -1, -1)] + [0.5] * E2E_INTERVAL + [1.0] + [0.5] * E2E_INTERVAL
    assert len(expected) == E2E_STEPS
    assert mus == expected
    mu0, over0, sat0, numel0 = record[0]
    assert numel0 == 40
    assert over0 > 0, "at mu = 2**20 the reduced sums saturate"
    for mu, over, sat, _ in record:
        assert (over + sat > 0) == (mu >= 1.0), (mu, over, sat)
    assert r0["final_mu"] == 1.0  # the last 3 steps were clean: doubled after the last one
    assert r0["changes"] == 21 + 1 + 1 + 1


@pytest.mark.parametrize("fmt", [E5M2, E4M3])
@pytest.mark.parametrize("fused", [False, True, "traced"], ids=["cpu_loops", "fused_kernels", "traced"])
def test_whole_buffer_gradient_cast_is_the_per_tensor_cast_bit_for_bit(fmt, fused) -> None:
    """fp8/zero.py casts a unit's gradients with cast_gradients (a few whole-buffer kernels); the reference is
    _cast_gradient on each tensor alone: the same FP8 bytes, scales and saturation count, for tensors that are
    ordinary, tiny, huge (saturating under mu), all zero, empty, holding a NaN or an inf. Traced: as train.compile
    runs it (out of place; inductor's code on this CPU)."""
    from fp8.grad_comm import _cast_gradient, cast_gradients
    from fp8.segments import Segments

    cast, traced = cast_gradients, fused == "traced"
    if traced:
        cast, fused = torch.compile(cast_gradients, backend="inductor"), False

    g = torch.Generator().manual_seed(3)
    pieces = [torch.randn(50, generator=g), torch.randn(7, generator=g) * 1e-30, torch.randn(33, generator=g) * 1e30,
              torch.zeros(9), torch.zeros(0), torch.randn(12, generator=g), torch.randn(5, generator=g)]
    pieces[5][3] = float("nan")
    pieces[6][1] = float("-inf")
    for mu, margin, pow2 in ((1.0, 0, False), (2.0 ** 10, 1, True), (2.0 ** -3, 0, True)):
        want = [_cast_gradient(p.clone(), mu, fmt, margin, pow2) for p in pieces]
        acc = torch.cat(pieces)
        q, scales, saturated = cast(acc, Segments([p.numel() for p in pieces], "cpu", fused=fused), mu, fmt, margin,
                                    pow2)
        ref = torch.cat([w[0] for w in want])
        nan = torch.isnan(ref.float())
        assert torch.equal(torch.isnan(q.float()), nan), mu
        if traced:  # inductor's CPU code writes some NaNs with the sign bit set: a NaN all the same
            q, ref = q[~nan], ref[~nan]
            # out of place: nothing written back into the buffer the caller drops
            torch.testing.assert_close(acc, torch.cat(pieces), rtol=0, atol=0, equal_nan=True)
        assert torch.equal(q.view(torch.uint8), ref.view(torch.uint8)), mu
        assert torch.equal(scales, torch.stack([w[1] for w in want])), mu
        assert int(saturated) == sum(int(w[2]) for w in want), mu


@pytest.mark.parametrize("fmt", ["e5m2", "e4m3"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "traced"])
def test_one_rank_reduce_is_the_exchange_path_bit_for_bit(fmt, compiled):
    """grad_comm.reduce_one_rank (what fp8/zero.py runs at stage 0 with one DP rank) against the general
    _all_reduce_fp8 over a group of one: the output bytes, the shared scales and the overflow count, with a -0,
    a NaN, an infinity (E5M2), an all-zero tensor, an empty one, a non-finite scale and garbage in the gaps.
    Traced: as train.compile runs it (aot_eager: the traced graph on torch's kernels)."""
    from fp8.format import FORMATS
    from fp8.grad_comm import _all_reduce_fp8, _key, _segments, reduce_one_rank

    dtype = FORMATS[fmt]
    g = torch.Generator().manual_seed(5)
    bounds = [(0, 40), (48, 48), (48, 100), (104, 180), (180, 200)]  # gaps 40-48, 100-104, 200-208; one empty
    data = (torch.randn(208, generator=g) * 100).to(dtype)
    data[48:100] = 0.0  # tensor 2 all zero ...
    data[60] = -0.0     # ... one of them a -0
    data[110] = float("nan")
    if fmt == "e5m2":
        data[120] = float("inf")
        data[121] = -float("inf")
    scales = torch.tensor([2.0, 4.0, 0.5, 8.0, float("inf")])
    out, shared, over = (torch.compile(reduce_one_rank, backend="aot_eager") if compiled else reduce_one_rank)(
        data, scales, *(_segments(_key(bounds), 0, data.numel(), data.device)[i] for i in (0, 2)))
    want_out, want_scale, want_over, want_numel = _all_reduce_fp8(data.clone(), scales, bounds, _group(0, 1))
    assert torch.equal(out.view(torch.uint8), want_out.view(torch.uint8))
    assert torch.equal(shared, want_scale)
    assert int(over) == int(want_over) == (3 if fmt == "e5m2" else 1)
    assert shared.tolist() == [2.0, 1.0, 1.0, 8.0, 1.0]  # the all-zero and the empty tensor, the inf scale: 1
    assert want_numel == 40 + 52 + 76 + 20
