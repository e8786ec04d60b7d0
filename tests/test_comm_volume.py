"""The ledger's counted bytes per rank and group equal the analytic TP / SP / PP / DP volume."""
import pytest

from parallel.layout import make_layout
from parallel.volume import step_bytes
from tests.dist_harness import run_world
from tests.parallel_utils import tiny_config, train_worker

CASES = {
    "tp2_dp2_full_recompute": (4, ["parallel.tp=2", "model.activation_checkpointing=full"]),
    "tp2_sp_full_recompute": (2, ["parallel.tp=2", "parallel.sequence_parallel=true",
                                  "model.activation_checkpointing=full"]),
    "pp4_vp2": (4, ["parallel.pp=4", "parallel.virtual_stages=2", "model.n_layers=8"]),
    "tp2_qk_norm": (2, ["parallel.tp=2", "model.qk_norm=true"]),  # its per-head norm weights summed over TP
    "tp2_pp2_sp_tied_dp2": (8, ["parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true",
                                "model.tie_embeddings=true", "model.bias=true", "model.norm=layernorm",
                                "model.activation_checkpointing=selective"]),
    # context parallelism (seq 120: chunks of 15 at cp 4): the ring's hops, the all-gather form's gathers and
    # reduce-scatters, their repeat under recomputation, GQA's KV heads only
    "cp4_p2p_gqa_bf16": (4, ["parallel.cp=4", "model.seq_len=120", "model.n_kv_heads=2", "precision=bf16"]),
    "cp2_all_gather_tp2_sp_selective": (4, ["parallel.cp=2", "parallel.cp_comm=all_gather", "model.seq_len=120",
                                            "parallel.tp=2", "parallel.sequence_parallel=true",
                                            "model.activation_checkpointing=selective"]),
    "cp2_pp2_full_recompute": (4, ["parallel.cp=2", "parallel.pp=2", "model.seq_len=120",
                                   "model.activation_checkpointing=full"]),
}


# ZeRO in half precision (fp32 layouts are checked by every case of tests/test_zero.py)
CASES.update({
    "zero3_bf16_fp32_reduce_tp2_sp_tied_recompute": (
        4, ["zero.stage=3", "precision=bf16", "zero.reduce_dtype=fp32", "parallel.tp=2",
            "parallel.sequence_parallel=true", "model.tie_embeddings=true", "model.activation_checkpointing=full"]),
    "zero2_fp16_whole_tensor_pp2_tied": (4, ["zero.stage=2", "precision=fp16", "zero.partition=whole_tensor",
                                             "parallel.pp=2", "model.tie_embeddings=true",
                                             "loss_scale.initial=1024"]),
    "zero1_bf16_pp2_vp2_dp2": (4, ["zero.stage=1", "precision=bf16", "parallel.pp=2", "parallel.virtual_stages=2",
                                   "train.global_batch_size=16"]),
})


def assert_counted_equals_analytic(out, overrides, world):
    cfg = tiny_config(*overrides)
    layout = make_layout(cfg, world, cfg.parallel.ranks_per_node or world)
    for rank, result in enumerate(out):
        counted = result["comm"]["by_group"]
        analytic = step_bytes(cfg, layout, rank, early=result.get("early", False))
        assert set(counted) == {g for g, v in analytic.items() if v > 0}, (rank, counted, analytic)
        for group, n in analytic.items():
            assert abs(counted.get(group, 0) - n) <= 16, f"rank {rank} {group}: counted {counted.get(group)} vs {n}"


@pytest.mark.parametrize("name", list(CASES))
def test_counted_bytes_equal_analytic(name):
    world, overrides = CASES[name]
    out = run_world(train_worker, world, overrides, 1)
    assert_counted_equals_analytic(out, overrides, world)
    busy = ["tp" if "parallel.tp=2" in overrides else "pp" if "parallel.pp" in str(overrides) else "cp"]
    busy += ["cp"] if "parallel.cp" in str(overrides) else []
    assert all(out[0]["comm"]["by_group"][group] > 0 for group in busy), busy
