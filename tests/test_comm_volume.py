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
    "tp2_pp2_sp_tied_dp2": (8, ["parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true",
                                "model.tie_embeddings=true", "model.bias=true", "model.norm=layernorm",
                                "model.activation_checkpointing=selective"]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_counted_bytes_equal_analytic(name):
    world, overrides = CASES[name]
    out = run_world(train_worker, world, overrides, 1)
    cfg = tiny_config(*overrides)
    layout = make_layout(cfg, world, world)
    for rank, result in enumerate(out):
        counted = result["comm"]["by_group"]
        analytic = step_bytes(cfg, layout, rank)
        assert set(counted) == {g for g, v in analytic.items() if v > 0}, (rank, counted, analytic)
        for group, n in analytic.items():
            assert abs(counted.get(group, 0) - n) <= 16, f"rank {rank} {group}: counted {counted.get(group)} vs {n}"
        assert counted["tp" if layout.tp > 1 else "pp"] > 0
