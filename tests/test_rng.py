"""Tests for parallel/random.py: the two dropout streams, recomputation replaying masks, state round trips."""

from __future__ import annotations

import contextlib
from typing import Dict, List

import pytest
import torch
import torch.nn.functional as F

from tests.dist_harness import run_world

CPU = torch.device("cpu")
N = 4096


def _tracker(seed: int = 1234, tp_rank: int = 0, dp_rank: int = 0, pp_rank: int = 0):
    from parallel.random import RNGTracker

    return RNGTracker(CPU, seed, pp_rank, dp_rank, tp_rank)


def _mask() -> torch.Tensor:
    return F.dropout(torch.ones(N), 0.5, True) != 0


# ---- the tracker on its own -----------------------------------------------------------------------

def test_default_stream_shared_tp_stream_per_rank() -> None:
    with torch.random.fork_rng():
        masks = {}
        for tp_rank in range(4):
            tr = _tracker(tp_rank=tp_rank)
            default = _mask()
            with tr.fork():
                tp = _mask()
            masks[tp_rank] = (default, tp)
        for r in range(1, 4):
            assert torch.equal(masks[r][0], masks[0][0])           # default: identical across TP ranks
            for q in range(r):
                assert not torch.equal(masks[r][1], masks[q][1])   # tp stream: differs per TP rank
            assert not torch.equal(masks[r][1], masks[r][0])
        # another pipeline stage gets another default stream; the seed matters
        _tracker(pp_rank=1)
        assert not torch.equal(_mask(), masks[0][0])
        _tracker(seed=99)
        assert not torch.equal(_mask(), masks[0][0])


def test_fork_leaves_the_default_stream_alone_and_continues_the_tp_stream() -> None:
    with torch.random.fork_rng():
        tr = _tracker()
        d1 = _mask()
        with tr.fork():
            t1 = _mask()
        with tr.fork():
            t2 = _mask()
        d2 = _mask()
        _tracker()  # fresh, same seed
        assert torch.equal(_mask(), d1) and torch.equal(_mask(), d2)  # fork did not consume the default stream
        tr2 = _tracker()
        with tr2.fork():
            assert torch.equal(_mask(), t1) and torch.equal(_mask(), t2)  # one continuous tp stream


def test_checkpoint_contexts_replay_the_tp_stream() -> None:
    with torch.random.fork_rng():
        tr = _tracker()
        forward_ctx, recompute_ctx = tr.checkpoint_contexts()
        with forward_ctx:
            with tr.fork():
                first = _mask()
        with tr.fork():
            after = _mask()
        # reference continuation of the tp stream without any recompute in between
        ref = _tracker()
        with ref.fork():
            _mask()
            _mask()
            expected_next = _mask()
        with recompute_ctx:
            with tr.fork():
                assert torch.equal(_mask(), first)  # the recompute sees the forward's masks
        with tr.fork():
            assert torch.equal(_mask(), expected_next)  # and the stream resumes where it was
        assert not torch.equal(first, after)


def test_state_dict_round_trip() -> None:
    with torch.random.fork_rng():
        tr = _tracker(seed=5, tp_rank=1)
        _mask()
        with tr.fork():
            _mask()
        state = tr.state_dict()
        saved = {k: v.clone() for k, v in state.items()}
        d = _mask()
        with tr.fork():
            t = _mask()
        for k in state:  # drawing did not mutate the saved state
            assert torch.equal(state[k], saved[k]), k
        other = _tracker(seed=77, tp_rank=0)
        other.load_state_dict(state)
        assert torch.equal(_mask(), d)
        with other.fork():
            assert torch.equal(_mask(), t)
        tr.load_state_dict(saved)
        with tr.fork():
            assert torch.equal(_mask(), t)
        assert torch.equal(_mask(), d)


def test_state_from_another_kind_of_device_keeps_this_runs_streams() -> None:
    """A checkpoint written on a GPU holds CUDA generator states (16 bytes, Philox: what
    torch.cuda.get_rng_state returns); resuming it on CPU restores the CPU stream, keeps the tracker's own
    seeded dropout streams (not an error: the H100 run found torch.set_rng_state refusing them) and says so."""
    with torch.random.fork_rng():
        cuda_like = torch.arange(16, dtype=torch.uint8)
        cpu_state = _tracker(seed=9).state_dict()["cpu"]
        fresh = _tracker(seed=5, tp_rank=1)
        with torch.random.fork_rng(), fresh.fork():
            want_tp = _mask()
        fresh = _tracker(seed=5, tp_rank=1)
        assert fresh.load_state_dict({"default": cuda_like, "tp": cuda_like.clone(), "cpu": cpu_state}) is False
        assert torch.equal(torch.get_rng_state(), cpu_state)
        # the dropout streams are still this run's: the default one is the CPU stream (restored just above), the
        # tp one the tracker's own
        with fresh.fork():
            assert torch.equal(_mask(), want_tp)


# ---- recomputation through the model -----------------------------------------------------------------

def _model_cfg(mode: str):
    from config import load_config

    return load_config(None, ["model.n_layers=2", "model.d_model=32", "model.n_heads=4", "model.seq_len=8",
                              "model.vocab_size=64", "model.ffn_hidden=64", "model.dropout=0.3",
                              "model.attention_dropout=0.3", f"model.activation_checkpointing={mode}"]).model


def _tokens(mb: int = 0):
    seq = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(3 + mb))
    return seq[:, :-1], seq[:, 1:]


def _run(mode: str, rank: int, size: int, sp: bool, pg=None, seed: int = 1234, no_replay: bool = False,
         train: bool = True) -> tuple:
    """Loss and gradients of a fresh chunk whose RNG streams are reset to the same state."""
    from model.gpt import GPTChunk
    from model.init import init_parameters
    from model.layers import TPContext
    from parallel.comm import Group, Ledger

    group = Group(name="tp", pg=pg, ranks=list(range(size)), rank=rank, link="intra", ledger=Ledger())
    mcfg = _model_cfg(mode)
    tracker = _tracker(seed=seed, tp_rank=rank)
    if no_replay:  # negative control: a recompute that does not restore the tp stream
        tracker.checkpoint_contexts = lambda: (contextlib.nullcontext(), contextlib.nullcontext())
    chunk = GPTChunk(mcfg, TPContext(group, sp, tracker), range(mcfg.n_layers), first=True, last=True)
    init_parameters(chunk, 1234, rank, size)
    chunk.train(train)
    # two micro-batches as a pipeline stage runs them: F0 F1 B0 B1, so a recompute happens after other
    # forwards have advanced both streams
    losses = [chunk(*_tokens(mb)) for mb in range(2)]
    for loss in losses:
        loss.backward()
    return torch.stack(losses).detach(), {n: p.grad.clone() for n, p in chunk.named_parameters()}


def _assert_identical(a: tuple, b: tuple, what: str) -> None:
    assert torch.equal(a[0], b[0]), f"{what}: losses {a[0].tolist()} != {b[0].tolist()}"
    assert a[1].keys() == b[1].keys()
    for name in a[1]:
        assert torch.equal(a[1][name], b[1][name]), f"{what}: gradient of {name} differs"


def test_dropout_streams_in_layers() -> None:
    """SPEC §2: dropout on activations split across TP (attention heads; residual under SP) draws from the
    per-TP-rank stream, dropout on replicated activations from the shared one."""
    from model.layers import Attention, ResidualDropout, TPContext
    from parallel.comm import Group, Ledger

    mcfg = _model_cfg("off")
    x = torch.ones(4, 2, 32)
    q, k, v = (torch.randn(8, 2, 2, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    with torch.random.fork_rng():
        res = {}
        for sp in (False, True):
            for r in range(2):
                group = Group(name="tp", pg=None, ranks=[0, 1], rank=r, link="intra", ledger=Ledger())
                ctx = TPContext(group, sp, _tracker(tp_rank=r))
                drop = ResidualDropout(0.5, ctx).train()
                attn = Attention(mcfg, ctx).train()
                res[(sp, r)] = (drop(x), attn._core(q, k, v))
    assert torch.equal(res[(False, 0)][0], res[(False, 1)][0])   # replicated: same mask on every TP rank
    assert not torch.equal(res[(True, 0)][0], res[(True, 1)][0])  # sequence slices: per-rank masks
    for sp in (False, True):                                       # heads are split: per-rank masks
        assert not torch.equal(res[(sp, 0)][1], res[(sp, 1)][1])


def _differs(a: tuple, b: tuple) -> bool:
    return not torch.equal(a[0], b[0]) or any(not torch.equal(a[1][n], b[1][n]) for n in a[1])


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recomputation_replays_dropout_single_process(mode: str) -> None:
    with torch.random.fork_rng():
        off = _run("off", 0, 1, False)
        _assert_identical(_run(mode, 0, 1, False), off, mode)
        # the check is sensitive: dropout is active, masks depend on the RNG state, and a recompute that
        # does not restore the tp stream (attention dropout) gives other gradients
        assert _differs(_run("off", 0, 1, False, seed=4321), off)
        assert not torch.equal(_run("off", 0, 1, False, train=False)[0], off[0])
        assert _differs(_run(mode, 0, 1, False, no_replay=True), off)


def rng_worker() -> dict:
    import torch.distributed as dist

    rank, size = dist.get_rank(), dist.get_world_size()
    out: Dict[str, object] = {}
    for sp in (True, False):
        for mode in ("off", "full", "selective"):
            out[(mode, sp)] = _run(mode, rank, size, sp, pg=dist.group.WORLD)
    out["no_replay"] = _run("full", rank, size, True, pg=dist.group.WORLD, no_replay=True)
    # masks of both streams, gathered from every TP rank
    tr = _tracker(tp_rank=rank)
    default = _mask().to(torch.uint8)
    with tr.fork():
        tp = _mask().to(torch.uint8)
    gathered = []
    for m in (default, tp):
        bufs: List[torch.Tensor] = [torch.empty_like(m) for _ in range(size)]
        dist.all_gather(bufs, m)
        gathered.append(bufs)
    out["masks"] = gathered
    # embedding dropout (p=0.3) on each rank's output
    out["embed"] = {}
    for sp in (False, True):
        from model.gpt import GPTChunk
        from model.layers import TPContext
        from parallel.comm import Group, Ledger

        group = Group(name="tp", pg=dist.group.WORLD, ranks=list(range(size)), rank=rank, link="intra",
                      ledger=Ledger())
        mcfg = _model_cfg("off")
        chunk = GPTChunk(mcfg, TPContext(group, sp, _tracker(tp_rank=rank)), range(1), first=True, last=False)
        with torch.no_grad():
            chunk.embedding.weight.fill_(1.0)
            out["embed"][sp] = chunk.embed(torch.zeros(2, 8, dtype=torch.long)).clone()
    return out


def test_tp2_world_recomputation_masks_and_streams() -> None:
    """One world of 2 TP ranks (world start-up is the cost): every check on its results."""
    world = run_world(rng_worker, 2, timeout=180)
    # recomputation replays the masks, including the per-TP-rank stream, with and without SP
    for sp in (True, False):
        for mode in ("full", "selective"):
            for rank, out in enumerate(world):
                _assert_identical(out[(mode, sp)], out[("off", sp)], f"rank {rank} {mode} sp={sp}")
        for out in world:  # every TP rank computes the same (full-sequence) loss
            assert torch.equal(out[("off", sp)][0], world[0][("off", sp)][0])
    # negative control: without restoring the tp stream the recomputed masks differ
    assert any(_differs(out["no_replay"], out[("off", True)]) for out in world)
    # F.dropout masks gathered from both ranks: default stream shared, tp stream per rank
    (default0, default1), (tp0, tp1) = world[0]["masks"]
    assert torch.equal(default0, default1)
    assert not torch.equal(tp0, tp1)
    assert 0.4 < tp0.float().mean().item() < 0.6  # a real p=0.5 dropout mask
    for got, want in zip(world[1]["masks"], world[0]["masks"]):
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    # embedding dropout: replicated activation (no SP) -> same mask; sequence slices (SP) -> per-rank masks
    e0, e1 = world[0]["embed"], world[1]["embed"]
    assert torch.equal(e0[False], e1[False])
    assert e0[True].shape == e1[True].shape == (4, 2, 32)
    assert not torch.equal(e0[True] == 0, e1[True] == 0)
